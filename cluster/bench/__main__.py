"""`python -m cluster.bench ARGS` = `duet bench ARGS`."""

import sys

from cluster.bench.cli import main

sys.exit(main())
