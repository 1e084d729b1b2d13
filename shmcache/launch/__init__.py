"""The launcher: ``python -m shmcache.launch``, a drop-in for ``torchrun`` around one shmcache session.

    run.py          the command line: options, the session, each rank's environment (``main``)
    supervisor.py   the process machinery: start, watch and stop the workers (NOTE [launcher shutdown])
    remote_option.py  --remote: a Redis URL for the workers or spawn[:MB], its password out of sight
    rendezvous.py   the launchers' exchange of their Redis endpoints (NOTE [remote rendezvous])
    redis_node.py   --remote spawn: this node's redis-server, proven its own (NOTE [spawned redis])

As torchrun's ``run.py`` is apart from ``torch.distributed.elastic.multiprocessing``: the
supervisor knows nothing of options or sessions. Neither imports torch.
"""

from .run import main, manual

__all__ = ["main", "manual"]
