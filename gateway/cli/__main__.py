"""``python -m gateway.cli``: the ``kvgate`` command (``gateway.cli.main``)."""

import sys

from gateway.cli.main import main

sys.exit(main())
