"""Every ``SHMCACHE_*`` environment variable, and the one place that reads them.

The launcher writes some of these for its workers (with the same names from here); a cache reads
them as the defaults of its arguments. Each is read when it is needed - at the call, so a test or a
program may set one at run time - except two read once, when their module is imported:
``SHMCACHE_ORDERING`` (the fences of ``ordering``) and ``SHMCACHE_CRASH_AT``/``_AFTER`` (the
crash points of ``faults``). The on/off ones (``SWITCHES``) take 1, true, yes, on or 0, false, no,
off; any other word is refused at each entry point (``check_switches``).

======================== ===================================================================
variable                 meaning (read by)
======================== ===================================================================
SHMCACHE_DIR             the namespace's directory, an absolute path (``namespace``)
SHMCACHE_SESSION         the session of ``session="auto"`` (``namespace``; the launcher sets it)
SHMCACHE_SIZE_MB         the default ``size=`` of caches, MiB (data/; the launcher's --size)
SHMCACHE_SPILLING        "1", "true", "yes", "on": the default ``spilling=True`` (the launcher's --spilling)
SHMCACHE_SPILL_DIR       the spill directory of last resort (``tiers.spill.tier``, the launcher, the CLI)
SHMCACHE_MEMORY_DIR      a tmpfs or hugetlbfs directory for the shared memory of sessions made
                         from now on (default /dev/shm); each session records its own
                         (``SessionRegistry``; the launcher's --memory-dir)
SHMCACHE_REMOTE          the default ``remote=`` URL (``RedisTier``; the launcher's --remote)
SHMCACHE_REMOTE_PASSWORD the password of a remote URL that has none (``RedisTier``)
SHMCACHE_SNAPSHOT        the default ``snapshot=`` (data/)
SHMCACHE_SECRET          the job's secret: MACs of records (``trust``; the launcher may make one)
SHMCACHE_MAX_ITEM_MB     the most MiB one value from an unauthenticated tier, snapshot or import may
                         decode to (default 256; ``records.max_item_bytes``)
SHMCACHE_RDZV_TOKEN      the launcher's rendezvous token (launch/; never passed to the workers)
SHMCACHE_ORDERING        "membarrier" or "tso": the memory-ordering mode (``ordering``, at import)
SHMCACHE_CRASH_AT        crash points of the crash tests (``faults``, at import) ...
SHMCACHE_CRASH_AFTER     ... and how many of them to pass first
SHMCACHE_CLAIMS          "0", "false", "no", "off": misses compute without claims (``claims``)
SHMCACHE_CLAIM_TIMEOUT_S the longest a miss waits for another process's claim, s (default 10;
                         ``claims``)
SHMCACHE_NATIVE          "0", "false", "no", "off": the batch gather copies with numpy, not the
                         compiled row copy (``rowcopy``), and an int key's hit takes the Python
                         hot path, not the compiled one (``cache.hit``); both at import
RANK, LOCAL_RANK,        torchrun's, which the launcher sets for each worker as torchrun does:
WORLD_SIZE,              the torch layer reads them (``NodeAffineSampler``; a warm-up's bar and
LOCAL_WORLD_SIZE         offsets; a worker's name)
======================== ===================================================================
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["PREFIX", "ENV_DIR", "ENV_SESSION", "ENV_SIZE_MB", "ENV_SPILLING", "ENV_SPILL_DIR", "ENV_REMOTE",
           "ENV_MEMORY_DIR", "ENV_REMOTE_PASSWORD", "ENV_SNAPSHOT", "ENV_SECRET", "ENV_MAX_ITEM_MB", "ENV_RDZV_TOKEN",
           "ENV_LAUNCH", "ENV_ORDERING", "ENV_NATIVE",
           "ENV_CRASH_AT", "ENV_CRASH_AFTER", "ENV_CLAIMS", "ENV_CLAIM_TIMEOUT_S", "ENV_RANK", "ENV_LOCAL_RANK",
           "ENV_WORLD_SIZE", "ENV_LOCAL_WORLD_SIZE", "get", "flag", "turned_off", "SWITCHES", "check_switches",
           "native_unavailable", "without_ours"]

PREFIX = "SHMCACHE_"
ENV_DIR = "SHMCACHE_DIR"
ENV_SESSION = "SHMCACHE_SESSION"
ENV_SIZE_MB = "SHMCACHE_SIZE_MB"  # default size= of caches (the launcher's --size)
ENV_SPILLING = "SHMCACHE_SPILLING"  # "1": default spilling=True (the launcher's --spilling)
ENV_SPILL_DIR = "SHMCACHE_SPILL_DIR"
ENV_MEMORY_DIR = "SHMCACHE_MEMORY_DIR"  # where new sessions' segments live (a tmpfs or hugetlbfs)
ENV_REMOTE = "SHMCACHE_REMOTE"  # the default remote= of caches (the launcher's --remote)
ENV_REMOTE_PASSWORD = "SHMCACHE_REMOTE_PASSWORD"  # the password of a URL that has none (kept off command lines)
ENV_SNAPSHOT = "SHMCACHE_SNAPSHOT"
ENV_SECRET = "SHMCACHE_SECRET"  # the job's record secret (made per job by --remote spawn unless set)
ENV_MAX_ITEM_MB = "SHMCACHE_MAX_ITEM_MB"  # the largest value from an unauthenticated source, MiB
ENV_RDZV_TOKEN = "SHMCACHE_RDZV_TOKEN"
ENV_LAUNCH = "SHMCACHE_LAUNCH"  # set by the launcher in its processes: which launch they are (launch.sharers)
ENV_ORDERING = "SHMCACHE_ORDERING"
ENV_CRASH_AT = "SHMCACHE_CRASH_AT"
ENV_CRASH_AFTER = "SHMCACHE_CRASH_AFTER"
ENV_CLAIMS = "SHMCACHE_CLAIMS"  # "0": misses compute without claims (NOTE [claims])
ENV_CLAIM_TIMEOUT_S = "SHMCACHE_CLAIM_TIMEOUT_S"  # the longest wait for another's claim
ENV_NATIVE = "SHMCACHE_NATIVE"  # "0": no compiled row copy (rowcopy) nor compiled hit (cache.hit)
# torchrun's, which the launcher sets for each worker like torchrun and the torch layer reads
ENV_RANK = "RANK"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def get(name: str, default: str | None = None) -> str | None:
    """The variable's value now, as set (``default`` when it is not set)."""
    return os.environ.get(name, default)


