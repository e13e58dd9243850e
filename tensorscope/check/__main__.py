"""``python -m tensorscope.check``: see tensorscope/check/__init__.py."""

import sys

from tensorscope.check.cli import main

sys.exit(main())
