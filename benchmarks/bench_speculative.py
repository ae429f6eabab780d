"""`edgerun bench speculative`: see edgerun/bench/speculative.py (what it measures, options)."""

import sys

from edgerun.bench.speculative import main

sys.exit(main())
