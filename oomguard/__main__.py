"""``python -m oomguard``: the same as the ``oomguard`` command."""

import sys

from oomguard._cli.main import main

if __name__ == "__main__":
    sys.exit(main())
