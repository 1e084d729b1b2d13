"""The launcher: ``python -m shmcache.launch``, a drop-in for ``torchrun`` around one shmcache session.

    run.py          the command line: options, the session, each rank's environment (``main``)
    supervisor.py   the process machinery: start, watch and stop the workers (NOTE [launcher shutdown])

As torchrun's ``run.py`` is apart from ``torch.distributed.elastic.multiprocessing``: the
supervisor knows nothing of options or sessions. Neither imports torch.
"""

from .run import main, manual

__all__ = ["main", "manual"]
