"""`python -m dtp_kernels ...`: the command line."""

import sys

from .cli import main

sys.exit(main())
