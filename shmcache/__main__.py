"""``python -m shmcache``: the same command line as ``shmcache``."""

import sys

from .cli.main import main

sys.exit(main())
