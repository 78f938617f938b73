"""``python -m gpucoll.bench`` is ``gpucoll bench`` (how the driver starts its ranks)."""

import sys

from gpucoll.bench.cli import main

sys.exit(main())
