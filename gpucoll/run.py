"""``python -m gpucoll.run -n 4 script.py`` is ``gpucoll run -n 4 script.py``."""

import sys

from gpucoll.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
