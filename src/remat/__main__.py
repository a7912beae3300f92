"""``python -m remat``: the ``remat`` command (``remat.cli:main``, the console script's entry
point), with its exit codes."""

import sys

from remat.cli import main

if __name__ == "__main__":
    sys.exit(main())
