"""``python -m ckptlib ...``: the ``ckptlib`` command line (:func:`ckptlib.cli.main.main`)."""

import sys

from ckptlib.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
