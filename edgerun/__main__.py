"""``python -m edgerun``: the same as the ``edgerun`` command."""

import sys

from edgerun.cli import main

sys.exit(main())
