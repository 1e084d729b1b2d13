"""The remote tier: a cache's values in Redis, behind each node's shared memory (issue 11).

Several nodes, one cache: each node keeps what it has in shared memory (``CacheStore``), and what it
misses is read from Redis before it is computed; what it computes is written to Redis behind the
training loop, so each sample is computed about once per job and crosses the network at most once
per node. redis-py (with hiredis) is the client: ``pip install 'shmcache[redis]'``.

URLs (``ShmDatasetCache(remote=...)``, ``$SHMCACHE_REMOTE``, ``shmcache new NAME --remote URL``)::

    redis://[[user]:password@]host[:port][/db]           one server
    rediss://...                                           the same over TLS
    redis+cluster://[[user]:password@]h1:p1[,h2:p2...]     a Redis Cluster (rediss+cluster: TLS)
    redis+shards://[[user]:password@]h1:p1,h2:p2,...[/db]  N standalone servers, keys sharded by
                                                           jump consistent hash in the listed order
                                                           (rediss+shards: TLS)

A query ``?timeout=SECONDS`` sets the socket timeout of every call (default 1 s); with TLS,
``&ca=FILE`` names the CA that signed the servers' certificates (else the system's, or
``$SSL_CERT_FILE``); without TLS, ``&socket=K:PATH`` reaches the K-th listed server (from 0)
over the Unix socket PATH (percent-encoded) on this host instead of its address - how
``--remote spawn`` gives each node's processes their own node's server (NOTE [spawned redis]).
A URL without a password takes ``$SHMCACHE_REMOTE_PASSWORD``.

NOTE [remote tier]
    Values. One Redis value holds one self-checking record (NOTE [spill records]: magic, key,
    lengths, checksum), whose key is the cache's identity plus the item's portable key
    (tiered_store.portable_key). The Redis key is ``shmcache:<identity>:<portable key>``; the identity
    comes from the cache's name and dataset fingerprint, never from the session's name, so every
    node finds the others' values and two datasets never share one. A value that is not such a
    record for exactly this key - garbage, truncated by a client, another cache's record, a
    format from another version - is a miss, counted as ``corrupt``, never returned. Redis
    replaces a value whole (SET), so an eviction never leaves half a record.

    Authentication (NOTE [record authentication]). With the job's secret
    (``secret=``, ``$SHMCACHE_SECRET``) every value is the record followed by a 40-byte MAC
    trailer over the whole Redis key and the record's bytes; a value read without the right one
    (unsigned, another secret's, another key's, changed) is a miss counted as ``forged``, checked
    before anything of it is parsed, and the value computed then is written with a plain SET (not
    NX), replacing it. Such a tier is ``authenticated``: the job's own values, pickled objects
    included. Without a secret anyone who can write to the Redis can change values (not run
    code: a pickled leaf from an unauthenticated tier is refused, tiered_store.TieredStore).

    Reads are on the training step's path: one round trip per batch (one pipelined ``GETRANGE
    key 0 bound-1`` per key, not MGET, so a value is read only as far as the largest record the
    tier would accept - ``$SHMCACHE_MAX_ITEM_MB`` bounds what each value reads, not only what it
    decodes (a batch of N keys may still read N such values: no total across the batch yet);
    the commands to every server sent before any reply is read; on a Cluster, grouped
    by the master of each key's slot, sent the same way - not redis-py's cluster pipeline, which
    after a timeout re-sends each key alone, a timeout each). A Redis user that may not run
    GETRANGE (an ACL) is a fault logged as such, with the fix. Writes never are: ``offer`` only
    appends to a bounded queue (full: the value is dropped, counted ``dropped``); one background
    thread per process drains it with pipelined ``SET key value NX`` (the first writer wins:
    values of a key are equal by construction, and NX spares the bandwidth of rewriting them),
    compressing (zstd) only values it shrinks by COMPRESS_MIN_SAVING. The queue is flushed, within a
    deadline, at ``close()`` and at exit (atexit).

    Faults are misses, never errors and never waits: every call has a socket timeout; a failure
    opens a circuit breaker for a backoff (1 s doubling to 30 s, jittered) during which reads
    miss at once and writes are dropped; the first success closes it. Each condition
    (unreachable, timeout, out of memory, authentication, corrupt value, any other error) is
    logged once, until the server answers again. An out-of-memory reply (``maxmemory`` with
    ``noeviction``) pauses writes only: reads go on.

    Secrets. The password lives in the parsed URL only (RemoteURL.password, not in its repr);
    every URL that is shown - logs, errors, stats, ``shmcache info``, reprs - is ``masked``
    (``***``), and every message from the client is scrubbed of the password before it is
    logged.

    Processes. A forked child (DataLoader workers) inherits neither the thread nor the sockets:
    the tier notices the new PID on its next call and starts its own (redis-py's pools do the
    same for their connections).

NOTE [remote leases]
    Nodes that miss one key at once compute it once: each node's processes already coordinate
    through the node's claims (NOTE [claims]); across nodes, a miss takes the key's *lease* in
    Redis before computing. The wait loop is the seam's (tiered_store.TieredStore._leased, for
    ``fill``, ``fill_batch`` and ``leased_compute``); the Redis side is here (``lease``, ``poll``).

      1. lease: for every key of a batch of misses, ``SET <prefix>lease:<portable key> <token>
         NX PX <ttl>`` and ``GETRANGE`` of that lease (its holder), pipelined: one round trip
         per batch (per server, per Cluster master, as reads). The lease key lies under the
         tier's prefix, so the spawned Redis's ACL (``~shmcache:*``, SET and GETRANGE: NOTE
         [spawned redis]) covers it: no command more. Granted (SET answered OK, or the holder
         read back is this process's own token: a value it computed whose write was dropped):
         compute. Refused: another holds it.
      2. compute the granted keys first (the caller publishes them: put, then the write-behind
         SET of the value), then wait for the refused ones.
      3. wait: poll with a growing sleep (1 ms, doubling to 50 ms) - one round trip per poll for
         all the keys still waited for: ``GETRANGE`` of each value (bounded, as reads) and ``SET
         lease NX PX`` again. A value found is checked and decoded as any tier hit, admitted
         into shared memory (one ``put_records`` for the batch) and returned as
         ``claims.Served`` (counted ``lease_waits``, neither computed nor published again). A
         lease found free (expired: its holder died, or is slow past the TTL) is now ours:
         compute that key at once (counted in ``leases``). A value there that fails its checks
         (corrupt, forged, not decodable here) is computed at once: no wait mends it.
      4. the wait ends at the cache's claim timeout (``claim_timeout_s``, CLAIM_TIMEOUT_S,
         $SHMCACHE_CLAIM_TIMEOUT_S): what is still waited for is computed (``lease_timeouts``).

    The TTL is the claim timeout too: a lease outlives its holder by at most that (a SIGKILLed
    or SIGSTOPped holder's keys are taken over when their leases expire, by the next SET NX),
    and no node waits longer than that for any key. A holder never releases its lease (that
    would take a command the ACL refuses, or a Lua script): once its value is written, the
    lease is moot - every reader finds the value first - and it expires by itself; a value that
    was never written (the write-behind dropped it, the computation raised) costs the other
    nodes one bounded wait. A batch computed longer than the TTL may be computed again by
    another node (waste, never damage).

    Trust. A lease carries no value and no secret - the token names its holder (host, PID, a
    random nonce) for a person reading Redis, and decides nothing but "this process's own".
    Values stay what NOTE [remote tier] makes them: a lease never decides which value is
    served. A forged lease (a string, another type, one without a TTL) costs the node that
    meets it at most one bounded wait per key, then it computes; a forged value is a miss.

    Cost and faults. No tier that takes leases (no remote): no lease, no round trip. Claims
    off (``SHMCACHE_CLAIMS=0``), a zero claim timeout, or an uncached store: no leases either.
    The tier down, slow, or its breaker open: ``lease`` and ``poll`` grant every key at once
    (compute) - a fault is never an error nor a wait (NOTE [tiers]). A single ``ds[i]`` miss
    pays one round trip more than without leases; a batch of misses one per batch.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import socket
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence
from urllib.parse import unquote

import numpy as np
import zstandard

from ..base import settings
from ..base.settings import ENV_REMOTE, ENV_REMOTE_PASSWORD
from ..base.trust import ENV_SECRET, FORGED, TRAILER_BYTES, Mac
from ..base.urls import mask_url, split_userinfo
from ..cache.store_protocol import Store
from ..errors import InvalidArgument
from . import counts as tier_counts
from .breaker import Breaker
from .records import MAX_RAW_BYTES, max_item_bytes, max_record_bytes, pack_record, unpack_record

__all__ = ["ENV_REMOTE", "ENV_PASSWORD", "RemoteURL", "parse_url", "mask_url", "jump_hash", "RedisTier",
           "probe", "read_counts", "COUNTERS", "resolve", "identity", "counts_path", "open_tier"]

log = logging.getLogger("shmcache")

ENV_PASSWORD = ENV_REMOTE_PASSWORD  # the password of a URL that has none (kept off command lines)
INSTALL = "pip install 'shmcache[redis]'"
DEFAULT_TIMEOUT_S = 1.0
BACKOFF_S = (1.0, 30.0)  # the circuit breaker's first and longest pause
QUEUE_ITEMS = 16384  # the write-behind queue's bounds (a full queue drops, counted)
QUEUE_BYTES = 256 << 20
BATCH_ITEMS = 512  # one pipelined write: at most this many values ...
BATCH_BYTES = 16 << 20  # ... or this many bytes
FLUSH_S = 5.0  # how long close() and exit wait for the queue to drain
# The writer compresses (zstd level 1, off the GIL but on the node's cores: ~0.35 ms a 150 KB
# photo crop here, a fifth of the source's decode) only values it shrinks by at least this much;
# after one that it shrinks less, the next COMPRESS_PROBE_EVERY go raw, then one is tried again.
# (Photo crops shrink ~17%: stored raw, the first epoch's CPU goes to the ranks; arrays of small
# ints or text shrink by half and more: compressed.)
COMPRESS_MIN_SAVING = 0.25
COMPRESS_PROBE_EVERY = 64
LEASE_INFIX = b"lease:"  # a key's lease: prefix + LEASE_INFIX + portable key (NOTE [remote leases])
TOKEN_BYTES = 128  # a lease's value is read only this far (its holder's name, for a person)

_SCHEMES = {
    "redis": ("server", False), "rediss": ("server", True),
    "redis+cluster": ("cluster", False), "rediss+cluster": ("cluster", True),
    "redis+shards": ("shards", False), "rediss+shards": ("shards", True),
}
_M64 = (1 << 64) - 1


# --- URLs ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RemoteURL:
    """A parsed remote URL. ``str()`` and ``repr()`` show it with the password masked."""

    kind: str  # "server", "cluster" or "shards"
    tls: bool
    nodes: tuple[tuple[str, int], ...]
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    timeout_s: float = DEFAULT_TIMEOUT_S
    masked: str = ""
    ca: str | None = None  # rediss: the CA file that signed the server's certificate
    sockets: tuple[tuple[int, str], ...] = ()  # socket=K:PATH: server K over a Unix socket here

    def __str__(self) -> str:
        return self.masked

    def __repr__(self) -> str:
        return f"RemoteURL({self.masked!r})"


def _bad(url: str, what: str) -> InvalidArgument:
    return InvalidArgument(
        f"invalid remote URL {mask_url(url)!r}: {what}; use redis://[:password@]host:port[/db], "
        f"rediss://... for TLS, redis+cluster://[:password@]h1:p1[,h2:p2...] or "
        f"redis+shards://[:password@]h1:p1,h2:p2,...[/db]")


def parse_url(url: Any) -> RemoteURL:
    """Parse a remote URL (module docstring); a bad one raises InvalidArgument without its password."""
    if not isinstance(url, str):
        raise InvalidArgument(f"remote must be a URL string such as 'redis://host:6379', "
                              f"got {type(url).__name__}")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in _SCHEMES:
        raise _bad(url, f"the scheme must be one of {', '.join(sorted(_SCHEMES))}")
    kind, tls = _SCHEMES[scheme.lower()]
    head, userinfo, tail = split_userinfo(url)  # the password first: it may hold a '?' or a '/'
    at = head != url
    hostpart, _, query = (tail if at else rest).partition("?")
    username = password = None
    if at:
        user, colon, pw = userinfo.partition(":")
        username, password = (unquote(user) or None, unquote(pw)) if colon else (None, unquote(user))
        password = password or None
    password = password or settings.get(ENV_PASSWORD) or None
    hostlist, slash, dbpart = hostpart.partition("/")
    nodes = tuple(_host_port(url, h) for h in hostlist.split(","))
    db = 0
    if slash and dbpart:
        if not dbpart.isdigit() or int(dbpart) > 65535:
            raise _bad(url, f"the database after '/' must be a number, got {dbpart!r}")
        db = int(dbpart)
    if kind == "server" and len(nodes) != 1:
        raise _bad(url, f"{scheme}:// names one server; for {len(nodes)} use redis+shards:// "
                        f"(independent servers) or redis+cluster:// (a Redis Cluster)")
    if kind == "cluster" and db:
        raise _bad(url, "a Redis Cluster has only database 0")
    if len(set(nodes)) != len(nodes):
        raise _bad(url, "a server is listed twice")
    timeout_s, ca, sockets = DEFAULT_TIMEOUT_S, None, {}
    for item in filter(None, query.split("&")):
        name, _, value = item.partition("=")
        if name == "ca" and tls and value:
            ca = unquote(value)
            continue
        if name == "socket" and not tls and kind != "cluster":
            index, _, path = value.partition(":")
            path = unquote(path)
            if not index.isdigit() or int(index) >= len(nodes) or not path.startswith("/"):
                raise _bad(url, f"socket= takes K:PATH, the index of a listed server (0-{len(nodes) - 1}) "
                                f"and the absolute path of its Unix socket, got {value!r}")
            sockets[int(index)] = path
            continue
        if name != "timeout":
            raise _bad(url, f"unknown option {name!r} (the options are timeout=SECONDS, ca=FILE "
                            f"with rediss, socket=K:PATH without)")
        try:
            timeout_s = float(value)
        except ValueError:
            timeout_s = -1.0
        if not 0 < timeout_s <= 600:
            raise _bad(url, f"timeout must be a number of seconds in (0, 600], got {value!r}")
    return RemoteURL(kind, tls, nodes, db, username, password, timeout_s, mask_url(url), ca,
                     tuple(sorted(sockets.items())))


def _host_port(url: str, item: str) -> tuple[str, int]:
    item = item.strip()
    if item.startswith("["):  # [ipv6]:port
        host, _, port = item[1:].partition("]")
        port = port[1:] if port.startswith(":") else port
    else:
        host, _, port = item.rpartition(":") if ":" in item else (item, "", "")
    if not host:
        raise _bad(url, f"a server has no host name ({item!r})")
    if port and (not port.isdigit() or not 0 < int(port) < 65536):
        raise _bad(url, f"the port of {host!r} must be 1-65535, got {port!r}")
    return host, int(port or 6379)


# --- sharding --------------------------------------------------------------------------------------

def jump_hash(key: int, buckets: int) -> int:
    """Jump consistent hash (Lamping & Veach, 2014): the bucket in [0, buckets) of a 64-bit key.

    Growing the buckets from N to N+1 moves only the keys that land in the new one, about 1/(N+1)
    of them, and none between the old ones (``xxh64 % N``, Bagua's choice, moves almost all)."""
    b, j = -1, 0
    key &= _M64
    while j < buckets:
        b = j
        key = (key * 2862933555777941757 + 1) & _M64
        j = int((b + 1) * (2147483648.0 / ((key >> 33) + 1)))
    return b


def _key_hash(rkey: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(rkey, digest_size=8).digest(), "little")


# --- the client ---------------------------------------------------------------------------------

def _redis():
    try:
        import redis
    except ImportError as exc:
        raise InvalidArgument(f"a remote tier needs redis-py, which is not installed ({exc}); "
                              f"install it with: {INSTALL}") from None
    return redis


def _client_kwargs(url: RemoteURL, timeout_s: float | None = None) -> dict:
    """Every call times out; no retries inside the client (the circuit breaker decides when to
    try again: a retrying client would multiply the wait of a step on a dead server)."""
    _redis()
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    t = url.timeout_s if timeout_s is None else timeout_s
    kw = dict(password=url.password, username=url.username, socket_timeout=t,
              socket_connect_timeout=t, retry=Retry(NoBackoff(), 0), health_check_interval=0)
    if url.tls:  # the server's certificate is checked: against ?ca=FILE, else the system's CAs
        kw["ssl"] = True      # ($SSL_CERT_FILE moves those)
        if url.ca:
            kw["ssl_ca_certs"] = url.ca
    return kw


def _servers(url: RemoteURL, timeout_s: float | None = None) -> list:
    redis = _redis()
    kw = _client_kwargs(url, timeout_s)
    sockets = dict(url.sockets)
    return [redis.Redis(unix_socket_path=sockets[i], db=url.db, **kw) if i in sockets
            else redis.Redis(host=h, port=p, db=url.db, **kw) for i, (h, p) in enumerate(url.nodes)]


def _cluster(url: RemoteURL, timeout_s: float | None = None):
    _redis()
    from redis.cluster import ClusterNode, RedisCluster

    kw = _client_kwargs(url, timeout_s)
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in url.nodes],
                        require_full_coverage=False, **kw)


