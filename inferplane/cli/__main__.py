"""`python -m inferplane.cli`: the console script."""

import sys

from inferplane.cli.main import main

sys.exit(main())
