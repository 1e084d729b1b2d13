"""``python -m shmcache.cli``: the same as ``python -m shmcache`` and the ``shmcache`` command."""

import sys

from .main import main

sys.exit(main())
