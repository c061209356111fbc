"""`python -m bench`: the end-to-end benchmark (bench/run.py)."""

import sys

from bench.run import main

sys.exit(main())