def _switch(name: str) -> bool | None:
    """An on/off variable: True (1, true, yes, on), False (0, false, no, off: any case, spaces
    around ignored) or None (unset or empty). Any other word is refused rather than taken as the
    default: SHMCACHE_SPILLING=enabled meant on, and silently off it filled the cache instead."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return None
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    from ..errors import InvalidArgument  # (errors imports nothing of shmcache's)

    raise InvalidArgument(f"{name}={raw!r} is neither on nor off: set it to one of {', '.join(_TRUE)} or one of "
                          f"{', '.join(_FALSE)}, or unset it")


def flag(name: str) -> bool:
    """Whether the variable is set to 1, true, yes or on; unset, empty or 0, false, no, off: False.
    Raises InvalidArgument for any other value."""
    return _switch(name) is True


def turned_off(name: str) -> bool:
    """Whether an on-by-default variable is set to 0, false, no or off; unset, empty or 1, true,
    yes, on: False. Raises InvalidArgument for any other value."""
    return _switch(name) is False


SWITCHES = (ENV_SPILLING, ENV_CLAIMS, ENV_NATIVE)  # the on/off variables


def check_switches(skip: tuple[str, ...] = ()) -> None:
    """Refuse (InvalidArgument) an on/off variable of ``SWITCHES`` set to any other word, ``skip``
    aside: the entry points call it first (``ShmDatasetCache``, the command line, the launcher),
    so the refusal is one clean error there - not a traceback in ``import shmcache`` (NATIVE is
    read at import), nor a store that cannot open inside ``shmcache gc`` (CLAIMS), which gc took
    for a cache gone meanwhile and repaired nothing, nor N ranks dying after the launcher started
    them."""
    for name in SWITCHES:
        if name not in skip:
            _switch(name)


def native_unavailable(built: bool, what: str) -> str:
    """Why a compiled part of shmcache is not used, and what to do ('' when it is used): not
    built at install, or turned off by SHMCACHE_NATIVE (``what``: what unsetting it gives). A
    SHMCACHE_NATIVE of any other word is not raised here, at import, where nothing can report
    it (the command line, `shmcache destroy` included, died in its imports): it turns the
    compiled part off, naming the word, and ``check_switches`` refuses it at each entry point."""
    if not built:  # no C compiler at install, or a source checkout never built
        return ("not built at install (no C compiler or Python headers there): reinstall shmcache where both are "
                "present (apt install gcc python3-dev)")
    from ..errors import InvalidArgument

    try:
        off = turned_off(ENV_NATIVE)
    except InvalidArgument as exc:
        return str(exc)
    if off:
        return f"turned off by {ENV_NATIVE}: unset it for {what}"
    return ""


def without_ours(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less every ``SHMCACHE_*`` variable (for a process that is not a worker: the
    job's secret, the rendezvous token and the remote URL are none of its business)."""
    return {k: v for k, v in environ.items() if not k.startswith(PREFIX)}
