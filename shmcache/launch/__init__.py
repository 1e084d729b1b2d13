"""The launcher: ``python -m shmcache.launch``, a drop-in for ``torchrun`` around one shmcache session.

    run             the command line: options, the session, each rank's environment (``main``)
    supervisor      the process machinery: start, watch and stop the workers (NOTE [launcher shutdown])
    remote_option   --remote: a Redis URL for the workers or spawn[:MB], its password out of sight
    rendezvous      the launchers' exchange of their Redis endpoints (NOTE [remote rendezvous])
    redis_node      --remote spawn: this node's redis-server, proven its own (NOTE [spawned redis])
    metrics_server  --metrics-port: the node's /metrics while the job runs; the closing summary

As torchrun's ``run`` is apart from ``torch.distributed.elastic.multiprocessing``: the
supervisor knows nothing of options or sessions. Neither imports torch.

May import: ``data``, ``snapshot``, ``tiers``, ``cache``, ``base``, ``errors`` and the package
root; and modules of this room without a cycle.

Start reading at ``run.main`` (its module docstring is the manual), then NOTE [launcher shutdown].
"""

from .run import main, manual

__all__ = ["main", "manual"]
