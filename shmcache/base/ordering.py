"""Memory ordering between a writer and lock-free readers: an asymmetric fence, membarrier(2).

NOTE [publish order] (store.py) needs one thing of the hardware: a reader that loads a word a
writer published (an entry's READY state word, the root's epoch word, a class's bump) also sees
what the writer stored before it (the record's bytes, the key and location words, a new table).
x86-64 gives that for free (TSO: stores become visible in program order, loads are not reordered
with older loads). A weakly ordered CPU (aarch64: Grace Hopper, Graviton) does not, and Python has
no fences; a fence per read through ctypes would cost as much as the read.

So the writer pays, once per publication: ``fence()`` is ``membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED)``
(Linux >= 4.16). Before it returns, every running thread of every process registered with
``MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED`` has executed a full memory barrier (an IPI), and every
thread not running passes one when it is next scheduled. The argument, for a writer that stores
D (the data), calls ``fence()``, then stores F (the flag), and a registered reader that loads F
and then D in program order: the reader's barrier falls at some point P of its program. If P is
before its load of F, both loads come after P, and D was visible to all before P (the writer's
own full barrier precedes the IPIs): the reader sees D. If P is after its load of F, that load
completed before P, hence before the fence returned, hence before F was stored: it saw the old F.
So a reader that sees the new F sees D - as if it had a barrier between its two loads, at no cost
to it. The same argument, with F the reuse and D the retirement, orders "retire, fence, reuse": a
reader that sees reused memory and then re-checks the retiring word sees the retirement.

Where it applies (``mode()``):

* x86-64 (and 32-bit x86): ``"tso"`` - no fence is ever made; today's speed exactly.
* any other architecture: ``"membarrier"`` - fences on; a machine whose kernel lacks the command,
  or a seccomp profile that refuses it, refuses to open a cache (OrderingUnavailable), never runs
  unfenced.
* ``SHMCACHE_ORDERING=membarrier`` forces the fences on x86 too (tests and benchmarks run the
  weak-ordering path here); ``SHMCACHE_ORDERING=tso`` is honoured on x86 only.

Registration is state of the address space (the kernel keeps it in the mm): a new program (exec)
starts unregistered, and a forked child's copy of the mm keeps its parent's registration
(tests/unit/base/test_ordering.py checks both on the running kernel). Every process registers when it
first maps a segment (``register()``, from base/shm.py and CacheStore); a forked child registers
again all the same (os.register_at_fork: idempotent), so a kernel that reset it at fork would not
leave a child that reads inherited mappings unfenced.

``fences()`` counts the fences this process made (the tests count them per operation).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

from ..errors import OrderingUnavailable
from . import settings

__all__ = ["fence", "register", "mode", "fences", "enabled", "OrderingUnavailable", "ENV"]

ENV = settings.ENV_ORDERING

MEMBARRIER_CMD_QUERY = 0
MEMBARRIER_CMD_GLOBAL_EXPEDITED = 1 << 1
MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED = 1 << 2
MEMBARRIER_CMD_PRIVATE_EXPEDITED = 1 << 3  # only the fork test uses these two (per-mm state)
MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED = 1 << 4

# __NR_membarrier per architecture (the kernel's syscall tables; asm-generic for the newer ones)
SYS_MEMBARRIER = {
    "x86_64": 324, "amd64": 324, "i386": 375, "i686": 375, "x86": 375,
    "aarch64": 283, "arm64": 283, "riscv64": 283, "loongarch64": 283,
    "armv7l": 389, "armv8l": 389,
    "ppc64le": 365, "ppc64": 365, "s390x": 356,
}
_TSO = ("x86_64", "amd64", "i386", "i686", "x86")


def _machine() -> str:
    return platform.machine().lower()


def _choose_mode() -> str:
    wanted = settings.get(ENV, "").strip().lower()
    if wanted not in ("", "membarrier", "tso"):
        raise OrderingUnavailable(f"{ENV}={wanted!r} is not a setting; use {ENV}=membarrier (fences on, "
                                  f"any machine) or leave it unset")
    if wanted == "membarrier" or _machine() not in _TSO:
        return "membarrier"
    return "tso"


_MODE = _choose_mode()
_FENCES = 0
_registered_pid = 0  # the process that registered (a forked child is another)
_syscall = None
_NR = 0


def mode() -> str:
    """``"tso"`` (no fences: x86) or ``"membarrier"`` (fences on)."""
    return _MODE


def enabled() -> bool:
    return _MODE == "membarrier"


def fences() -> int:
    """How many fences this process has made (0 in mode ``"tso"``)."""
    return _FENCES


def _membarrier(cmd: int) -> int:
    """The raw syscall: its result, or -errno."""
    global _syscall, _NR
    if _syscall is None:
        nr = SYS_MEMBARRIER.get(_machine())
        if nr is None:
            raise OrderingUnavailable(
                f"shmcache does not know membarrier(2)'s system call number on {platform.machine()}, and "
                f"this machine may order memory weakly: its lock-free reads are not safe here. Add "
                f"the number to shmcache/base/ordering.py's SYS_MEMBARRIER (asm/unistd.h) and run the tests")
        fn = ctypes.CDLL(None, use_errno=True).syscall
        fn.restype = ctypes.c_long
        fn.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_uint, ctypes.c_int]
        _syscall, _NR = fn, nr
    r = _syscall(_NR, cmd, 0, 0)
    return r if r >= 0 else -ctypes.get_errno()


def _refuse(why: str) -> OrderingUnavailable:
    forced = _machine() in _TSO
    return OrderingUnavailable(
        f"shmcache's lock-free reads need memory fences on {platform.machine()}"
        f"{f' ({ENV}=membarrier)' if forced else ''}, made with membarrier(2) "
        f"MEMBARRIER_CMD_GLOBAL_EXPEDITED, and {why}. It needs Linux >= 4.16 and a seccomp profile "
        f"that allows membarrier (Docker's default does; add it to a custom profile)"
        f"{f', or unset {ENV}' if forced else ''}")


def register() -> None:
    """Register this process for the expedited global fence (once per process; again in a
    forked child). No-op in mode ``"tso"``. OrderingUnavailable where the kernel refuses."""
    global _registered_pid
    if _MODE != "membarrier" or _registered_pid == os.getpid():
        return
    supported = _membarrier(MEMBARRIER_CMD_QUERY)
    if supported < 0:
        raise _refuse(f"the kernel refuses membarrier ({errno.errorcode.get(-supported, -supported)}: "
                      f"{os.strerror(-supported)})")
    need = MEMBARRIER_CMD_GLOBAL_EXPEDITED | MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED
    if supported & need != need:
        raise _refuse(f"this kernel does not offer it (membarrier's commands: {supported:#x})")
    r = _membarrier(MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED)
    if r < 0:
        raise _refuse(f"registering for it failed ({errno.errorcode.get(-r, -r)}: {os.strerror(-r)})")
    _registered_pid = os.getpid()


def fence() -> None:
    """Order this process's earlier stores before its later ones for every registered reader
    (see the module docstring). No-op in mode ``"tso"``."""
    global _FENCES
    if _MODE != "membarrier":
        return
    if _registered_pid != os.getpid():
        register()
    r = _syscall(_NR, MEMBARRIER_CMD_GLOBAL_EXPEDITED, 0, 0)
    if r < 0:
        e = ctypes.get_errno()
        raise _refuse(f"the fence failed ({errno.errorcode.get(e, e)}: {os.strerror(e)})")
    _FENCES += 1


def _after_fork_in_child() -> None:
    global _registered_pid, _FENCES
    _registered_pid, _FENCES = 0, 0  # another process: its own registration and count
    if _MODE == "membarrier":
        try:
            register()  # before the child's first read of a mapping it inherited
        except OrderingUnavailable:
            pass  # the parent registered, so this cannot be the kernel; its next map() says so


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
