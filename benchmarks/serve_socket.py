"""`edgerun bench socket`: see edgerun/bench/serve_socket.py (what it measures, options)."""

import sys

from edgerun.bench.serve_socket import main

sys.exit(main())
