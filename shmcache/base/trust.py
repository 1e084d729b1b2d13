"""What a value from outside this user's shared memory must prove: the job's secret, and the MAC
that binds a record to its cache and key (issue 16).

    key = resolve_secret(secret)               # secret= or $SHMCACHE_SECRET; None: no secret
    mac = Mac(key)
    value = record + mac.trailer(context, record)          # what goes to Redis or a snapshot
    record, verdict = mac.open(context, value)             # SIGNED, UNSIGNED or FORGED

NOTE [record authentication]
    The secret. ``ShmDatasetCache(secret=...)`` (or ``import_snapshot(secret=...)``,
    ``export_cache(secret=...)``), else ``$SHMCACHE_SECRET``: any non-empty string, its UTF-8
    bytes used as the key as they are (bytes are taken as given); ``secret=""`` means none, even
    when the environment has one. ``--remote spawn`` makes one per job (secrets.token_hex(32))
    and hands it to its workers in that variable. Whoever holds the secret is the job: the MAC
    proves that a record was written by a holder, nothing about who that was.

    The MAC. HMAC-SHA256, keyed with the secret, over a domain tag, the context and the record:

        tag = HMAC(secret, b"shmcache-mac-v1\\0" + u32 len(context) + context + record)

    The context binds the record to where it may be served: for the remote tier the whole Redis
    key (``shmcache:<identity>:<portable key>``: the cache's name and dataset fingerprint, and the
    item's key), for a snapshot record the snapshot's dataset (``fingerprint`` or ``name:NAME``
    from the signed manifest) and the portable key. A record copied under another key, into
    another cache, or out of one snapshot into another's fails it.

    The trailer. A signed record is followed by 40 bytes: ``b"SpMac\\x01\\0\\0"`` then the 32-byte
    tag. The spill record before it is unchanged (``records.unpack_record`` ignores bytes
    after a record's end), so a reader without the secret reads a signed record as an unsigned
    one. The tag is checked with ``hmac.compare_digest`` before a byte of the record is parsed or
    decompressed. A reader with a secret treats a record without a trailer, or with a wrong tag,
    as *forged*: a counted miss (``remote_forged``, ``snapshot_forged``), never a value.

    The manifest of a snapshot exported with a secret carries ``"mac": {"alg": "hmac-sha256",
    "tag": HEX}`` over the canonical JSON of the rest of the document (sorted keys, no spaces,
    ASCII), domain ``b"shmcache-manifest-v1\\0"``: what is verified is exactly the document that
    is then used. Its segments' digests bind the indexes, the indexes bind the records' places.

    Trust. Only the user's own shared memory and spill files, and records whose MAC verified,
    are the job's own values: only those may hold a pickled leaf that is unpickled. Everything
    else (an unsigned snapshot, a value from a Redis without a secret) is data: a record whose
    layout holds a pickled leaf is refused before it is decoded or stored (``allow_pickle=True``
    / ``--allow-pickle`` opts in), and layouts are checked without unpickling anything
    (codec.check_layout).
"""

from __future__ import annotations

import hmac
import json
import struct
from typing import Any

from ..errors import InvalidArgument
from . import settings
from .settings import ENV_SECRET

__all__ = ["ENV_SECRET", "resolve_secret", "Mac", "SIGNED", "UNSIGNED", "FORGED", "TRAILER_BYTES",
           "canonical", "PICKLE_HINT"]

TRAILER_MAGIC = b"SpMac\x01\x00\x00"
TAG_BYTES = 32
TRAILER_BYTES = len(TRAILER_MAGIC) + TAG_BYTES  # 40: keeps a record's 8-byte alignment
_DOMAIN = b"shmcache-mac-v1\x00"
_MANIFEST_DOMAIN = b"shmcache-manifest-v1\x00"
_U32 = struct.Struct("<I")
SIGNED, UNSIGNED, FORGED = "signed", "unsigned", "forged"
PICKLE_HINT = ("a pickled object could run code when read; pass allow_pickle=True (shmcache import "
               "--allow-pickle) only for a source you trust, or set the job's secret "
               f"(${ENV_SECRET}, secret=) where it was written so its records are authenticated")


