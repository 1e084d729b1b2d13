"""A URL's secrets kept out of sight: one rule for every message, stat, repr, log line and process
title that shows a URL (the remote tier's Redis URL, a snapshot's fsspec URL, the launcher's
``--remote`` and its process title).

The rule, the strictest of what the remote tier, the snapshot tier and the launcher each did:

- the userinfo of every ``scheme://`` in a text runs to the *last* '@' of its token (up to
  whitespace or a NUL), as ``shmcache.tiers.remote.parse_url`` reads it, so a password may hold
  '/', '?', '#' or '@' (a generated one often has '/'); ``user:password`` shows as ``user:***``,
  a userinfo with no ':' (a token, or redis-py's ``redis://password@host``) as ``***``;
- a userinfo never starts with '[' (RFC 3986 allows none there): ``redis://[:password@]host``, the
  usage text of a message, and ``redis://[::1]:6379``, an IPv6 host, are left alone;
- a ``password=`` query parameter (``?password=...``, ``&password=...``) shows as ``password=***``.
"""

from __future__ import annotations

import re

__all__ = ["mask_url", "split_userinfo", "scrub_secret"]

# scheme://userinfo@ anywhere in a text: the userinfo is greedy up to the last "@" of the token
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>(?!\[)[^\s\0]*)@")
_QUERY_PASSWORD = re.compile(r"(?i)([?&]password=)[^&#\s\0]*")


def split_userinfo(url: str) -> tuple[str, str, str]:
    """``(scheme://, userinfo, the rest)`` of one URL: the userinfo runs to the *last* '@' of the
    URL (no host, port, database or option holds one), the rule of mask_url, so that the password
    parse_url uses is the one mask_url hides; ``(url, "", "")`` for a URL without one."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, tail = rest.rpartition("@")
    return (scheme + sep, userinfo, tail) if sep and at else (url, "", "")


def mask_url(text: str, keep_length: bool = False) -> str:
    """``text`` with the password of every URL in it as ``***`` (the module's rule); a value that
    is not a string shows as its type (``<int>``). ``keep_length``: stars as long as each secret,
    so that the text keeps its length (a process title rewritten in place)."""
    if not isinstance(text, str):
        return f"<{type(text).__name__}>"
    userinfo = _same_length_userinfo if keep_length else _masked_userinfo
    query = _same_length_query if keep_length else r"\1***"
    return _QUERY_PASSWORD.sub(query, _USERINFO.sub(userinfo, text))


def scrub_secret(message: str, url: str) -> str:
    """A message of someone else's (a backend's exception) with ``url`` masked, and its password
    wherever else the message quotes it (one of 3 characters or more: a shorter one would star
    ordinary words)."""
    message = message.replace(url, mask_url(url))
    for match in _USERINFO.finditer(url):
        user, sep, secret = match.group("userinfo").partition(":")
        secret = secret if sep else user
        if len(secret) >= 3:
            message = message.replace(secret, "***")
    for match in _QUERY_PASSWORD.finditer(url):
        secret = url[match.end(1):match.end()]
        if len(secret) >= 3:
            message = message.replace(secret, "***")
    return message


def _masked_userinfo(match: re.Match) -> str:
    user, sep, _secret = match.group("userinfo").partition(":")
    return match.group("scheme") + (f"{user}:***" if sep else "***") + "@"


def _same_length_userinfo(match: re.Match) -> str:
    user, sep, secret = match.group("userinfo").partition(":")
    hidden = f"{user}:{'*' * len(secret)}" if sep else "*" * len(user)
    return match.group("scheme") + hidden + "@"


def _same_length_query(match: re.Match) -> str:
    return match.group(1) + "*" * (match.end() - match.end(1))
