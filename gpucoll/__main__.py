import sys

from gpucoll.cli import main

sys.exit(main())
