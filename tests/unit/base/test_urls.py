"""base/urls.py: the one rule that keeps a URL's secrets out of messages, stats, reprs and titles."""

from __future__ import annotations

import pytest

from shmcache.base.urls import mask_url, scrub_secret, split_userinfo

PW = "s3cret/Pa?ss#w@rd"


@pytest.mark.parametrize(("text", "shown"), [
    # the remote tier's URLs (redis-py reads a bare userinfo as a password)
    (f"redis://:{PW}@h:1/0", "redis://:***@h:1/0"),
    (f"redis://user:{PW}@h:1", "redis://user:***@h:1"),
    (f"redis+shards://{PW}@h:1,g:2", "redis+shards://***@h:1,g:2"),
    ("redis://h:1", "redis://h:1"),
    # a snapshot's fsspec URLs
    ("https://user:TOKEN@host/snap", "https://user:***@host/snap"),
    ("ftp://reader:pw@127.0.0.1:9/snap?x=1#f", "ftp://reader:***@127.0.0.1:9/snap?x=1#f"),
    ("s3://bucket/snap", "s3://bucket/snap"),
    ("/data/snap", "/data/snap"),
    # a password in the query
    ("https://host/snap?password=hunter2&x=1", "https://host/snap?password=***&x=1"),
    ("redis://h:1?Password=hunter2", "redis://h:1?Password=***"),
    # every URL in a text, each token on its own
    ("--remote redis://:pw1@a:1 --other ftp://u:pw2@b/x", "--remote redis://:***@a:1 --other ftp://u:***@b/x"),
    # usage texts and IPv6 hosts are no userinfo
    ("use redis://[:password@]host:port[/db]", "use redis://[:password@]host:port[/db]"),
    ("redis://[::1]:6379/0", "redis://[::1]:6379/0"),
    ("redis://:pw@[::1]:6379/0", "redis://:***@[::1]:6379/0"),
])
def test_mask_url(text, shown):
    assert mask_url(text) == shown


def test_mask_url_of_a_non_string_shows_its_type():
    assert mask_url(6379) == "<int>"
    assert mask_url(None) == "<NoneType>"


@pytest.mark.parametrize("text", [
    f"redis://:{PW}@h:1/0", "redis://:pw@h:1", "x\0redis://u:ab@h\0--remote\0ftp://tok@h/?password=p&q=1",
])
def test_keep_length_hides_the_same_and_keeps_the_length(text):
    kept = mask_url(text, keep_length=True)
    assert len(kept) == len(text)
    for secret in (PW, "pw@", ":ab@", "tok@", "=p&"):
        assert secret not in kept or secret not in text


def test_split_userinfo_runs_to_the_last_at():
    assert split_userinfo(f"redis://:{PW}@h:1/0") == ("redis://", f":{PW}", "h:1/0")
    assert split_userinfo("redis://h:1/0") == ("redis://h:1/0", "", "")
    assert split_userinfo("h:1") == ("h:1", "", "")


def test_split_and_mask_agree_on_the_password():
    url = f"rediss://user:{PW}@h:1/2?timeout=1"
    _head, userinfo, _tail = split_userinfo(url)
    assert userinfo.partition(":")[2] == PW
    assert mask_url(url) == "rediss://user:***@h:1/2?timeout=1"


def test_scrub_secret_masks_the_url_and_its_password_anywhere():
    url = "ftp://reader:hunter2@127.0.0.1:9/snap"
    message = f"530 login as reader with hunter2 failed for {url}"
    assert scrub_secret(message, url) == "530 login as reader with *** failed for ftp://reader:***@127.0.0.1:9/snap"
    assert scrub_secret("bad token tok123", "https://tok123@h/x") == "bad token ***"
    assert scrub_secret("query secret p4ss", "https://h/x?password=p4ss") == "query secret ***"
    assert scrub_secret("ab is short", "ftp://u:ab@h/x") == "ab is short"  # too short to star words
