"""specchat's web app: `python app.py --help`. The launcher lives in `specchat/app.py`, which
`specchat app` runs too once the package is installed."""

import sys

from specchat.app import main

if __name__ == "__main__":
    sys.exit(main())
