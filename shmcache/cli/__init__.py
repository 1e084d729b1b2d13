"""The ``shmcache`` command line (entry-point layer): ``stat``, ``top``, ``ls``, ``new``, ``info``,
``gc``, ``export``, ``import``, ``destroy``. It never imports torch.

May import: ``launch``, ``data``, ``snapshot``, ``tiers``, ``cache``, ``base``, ``errors`` and the
package root; and modules of this room without a cycle.

Start reading at ``main.main`` (one ``cmd_<name>`` function per command), then ``top``.
"""

from .main import main

__all__ = ["main"]
