"""The ``shmcache`` command line (entry-point layer): ``stat``, ``ls``, ``info``, ``gc``, ``export``,
``import``, ``destroy``. It never imports torch."""

from .main import main

__all__ = ["main"]
