"""`python -m specdec`: the command line."""

import sys

from specdec.cli import main

sys.exit(main())
