"""``python -m gateway.cli``: the ``kvgate`` command (``gateway.cli.main``)."""

import sys

from gateway.cli.main import main

if __name__ == "__main__":  # imported (a walk over the package), it runs nothing
    sys.exit(main())
