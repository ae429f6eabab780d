"""`edgerun bench streaming`: see edgerun/bench/streaming.py (what it measures, bounds, options)."""

import sys

from edgerun.bench.streaming import main

sys.exit(main())