def _faults() -> tuple:
    """The exceptions that are a remote's faults (a miss); anything else is a bug and raises."""
    e = _redis().exceptions
    return (e.RedisError, e.RedisClusterException, OSError)  # (a cluster's is not a RedisError)


def _condition(exc: BaseException) -> str:
    """Which of the logged conditions a client error is."""
    redis = _redis()
    e = redis.exceptions
    text = str(exc)
    if isinstance(exc, e.NoPermissionError) or text.startswith("NOPERM"):
        return "noperm"
    if isinstance(exc, e.AuthenticationError) or any(
            s in text for s in ("NOAUTH", "WRONGPASS", "invalid password", "AUTH")):
        return "auth"
    if isinstance(exc, (e.TimeoutError, TimeoutError)):
        return "timeout"
    if text.startswith("OOM") or "maxmemory" in text:
        return "oom"
    if isinstance(exc, (e.ConnectionError, ConnectionError, OSError)) or "ClusterDown" in type(exc).__name__:
        return "unreachable"
    return "error"


_SAY = {
    "unreachable": "is unreachable; values are computed from the source until it answers "
                   "(start it, or check the host, port and firewall)",
    "timeout": "did not answer within {t} s (stopped or overloaded); values are computed from "
               "the source until it answers (raise ?timeout= in the URL if it is only slow)",
    "oom": "is out of memory (maxmemory reached with the noeviction policy): new values are not "
           "stored there; reads go on (give it more maxmemory, or an allkeys-lru policy)",
    "auth": "refused the credentials (wrong or missing password); values are computed from the "
            "source (put the right password in the URL: redis://:PASSWORD@host:port)",
    "noperm": "refused a command or key the tier needs (its ACL): values are computed from the source "
              "until it allows them (give the URL's user `+getrange +set +ping +info ~shmcache:*`, e.g. "
              "ACL SETUSER <user> +getrange: reads are GETRANGE, not MGET or GET)",
    "corrupt": "returned a value that is not this cache's record for that key (garbage, "
               "truncated, or another cache's): a miss, recomputed; later ones are counted as "
               "'corrupt' in stats()",
    "error": "failed; values are computed from the source until it answers",
    "forged": "returned a value without this job's MAC (written without the job's secret, with "
              "another secret, under another key, or changed): a miss, recomputed and written again; "
              f"later ones are counted as 'forged' in stats() (every process of the job needs the same "
              f"${ENV_SECRET})",
}

