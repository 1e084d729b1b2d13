"""``python -m shmcache``: the same command line as ``shmcache``."""

import sys

from .cli import main

sys.exit(main())
