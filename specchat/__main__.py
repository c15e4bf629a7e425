"""`python -m specchat`: the headless commands (specchat/cli.py)."""

import sys

from specchat.cli import main

sys.exit(main())
