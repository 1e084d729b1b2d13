"""What a system under comparison ("peer") provides to ``compare.py``.

A peer lives in the parent process: it checks it can run (``skip_reason``), is filled from the source
dataset (``fill``, timed by the caller), says how much memory it holds and where (``memory``), and
describes itself to reader processes with a small picklable ``spec``. The reading happens in its
module's ``open_reader(spec, path, rank, world, port)``, called in each reader process (see
NOTE [reader protocol] in ``_runner``); it returns an object with ``epoch(indices) -> list of chunk
seconds`` and ``close()``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Memory", "Peer", "ReadPath"]


@dataclass(frozen=True)
class ReadPath:
    key: str          # passed to open_reader
    label: str        # shown in the table
    batched: bool     # returns collated batches of CHUNK items (compared with shmcache's get_batch)
    chunked: bool = True  # latencies are per CHUNK items (False: one bulk copy, no per-batch p90)


@dataclass(frozen=True)
class Memory:
    bytes: int | None
    where: str        # "shm", "disk", "redis used_memory", "—"
    note: str = ""


class Peer:
    name = "peer"
    module = __name__
    paths: tuple[ReadPath, ...] = ()

    def skip_reason(self) -> str | None:
        """None when the peer can run; else why not (shown as ``skipped (reason)``)."""
        return None

    def version(self) -> str:
        return ""

    def fill(self, workload) -> None:
        raise NotImplementedError

    def spec(self) -> dict:
        return {}

    def memory(self) -> Memory:
        return Memory(None, "—")

    def after_run(self) -> None:
        """Called after each set of reader processes has exited (e.g. to clean their leftovers)."""

    def close(self) -> None:
        """Remove everything the peer made (servers, files, segments). Safe to call twice."""
