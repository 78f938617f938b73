"""``python -m gpucoll.launch`` is ``gpucoll run``."""

import sys

from gpucoll.launch.cli import main

sys.exit(main())