COUNTERS = tier_counts.COUNTERS["remote"]  # hits, misses, bytes read and written, ... (NOTE [tier counts])
_I = {name: i for i, name in enumerate(COUNTERS)}


def read_counts(path: str | os.PathLike) -> dict | None:
    """The remote counters of one cache summed over every process, and ``url``, the masked URL
    (None: the cache never had a remote). NOTE [tier counts]."""
    out = tier_counts.read_counts(path, COUNTERS)
    if out is not None and out["url"]:
        out["url"] = mask_url(out["url"])
    return out


class RedisTier:
    """The values of one cache in Redis (NOTE [remote tier]), a ``tiers.protocol.Tier``: portable
    keys and records in and out, each stored as a self-checking record; faults are misses.
    ``identity`` names the cache (its name and fingerprint, not the session: ``bind``)."""

    name = "remote"
    COUNTERS = COUNTERS
    read_only = False  # what the job computes is offered, and written behind the training loop
    # the most bytes one batch's values may take in all (TieredStore lowers it to the cache's
    # cap): values that each claim a GiB are refused past it, never all decoded
    max_batch_bytes = MAX_RAW_BYTES
    leases = True  # a miss takes a lease here before computing (NOTE [remote leases])

    def __init__(self, url: str | RemoteURL, identity: str, *, queue_items: int = QUEUE_ITEMS,
                 queue_bytes: int = QUEUE_BYTES, counts_path: str | os.PathLike | None = None,
                 slot: Callable[[], int] | None = None, secret: bytes | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.url = url if isinstance(url, RemoteURL) else parse_url(url)
        self._clock = clock  # the breaker's and the write pause's time (a test's moves by hand)
        # with the job's secret every value written carries a MAC over its Redis key and bytes, and
        # a value read without the right one is a miss (NOTE [record authentication])
        self._mac = Mac(secret) if secret else None
        # without the secret a value is a stranger's: it may decode to at most this
        self.max_item_bytes = MAX_RAW_BYTES if self._mac is not None else max_item_bytes()
        _redis()  # a missing client is an error now, not a silent miss later
        self.identity = identity
        self.prefix = b"shmcache:" + identity.encode() + b":"  # + the portable key: the Redis key
        self.lease_prefix = self.prefix + LEASE_INFIX  # + the portable key: its lease (NOTE [remote leases])
        self.queue_items, self.queue_bytes = queue_items, queue_bytes
        # counts_path + slot(): this process's counters go to its row of a shared file (NOTE
        # [tier counts]), so `shmcache stat` sees them; else they stay in the process
        self._counts_path, self._slot = counts_path, slot
        self._c = np.zeros(len(COUNTERS), np.uint64)
        self._lock = threading.Lock()  # the queue, the breaker, the counters
        self._wake = threading.Condition(self._lock)
        self._pid = -1
        self._closed = False
        _LIVE.add(self)

    def __repr__(self) -> str:
        return f"RedisTier({self.url.masked!r}, {self.identity!r})"

    @property
    def authenticated(self) -> bool:
        """Whether every value this tier returns carried the job's MAC (TieredStore trusts those)."""
        return self._mac is not None

    def bind(self, name: str | None, fingerprint: str | None) -> None:
        """The cache's identity (``identity(name, fingerprint)``): at assembly, and again when a
        named cache learns its dataset after it was opened - under the bare name it would share
        nothing with the other processes of this dataset, and meet another dataset of that name."""
        if name is None:  # the identity the tier was made with stays
            return
        self.identity = identity(name, fingerprint)
        self.prefix = b"shmcache:" + self.identity.encode() + b":"
        self.lease_prefix = self.prefix + LEASE_INFIX

    # --- per process: clients, queue, writer thread --------------------------------------------

    def _ensure(self) -> None:
        if self._pid == os.getpid():
            return
        with self._lock:
            if self._pid == os.getpid():
                return
            # a new process (or the first use): nothing of the parent's is ours
            self._wake = threading.Condition(self._lock)
            self._queue: deque = deque()
            self._queued_bytes = 0
            self._inflight = 0
            self._clients: list | None = None
            self._cluster = None
            self._breaker = Breaker(*BACKOFF_S, jitter=0.2, clock=self._clock)
            self._writes_after = 0.0  # an OOM pauses writes only
            self._logged: set[str] = set()
            self._dctx = threading.local()  # zstd contexts are not thread-safe
            self._replace: set[bytes] = set()  # Redis keys read as forged: rewritten without NX
            self._thread: threading.Thread | None = None
            self._stop = False
            # what this process's leases hold: who took them, for a person reading Redis (no secret)
            self._token = b"%s/%d/%s" % (socket.gethostname().encode()[:64], os.getpid(), os.urandom(4).hex().encode())
            self._c = self._counts_row()
            self._pid = os.getpid()

    def _counts_row(self) -> np.ndarray:
        row = tier_counts.process_row(self._counts_path, self.url.masked, self._slot,
                                      f"remote tier {self.url.masked} of cache {self.identity}")
        row[_I["backlog"]] = 0  # a level, not a total: this process has queued nothing yet
        return row

    def _add(self, name: str, n: int) -> None:
        """One counter of this process, one aligned store (the lock is held)."""
        self._c[_I[name]] += n

    def _connect(self):
        if self.url.kind == "cluster":
            if self._cluster is None:
                self._cluster = _cluster(self.url)
            return self._cluster
        if self._clients is None:
            self._clients = _servers(self.url)
        return self._clients

    # --- the breaker and the log -----------------------------------------------------------------

    def _open(self) -> bool:
        """True while the breaker is open (reads miss at once, writes are dropped)."""
        return self._breaker.is_open()

    def _failed(self, exc: BaseException) -> None:
        cond = _condition(exc)
        with self._lock:
            self._add("errors", 1)
            if cond == "oom":  # the server answers: pause the writes, keep reading
                self._writes_after = self._clock() + BACKOFF_S[1]
            else:
                self._breaker.trip()
            if self._cluster is not None and cond != "oom":
                cluster, self._cluster = self._cluster, None  # rebuilt (slots re-read) when it answers
                _quietly(cluster.close)
        self._say(cond, exc)

    def _succeeded(self) -> None:
        if self._breaker.pause_s or self._logged - {"corrupt", "oom", "forged"}:
            with self._lock:
                if self._logged - {"corrupt", "oom", "forged"}:
                    log.warning("remote tier %s of cache %s answers again", self.url.masked, self.identity)
                self._breaker.reset()
                self._logged &= {"corrupt", "oom", "forged"}

    def _say(self, cond: str, exc: BaseException | None = None, detail: str = "") -> None:
        if cond in self._logged:
            return
        self._logged.add(cond)
        if exc is not None:
            detail = f" ({type(exc).__name__}: {self._scrub(str(exc))})"
        log.warning("remote tier %s of cache %s %s%s", self.url.masked, self.identity,
                    _SAY[cond].format(t=self.url.timeout_s), detail)

    def _scrub(self, text: str) -> str:
        pw = self.url.password
        return text.replace(pw, "***") if pw else text

    # --- reads ---------------------------------------------------------------------------------

    def rkey(self, pkey: bytes) -> bytes:
        return self.prefix + pkey

    def get(self, pkey: bytes) -> bytes | None:
        return self.get_many([pkey])[0]

    def get_many(self, pkeys: Sequence[bytes]) -> list[bytearray | None]:
        """The portable records of ``pkeys`` (None: a miss, a fault, the breaker open, or a value
        that is not this cache's record for that key); one round trip in all."""
        rkeys = [self.prefix + k for k in pkeys]  # the Redis keys, made once: read, MAC, record
        return self._records(pkeys, rkeys, self._fetch(rkeys))

    def _records(self, pkeys: Sequence[bytes], rkeys: list[bytes], raw: list,
                 count: bool = True) -> list[bytearray | None]:
        """The raw Redis values ``raw`` of ``rkeys`` as checked portable records (None: missing, or
        failing the MAC or the record's checks: counted, unless not ``count``)."""
        dctx = getattr(self._dctx, "ctx", None)
        if dctx is None:
            dctx = self._dctx.ctx = zstandard.ZstdDecompressor()
        out: list = []
        bad = forged = 0
        left = self.max_batch_bytes
        for pkey, rkey, value in zip(pkeys, rkeys, raw):
            if value is not None and self._mac is not None:
                value, verdict = self._mac.open(rkey, value)  # before a byte of it is parsed
                if verdict == FORGED:
                    forged += 1
                    if len(self._replace) < QUEUE_ITEMS:
                        self._replace.add(rkey)
                    if "forged" not in self._logged:
                        self._say("forged", None, f" (the first: key {pkey!r})")
            if value is not None:
                value, why = unpack_record(value, rkey, dctx, limit=min(left, self.max_item_bytes))
                if value is not None:
                    left -= len(value)
                else:
                    bad += 1
                    self._corrupt_logged(pkey, why)
            out.append(value)
        if bad and count:
            self.corrupt(bad)
        if forged and count:
            self.corrupt(forged, "forged")
        return out

    def _corrupt_logged(self, pkey: bytes, why: str | None) -> None:
        if "corrupt" not in self._logged:
            self._say("corrupt", None, f" (the first: key {pkey!r}: {why})")

    def fetch(self, pkeys: Sequence[bytes]) -> list[bytes | None]:
        """The raw Redis values of ``pkeys`` (unchecked), each only as far as the largest record
        this tier would accept for it (``_read``); one round trip in all."""
        return self._fetch([self.prefix + k for k in pkeys])

    def _fetch(self, rkeys: list[bytes]) -> list[bytes | None]:
        """``fetch`` of the Redis keys ``rkeys``."""
        self._ensure()
        if not rkeys or self._closed or self._open():
            return [None] * len(rkeys)
        try:
            raw = self._read(rkeys)
        except _faults() as exc:  # every client fault is a miss (NOTE [remote tier])
            self._failed(exc)
            return [None] * len(rkeys)
        self._succeeded()
        hits = sum(v is not None for v in raw)
        with self._lock:
            self._add("hits", hits)
            self._add("misses", len(raw) - hits)
            self._add("bytes_read", sum(len(v) for v in raw if v is not None))
        return raw

    def _read(self, rkeys: list[bytes]) -> list:
        """The values of ``rkeys``, each read only as far as the largest record this tier would
        accept for its key can weigh (``GETRANGE key 0 bound-1``): a stranger's 512 MB value costs
        a batch that bound, then fails its checks (cut short: a miss). Like MGET otherwise: a
        missing key (GETRANGE's b"": a record is never empty) or one of another type is None."""
        return [_value(v) for v in self._exchange([(k, self._getrange_value(k)) for k in rkeys])]

    def _getrange_value(self, rkey: bytes) -> bytes:
        """The packed GETRANGE of a value: as far as the largest record this tier accepts."""
        limit = min(self.max_item_bytes, self.max_batch_bytes)
        extra = TRAILER_BYTES if self._mac is not None else 0
        return _getrange(rkey, max_record_bytes(len(rkey), limit) + extra - 1)

    def _exchange(self, commands: list[tuple[bytes, Any]]) -> list:
        """The replies of ``(Redis key, packed command)`` pairs, in order, an error reply as its
        exception: each command (bytes, or a list of buffers sent back to back) sent to the
        server (the Cluster master) of its key, every server's commands sent before any reply
        is read - one round trip in all."""
        conn = self._connect()
        rkeys = [k for k, _ in commands]
        if self.url.kind == "cluster":
            groups = _cluster_groups(conn, rkeys)
        elif len(conn) == 1:
            groups = [(conn[0].connection_pool, list(range(len(rkeys))))]
        else:
            groups = _shard_groups(conn, rkeys)
        out: list = [None] * len(rkeys)
        batches = [(pool, _coalesce([commands[i][1] for i in idx]), len(idx), idx) for pool, idx in groups]
        for idx, replies in _round_trip(batches):
            for i, v in zip(idx, replies):
                out[i] = v
        return out

    # --- leases (NOTE [remote leases]) ---------------------------------------------------------

    def lease(self, pkeys: Sequence[bytes], ttl_s: float) -> list[bool]:
        """Take the lease of each key for ``ttl_s`` seconds, one round trip in all (``SET lease
        token NX PX``, and a read of the lease's holder). True: the lease is ours (taken now, or
        this process's already), or the tier cannot say (down, slow, breaker open: compute);
        False: another's lease is live - wait for its value (``poll``)."""
        self._ensure()
        n = len(pkeys)
        if not n or self._closed or self._open():
            return [True] * n
        ms, token, commands = b"%d" % max(1, int(ttl_s * 1000)), self._token, []
        for k in pkeys:
            lkey = self.lease_prefix + k
            commands.append((lkey, _set_nx_px(lkey, token, ms)))
            commands.append((lkey, _getrange(lkey, TOKEN_BYTES - 1)))
        try:
            replies = self._exchange(commands)
            for r in replies[0::2]:
                if isinstance(r, Exception):  # NOPERM, OOM, ...: a fault, said once; leases granted
                    raise r
        except _faults() as exc:
            self._failed(exc)
            return [True] * n
        self._succeeded()
        taken = [r is not None for r in replies[0::2]]
        with self._lock:
            self._add("leases", sum(taken))
        # the holder's name read back: a lease of this very process (a value it computed whose
        # write was dropped) is ours; a lease holding another type (WRONGTYPE) is another's
        return [t or h == token for t, h in zip(taken, replies[1::2])]

    def poll(self, pkeys: Sequence[bytes], ttl_s: float) -> tuple[list[bytearray | None], list[bool]]:
        """For keys whose lease another holds: their records now (None: not there yet, or failing
        their checks) and, for each, whether to compute it now - its lease was free (expired) and
        is ours (``SET lease token NX PX``), or a value is there that fails its checks (no wait
        mends it: the one the lookup already counted as corrupt or forged); one round trip in
        all (so a key whose value is found may come back taken too: the value wins, the lease
        expires unused). A fault: no records, compute every key. Reads here count as ``lease_waits``
        (``waited``), not as hits, misses or corrupt values."""
        self._ensure()
        n = len(pkeys)
        if not n or self._closed or self._open():
            return [None] * n, [True] * n
        ms, token = b"%d" % max(1, int(ttl_s * 1000)), self._token
        rkeys = [self.prefix + k for k in pkeys]
        commands = [(k, self._getrange_value(k)) for k in rkeys]
        commands += [(lkey, _set_nx_px(lkey, token, ms)) for lkey in [self.lease_prefix + k for k in pkeys]]
        try:
            replies = self._exchange(commands)
            raw = [_value(v) for v in replies[:n]]
            for r in replies[n:]:
                if isinstance(r, Exception):
                    raise r
        except _faults() as exc:
            self._failed(exc)
            return [None] * n, [True] * n
        self._succeeded()
        taken = [r is not None for r in replies[n:]]
        with self._lock:
            self._add("leases", sum(taken))
            self._add("bytes_read", sum(len(v) for v in raw if v is not None))
        records = self._records(pkeys, rkeys, raw, count=False)
        return records, [t or (v is not None and r is None) for t, v, r in zip(taken, raw, records)]

    def waited(self, served: int, timed_out: int) -> None:
        """The caller served ``served`` keys after waiting on another's lease, and gave up waiting
        on ``timed_out`` (computed them): counted as ``lease_waits`` and ``lease_timeouts``."""
        self._ensure()
        with self._lock:
            self._add("lease_waits", served)
            self._add("lease_timeouts", timed_out)

    def corrupt(self, n: int = 1, counter: str = "corrupt") -> None:
        """The caller found ``n`` values that failed their checks (a miss each)."""
        with self._lock:
            self._add(counter, n)
            self._c[_I["hits"]] -= min(n, int(self._c[_I["hits"]]))
            self._add("misses", n)

    # --- writes (behind the training loop) -------------------------------------------------------

    def offer(self, pairs: Sequence[tuple[bytes, bytes]]) -> None:
        """Queue ``(portable key, portable record)`` pairs for writing; never blocks (a full queue
        drops). The records are wrapped and written by the writer thread, off the training step.
        A record given as ``bytes`` or a read-only memoryview is kept as it is (the caller hands
        it over: TieredStore.put's is a buffer of its own), any other buffer is copied first."""
        self._ensure()
        if self._closed:
            return
        with self._lock:
            for pkey, value in pairs:
                if len(self._queue) >= self.queue_items or self._queued_bytes + len(value) > self.queue_bytes:
                    self._add("dropped", 1)
                    continue
                if not (type(value) is bytes or (type(value) is memoryview and value.readonly)):
                    value = bytes(value)  # a buffer the caller may change: ours is a copy
                self._queue.append((self.prefix + pkey, value))
                self._queued_bytes += len(value)
            self._c[_I["backlog"]] = len(self._queue) + self._inflight
            if self._thread is None and self._queue:
                self._thread = threading.Thread(target=self._writer, name="shmcache-remote-writer",
                                                daemon=True)
                self._thread.start()
            self._wake.notify()

    def _writer(self) -> None:
        cctx = zstandard.ZstdCompressor(level=1)
        skip = 0  # values to store raw before compression is tried again (COMPRESS_MIN_SAVING)
        while True:
            with self._lock:
                while not self._queue and not self._stop:
                    self._wake.wait()
                if not self._queue:
                    return
                wait = max(self._breaker.retry_at, self._writes_after) - self._clock()
                if wait > 0:  # breaker open or server full: drop what waits, do not pile up
                    dropped = len(self._queue)
                    self._queue.clear()
                    self._queued_bytes = 0
                    self._add("dropped", dropped)
                    if not self._stop:
                        self._wake.wait(min(wait, 1.0))
                    continue
                batch, size = [], 0
                while self._queue and len(batch) < BATCH_ITEMS and size < BATCH_BYTES:
                    item = self._queue.popleft()
                    batch.append(item)
                    size += len(item[1])
                self._queued_bytes -= size
                self._inflight = len(batch)
            try:
                sealed = []
                for k, v in batch:
                    parts = pack_record(k, v, cctx if skip == 0 else None)
                    if skip:
                        skip -= 1
                    elif len(parts[3]) > len(v) * (1 - COMPRESS_MIN_SAVING):  # not worth its CPU
                        skip = COMPRESS_PROBE_EVERY
                    sealed.append((k, self._sealed(k, parts)))
                batch = sealed
                size = sum(len(p) for _, parts in batch for p in parts)
                self._write(batch)
            except Exception as exc:  # noqa: BLE001 - a failed write is a value not shared, no more
                self._failed(exc)
                with self._lock:
                    self._add("dropped", len(batch))
            else:
                self._succeeded()
                with self._lock:
                    self._add("bytes_written", size)
            finally:
                with self._lock:
                    self._inflight = 0
                    self._c[_I["backlog"]] = len(self._queue)
                    self._wake.notify_all()

    def _sealed(self, rkey: bytes, parts: list) -> list:
        """The Redis value of one record, as the buffers to send back to back (never joined: a
        150 KiB value is not copied again): its parts, and with a secret the MAC trailer over
        the Redis key (the cache's identity and the item's key) and those bytes."""
        if self._mac is not None:
            parts = [*parts, self._mac.trailer(rkey, *parts)]
        return parts

    def _write(self, batch: list[tuple[bytes, list]]) -> None:
        """``SET key value NX`` for each (Redis key, value's buffers), in one round trip (to each
        server, each Cluster master); an error reply raises (a fault: the breaker, dropped)."""
        replace = self._replace
        commands = []
        for k, parts in batch:
            # NX: the first writer wins; but a value read as forged is replaced by the job's
            commands.append((k, _set_value(k, parts, k not in replace)))
            replace.discard(k)
        for reply in self._exchange(commands):
            if isinstance(reply, Exception):
                raise reply

    def flush(self, timeout_s: float = FLUSH_S) -> bool:
        """Wait until what was offered is written (or dropped); False if the deadline passed."""
        if self._pid != os.getpid():
            return True  # nothing of this process's is queued
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._wake.notify_all()
            while self._queue or self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(min(left, 0.1))
        return True

    # --- visibility and lifecycle ---------------------------------------------------------------

    def counters(self) -> dict:
        """This process's counts (hits, misses, bytes read and written, errors, corrupt, dropped)
        and the write-behind backlog (values queued, not yet written)."""
        self._ensure()
        with self._lock:
            out = {name: int(self._c[i]) for i, name in enumerate(COUNTERS)}
            out["backlog"] = len(self._queue) + self._inflight
        return out

    def totals(self) -> dict:
        """The counters summed over every process of the session (NOTE [tier counts]); this
        process's alone when they are not shared; ``url``: this tier's, password masked."""
        self._ensure()
        shared = read_counts(self._counts_path) if self._counts_path and self._slot else None
        return {**(shared if shared is not None else self.counters()), "url": mask_url(self.url.masked)}

    def close(self, timeout_s: float = FLUSH_S) -> None:
        """Flush the queue (within ``timeout_s``), stop the writer, close the connections."""
        if self._closed:
            return
        if self._pid == os.getpid():
            if not self.flush(timeout_s):
                log.warning("remote tier %s of cache %s: %d value(s) not written at close (the "
                            "server is slow or gone); they stay computed on this node only",
                            self.url.masked, self.identity, len(self._queue) + self._inflight)
            with self._lock:
                self._stop = True
                self._add("dropped", len(self._queue))
                self._queue.clear()
                self._c[_I["backlog"]] = 0
                self._wake.notify_all()
            for client in (self._clients or []):
                _quietly(client.close)
            if self._cluster is not None:
                _quietly(self._cluster.close)
        self._closed = True
        _LIVE.discard(self)


def _shard_groups(clients: list, rkeys: list[bytes]) -> list:
    """``[(pool, indices)]``: the keys of each server (jump hash), for one round trip to all."""
    groups: dict[int, list[int]] = {}
    for i, k in enumerate(rkeys):
        groups.setdefault(jump_hash(_key_hash(k), len(clients)), []).append(i)
    return [(clients[s].connection_pool, idx) for s, idx in groups.items()]


def _cluster_groups(cluster, rkeys: list[bytes]) -> list:
    """``[(pool, indices)]``: the keys of each master that owns their slots, all sent before any
    reply is read: one round trip, and one timeout at most when a master is stopped. (redis-py's
    cluster pipeline, after a timeout, re-sends each of that master's keys alone, each waiting
    its own timeout: 85 s for a 256-key batch at the default 1 s.) A redirection (the cluster is
    being resharded) or any other error reply raises: a fault, so the breaker opens and the
    client, rebuilt, reads the slots again."""
    groups: dict[str, tuple[Any, list[int]]] = {}
    nodes = cluster.nodes_manager
    for i, k in enumerate(rkeys):
        node = nodes.get_node_from_slot(cluster.keyslot(k))
        groups.setdefault(node.name, (node, []))[1].append(i)
    return [(cluster.get_redis_connection(node).connection_pool, idx) for node, idx in groups.values()]


def _getrange(rkey: bytes, end: int) -> bytes:
    """``GETRANGE rkey 0 end``, packed (RESP): a batch's 256 packed by redis-py took as long as
    Redis took to answer them (benchmarks/bench_remote_read.py)."""
    end_b = b"%d" % end
    return b"*4\r\n$8\r\nGETRANGE\r\n$%d\r\n%s\r\n$1\r\n0\r\n$%d\r\n%s\r\n" % (len(rkey), rkey, len(end_b), end_b)


def _set_nx_px(rkey: bytes, value: bytes, ms: bytes) -> bytes:
    """``SET rkey value NX PX ms``, packed (RESP): a lease (NOTE [remote leases])."""
    return b"*6\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$2\r\nNX\r\n$2\r\nPX\r\n$%d\r\n%s\r\n" % (
        len(rkey), rkey, len(value), value, len(ms), ms)


def _set_value(rkey: bytes, parts: list, nx: bool) -> list:
    """``SET rkey <parts joined> [NX]``, packed (RESP) as buffers to send back to back: the
    value's bulk string is its parts one after another, never joined here."""
    n = sum(len(p) for p in parts)
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (4 if nx else 3, len(rkey), rkey, n)
    return [head, *parts, b"\r\n$2\r\nNX\r\n" if nx else b"\r\n"]


_SEND_ALONE = 16 << 10  # a buffer this large is sent as it is; smaller ones are joined (one send)


def _coalesce(commands: list) -> list:
    """Packed commands (bytes, or lists of buffers) as few buffers to send: small ones joined,
    large ones (a value's payload) sent as they are, never copied."""
    out, small = [], []
    for command in commands:
        for buf in ([command] if type(command) is bytes else command):
            if len(buf) >= _SEND_ALONE:
                if small:
                    out.append(b"".join(small))
                    small = []
                out.append(buf)
            else:
                small.append(buf)
    if small:
        out.append(b"".join(small))
    return out


def _value(reply: Any) -> bytes | None:
    """A GETRANGE reply as a value: None for a missing key (b"") or one of another type; any
    other error reply raises (a fault)."""
    if isinstance(reply, Exception):
        if not str(reply).startswith("WRONGTYPE"):
            raise reply
        return None
    return reply or None


def _round_trip(batches: list) -> list:
    """Send each ``(pool, packed commands (buffers), their count, tag)``'s commands on a
    connection of its own pool, all before reading any reply; then ``[(tag, replies)]``, an error reply as its
    exception (every reply is read: the connection stays clean). A connection left with an
    unread reply (a timeout, a broken connection) is disconnected, never reused."""
    response_error = _redis().exceptions.ResponseError
    sent, out = [], []
    try:
        for pool, packed, _n, _tag in batches:
            conn = pool.get_connection()
            sent.append((pool, conn))
            conn.send_packed_command(packed)  # buffers, sent back to back
        for (_, conn), (_, _, n, tag) in zip(sent, batches):
            out.append((tag, [_reply(conn, response_error) for _ in range(n)]))
    except BaseException:
        for _, conn in sent:
            _quietly(conn.disconnect)
        raise
    finally:
        for pool, conn in sent:
            pool.release(conn)
    return out


def _reply(conn, response_error: type) -> Any:
    try:
        return conn.read_response()
    except response_error as exc:  # a whole reply, read: the next one follows on the socket
        return exc


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - closing a broken connection: nothing left to say
        pass


_LIVE: weakref.WeakSet = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A fork may have copied a tier's lock held by its writer thread, which the child lacks:
    give every tier a fresh one before anything in the child can wait on it (_ensure then
    starts the child's own queue, thread and connections)."""
    for tier in list(_LIVE):
        tier._lock = threading.Lock()
        tier._wake = threading.Condition(tier._lock)


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _flush_at_exit() -> None:
    """Write what is queued before the interpreter goes (within FLUSH_S in all)."""
    deadline = time.monotonic() + FLUSH_S
    for tier in list(_LIVE):
        tier.close(max(0.0, deadline - time.monotonic()))


# --- shmcache info ------------------------------------------------------------------------------

def probe(url: str | RemoteURL, timeout_s: float = 0.5) -> dict:
    """What ``shmcache info`` shows of a remote: its masked URL, whether every server answers a
    PING within ``timeout_s``, and the memory it uses and may use (summed over the servers)."""
    u = url if isinstance(url, RemoteURL) else parse_url(url)
    out = {"url": u.masked, "kind": u.kind, "servers": len(u.nodes), "answers": False,
           "used_memory": None, "maxmemory": None, "error": None}
    try:
        if u.kind == "cluster":
            rc = _cluster(u, timeout_s)
            try:
                nodes = [rc.get_redis_connection(n) for n in rc.get_primaries()]
                infos = [c.info("memory") for c in nodes]
                answers = all(c.ping() for c in nodes)
            finally:
                rc.close()
        else:
            clients = _servers(u, timeout_s)
            try:
                answers = all(c.ping() for c in clients)
                infos = [c.info("memory") for c in clients]
            finally:
                for c in clients:
                    _quietly(c.close)
    except InvalidArgument:
        raise
    except Exception as exc:  # noqa: BLE001 - info reports, it does not fail
        pw = u.password
        text = f"{type(exc).__name__}: {exc}"
        out["error"] = text.replace(pw, "***") if pw else text
        return out
    out["answers"] = answers
    out["used_memory"] = sum(int(i.get("used_memory", 0)) for i in infos)
    maxes = [int(i.get("maxmemory", 0)) for i in infos]
    out["maxmemory"] = 0 if 0 in maxes else sum(maxes)  # 0: one server has no limit
    return out


# --- wiring: a cache's store with its remote tier behind it ----------------------------------------

def resolve(remote: Any, session_remote: str | None) -> str | None:
    """The remote URL in force: ``remote=`` given (``""``: none), else ``$SHMCACHE_REMOTE``, else the
    session's (``shmcache new NAME --remote URL``); None when there is none. Checked here: a bad
    URL, or a missing redis-py, is an error when the cache is made, not a silent miss later."""
    if remote is not None and not isinstance(remote, str):
        raise InvalidArgument(f"remote must be a URL such as 'redis://:PASSWORD@host:6379' (or '' for "
                              f"none), got {type(remote).__name__}")
    if remote is None:
        remote = settings.get(ENV_REMOTE) or session_remote
    if not remote:
        return None
    parse_url(remote)
    _redis()
    return remote


def identity(name: str, fingerprint: str | None) -> str:
    """What names a cache in Redis: its name, and its dataset's fingerprint when it has one - never
    the session's name, so every node's session finds the same values (NOTE [remote tier])."""
    return f"{name}.{fingerprint[:32]}" if fingerprint else name


def counts_path(registry, session: str, name: str) -> Path:
    """The file of a cache's remote counters (NOTE [tier counts]), beside its metadata."""
    return tier_counts.counts_path(registry, session, name, "remote")


def open_tier(local: Store, url: str, fingerprint: str | None, registry, secret: bytes | None = None) -> RedisTier:
    """The remote tier at ``url`` of cache ``local`` (any store), its counters in the cache's
    counts file when the store is shared; ``secret``: the job's (trust.resolve_secret). The
    caller hands it to ``assembly.assemble``."""
    from ..cache import process_slot

    shared = not local.uncached  # an uncached store holds no liveness slot
    return RedisTier(url, identity(local.name, fingerprint),
                     counts_path=counts_path(registry, local.session, local.name) if shared else None,
                     slot=(lambda: process_slot.slot(registry, local.session)) if shared else None,
                     secret=secret)
