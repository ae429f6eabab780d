"""`edgerun bench concurrent`: see edgerun/bench/concurrent.py (what it measures, options)."""

import sys

from edgerun.bench.concurrent import main

sys.exit(main())
