"""``python -m oomguard``: the same as the ``oomguard`` command."""

import sys

from oomguard._cli import main

sys.exit(main())
