"""`edgerun bench decode`: see edgerun/bench/decode.py (what it measures, bounds, options)."""

import sys

from edgerun.bench.decode import main

sys.exit(main())
