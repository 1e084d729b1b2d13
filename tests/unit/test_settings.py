"""base/settings.py: every SHMCACHE_* variable's name, and the one place that reads them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import shmcache
from shmcache.base import settings
from shmcache.errors import InvalidArgument

PKG = Path(shmcache.__file__).resolve().parent


def test_names_are_unchanged():
    assert {name: getattr(settings, name) for name in settings.__all__ if name.startswith("ENV_")} == {
        "ENV_DIR": "SHMCACHE_DIR", "ENV_SESSION": "SHMCACHE_SESSION", "ENV_SIZE_MB": "SHMCACHE_SIZE_MB",
        "ENV_SPILLING": "SHMCACHE_SPILLING", "ENV_SPILL_DIR": "SHMCACHE_SPILL_DIR",
        "ENV_MEMORY_DIR": "SHMCACHE_MEMORY_DIR",
        "ENV_REMOTE": "SHMCACHE_REMOTE", "ENV_REMOTE_PASSWORD": "SHMCACHE_REMOTE_PASSWORD",
        "ENV_SNAPSHOT": "SHMCACHE_SNAPSHOT", "ENV_SECRET": "SHMCACHE_SECRET", "ENV_MAX_ITEM_MB": "SHMCACHE_MAX_ITEM_MB",
        "ENV_RDZV_TOKEN": "SHMCACHE_RDZV_TOKEN", "ENV_LAUNCH": "SHMCACHE_LAUNCH", "ENV_ORDERING": "SHMCACHE_ORDERING",
        "ENV_CRASH_AT": "SHMCACHE_CRASH_AT", "ENV_CRASH_AFTER": "SHMCACHE_CRASH_AFTER",
        "ENV_CLAIMS": "SHMCACHE_CLAIMS", "ENV_CLAIM_TIMEOUT_S": "SHMCACHE_CLAIM_TIMEOUT_S",
        "ENV_NATIVE": "SHMCACHE_NATIVE",
        "ENV_RANK": "RANK", "ENV_LOCAL_RANK": "LOCAL_RANK", "ENV_WORLD_SIZE": "WORLD_SIZE",
        "ENV_LOCAL_WORLD_SIZE": "LOCAL_WORLD_SIZE",
    }


def test_get_reads_at_the_call(monkeypatch):
    monkeypatch.delenv(settings.ENV_REMOTE, raising=False)
    assert settings.get(settings.ENV_REMOTE) is None
    assert settings.get(settings.ENV_REMOTE, "") == ""
    monkeypatch.setenv(settings.ENV_REMOTE, "redis://h:1")
    assert settings.get(settings.ENV_REMOTE) == "redis://h:1"


@pytest.mark.parametrize(("value", "on"), [
    ("1", True), ("true", True), (" Yes ", True), ("ON", True),
    ("0", False), ("", False), ("no", False), (" ", False),
])
def test_flag(monkeypatch, value, on):
    monkeypatch.setenv(settings.ENV_SPILLING, value)
    assert settings.flag(settings.ENV_SPILLING) is on


@pytest.mark.parametrize(("value", "off"), [("0", True), (" False ", True), ("NO", True), ("off", True),
                                            ("1", False), ("", False), ("Yes", False)])
def test_turned_off(monkeypatch, value, off):
    monkeypatch.setenv(settings.ENV_CLAIMS, value)
    assert settings.turned_off(settings.ENV_CLAIMS) is off



@pytest.mark.parametrize("read", [settings.flag, settings.turned_off])
@pytest.mark.parametrize("value", ["2", "maybe", "enabled", "-1"])
def test_an_on_off_variable_refuses_other_words(monkeypatch, read, value):
    """Not taken as the default: SHMCACHE_SPILLING=enabled would silently not spill."""
    monkeypatch.setenv(settings.ENV_SPILLING, value)
    with pytest.raises(InvalidArgument, match=re.escape(f"SHMCACHE_SPILLING={value!r}")):
        read(settings.ENV_SPILLING)

def test_turned_off_unset_is_on(monkeypatch):
    monkeypatch.delenv(settings.ENV_NATIVE, raising=False)
    assert settings.turned_off(settings.ENV_NATIVE) is False


def test_flag_unset_is_off(monkeypatch):
    monkeypatch.delenv(settings.ENV_SPILLING, raising=False)
    assert settings.flag(settings.ENV_SPILLING) is False


def test_without_ours():
    env = {"PATH": "/bin", "SHMCACHE_SECRET": "s", "SHMCACHE_RDZV_TOKEN": "t", "HOME": "/h"}
    assert settings.without_ours(env) == {"PATH": "/bin", "HOME": "/h"}


def test_no_module_but_settings_names_or_reads_a_shmcache_variable():
    """The names live in settings.py; every other module reads the environment's settings
    through it (the launcher's copy of the environment for its workers aside)."""
    named = re.compile(r"""^\s*ENV\w*\s*=\s*["']""", re.M)
    read = re.compile(r"""os\.(environ|getenv)\b[^\n]*(SHMCACHE|ENV_|["'](LOCAL_)?(RANK|WORLD_SIZE)["'])""")
    for path in PKG.rglob("*.py"):
        if path.name == "settings.py" and path.parent.name == "base":
            continue
        text = path.read_text()
        assert not named.search(text), f"{path}: a variable's name belongs in base/settings.py"
        assert not read.search(text), f"{path}: read it with base.settings"