def resolve_secret(secret: Any = None) -> bytes | None:
    """The key in force: ``secret`` (str: its UTF-8 bytes; bytes as given; ``""``: none), else
    ``$SHMCACHE_SECRET``; None when there is none."""
    if secret is None:
        secret = settings.get(ENV_SECRET, "")
    if isinstance(secret, str):
        secret = secret.encode("utf-8", "surrogatepass")
    if not isinstance(secret, (bytes, bytearray)):
        raise InvalidArgument(f"secret must be a string or bytes (or None: ${ENV_SECRET}), got "
                              f"{type(secret).__name__}")
    return bytes(secret) or None


def canonical(doc: Any) -> bytes:
    """The bytes a manifest's MAC covers: JSON with sorted keys, no spaces, ASCII only."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


class Mac:
    """The job's MAC (NOTE [record authentication]); ``key`` is the resolved secret."""

    __slots__ = ("_base",)

    def __init__(self, key: bytes):
        if not key:
            raise InvalidArgument("a MAC needs a non-empty secret")
        self._base = hmac.new(key, _DOMAIN, "sha256")  # the key schedule once; copied per record

    def tag(self, context: bytes, *parts: Any) -> bytes:
        h = self._base.copy()
        h.update(_U32.pack(len(context)))
        h.update(context)
        for part in parts:
            h.update(part)
        return h.digest()

    def trailer(self, context: bytes, *parts: Any) -> bytes:
        """The 40 bytes that follow a signed record made of ``parts``."""
        return TRAILER_MAGIC + self.tag(context, *parts)

    def open(self, context: bytes, value: Any) -> tuple[Any, str]:
        """``(record, SIGNED)`` when ``value`` ends with a trailer whose tag is right, else
        ``(None, FORGED)``; nothing of the record is read before the tag is checked."""
        record, tag = split(value)
        if tag is None or not hmac.compare_digest(tag, self.tag(context, record)):
            return None, FORGED
        return record, SIGNED

    def sign_doc(self, doc: dict) -> dict:
        """``doc`` with its ``mac`` field (over the rest of it, canonical)."""
        body = {k: v for k, v in doc.items() if k != "mac"}
        h = self._base.copy()
        h.update(_MANIFEST_DOMAIN + canonical(body))
        return {**body, "mac": {"alg": "hmac-sha256", "tag": h.hexdigest()}}

    def doc_verdict(self, body_canonical: bytes, mac: Any) -> str:
        """SIGNED when ``mac`` (a manifest's ``mac`` field) is right for the document whose
        canonical bytes (without ``mac``) are ``body_canonical``; UNSIGNED when there is none;
        FORGED when it is wrong (another secret, or a changed document)."""
        if mac is None:
            return UNSIGNED
        tag = mac.get("tag") if isinstance(mac, dict) else None
        # not ASCII: compare_digest would raise TypeError (a forged tag, never an exception)
        if not isinstance(tag, str) or not tag.isascii() or mac.get("alg") != "hmac-sha256":
            return FORGED
        h = self._base.copy()
        h.update(_MANIFEST_DOMAIN + body_canonical)
        return SIGNED if hmac.compare_digest(h.hexdigest(), tag) else FORGED


def split(value: Any) -> tuple[Any, bytes | None]:
    """``(record, tag)`` of a value that ends with a trailer, else ``(value, None)``."""
    view = memoryview(value).cast("B")
    n = len(view)
    if n >= TRAILER_BYTES and view[n - TRAILER_BYTES:n - TAG_BYTES] == TRAILER_MAGIC:
        return view[:n - TRAILER_BYTES], bytes(view[n - TAG_BYTES:])
    return view, None


def snapshot_ident(fingerprint: str | None, name: str) -> bytes:
    """The start of a snapshot record's MAC context (the portable key follows): the dataset the
    signed manifest names, by fingerprint, else by cache name."""
    who = f"fp:{fingerprint}" if fingerprint else f"name:{name}"
    return b"snapshot\x00" + who.encode("utf-8", "surrogatepass") + b"\x00"
