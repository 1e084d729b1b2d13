"""The command line, in-process through ``main(argv)`` and as ``python -m shmcache``: output and
exit codes of stat, ls, new, destroy, gc and info; and no torch import on the way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import posix_ipc
import pytest

from shmcache.cache.registry import SessionRegistry
from shmcache.cache.store import STAT_KEYS, CacheStore
from shmcache.cli.main import main

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration"))
from _workers import process_attached_to  # noqa: E402


def run(capsys, *argv):
    """``main(argv)`` -> (exit code, stdout, stderr); argparse's SystemExit counts as its code."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def populated():
    """Two sessions; 'train' holds a cache with 3 items, 2 hits and 1 miss."""
    s = CacheStore("train", "images", capacity_bytes=8 << 20)
    for k in range(3):
        s.put(k, np.zeros(1000, np.uint8))
    s.lookup(0)
    s.lookup(1)
    s.lookup(99)
    SessionRegistry().create("empty")
    yield s
    s.close()


def test_stat_table(capsys, populated):
    code, out, err = run(capsys, "stat")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["session", "cache", "dataset", "items"]
    assert "hits" in lines[0] and "misses" in lines[0] and "rejected" in lines[0]
    rows = [ln.split() for ln in lines[2:]]
    assert len(rows) == 1
    row = rows[0]
    assert row[:5] == ["train", "images", "-", "3", "0"]  # "-": no dataset was wrapped
    # hits, misses, rejected, computed, claim waits; last opened: open here
    assert row[-7:] == ["2", "1", "0", "0", "0", "in", "use"]


def test_stat_json_matches_the_store(capsys, populated):
    code, out, _ = run(capsys, "stat", "--json")
    assert code == 0
    rows = json.loads(out)
    assert len(rows) == 1
    row = rows[0]
    assert set(STAT_KEYS) <= set(row)
    want = populated.stats()
    for k in STAT_KEYS:
        assert row[k] == want[k], k
    assert row["items_mem"] == 3 and row["hits"] == 2 and row["misses"] == 1


def test_stat_one_session_and_unknown_session(capsys, populated):
    code, out, _ = run(capsys, "stat", "empty")
    assert code == 0 and "no caches" in out and "empty" in out
    code, out, _ = run(capsys, "stat", "train", "--json")
    assert code == 0 and [r["name"] for r in json.loads(out)] == ["images"]
    code, out, err = run(capsys, "stat", "nosuch")
    assert code == 1 and "nosuch" in err and "train" in err and out == ""


def test_stat_with_nothing(capsys):
    code, out, _ = run(capsys, "stat")
    assert code == 0 and "no caches" in out
    code, out, _ = run(capsys, "stat", "--json")
    assert code == 0 and json.loads(out) == []


def test_ls(capsys, populated):
    code, out, _ = run(capsys, "ls")
    assert code == 0
    names = [ln.split()[0] for ln in out.splitlines()[2:]]
    assert names == ["empty", "train"]
    code, out, _ = run(capsys, "ls", "--json")
    rows = {r["session"]: r for r in json.loads(out)}
    assert set(rows) == {"empty", "train"}
    assert rows["train"]["caches"] == 1 and rows["empty"]["caches"] == 0
    assert rows["train"]["shm_bytes"] > 3000 and rows["empty"]["shm_bytes"] == 0
    assert rows["train"]["live_processes"] == 1  # this process counted lookups: it holds a slot
    assert rows["empty"]["live_processes"] == 0
    assert rows["train"]["age_s"] >= 0


def test_ls_with_nothing(capsys):
    code, out, _ = run(capsys, "ls")
    assert code == 0 and "no sessions" in out


def test_new_and_destroy(capsys, shm_namespace):
    code, out, _ = run(capsys, "new", "mysession")
    assert code == 0 and out.strip() == "mysession"
    assert SessionRegistry().exists("mysession")
    code, out, _ = run(capsys, "new")
    random_name = out.strip()
    assert code == 0 and SessionRegistry().exists(random_name)
    code, _, err = run(capsys, "new", "mysession")
    assert code == 1 and "already exists" in err
    s = CacheStore("mysession", "c", capacity_bytes=4 << 20)
    s.put(1, 1)
    s.close()
    code, out, _ = run(capsys, "destroy", "mysession")
    assert code == 0 and "mysession" in out and "segments removed" in out
    assert not SessionRegistry().exists("mysession")
    assert not [n for n in shm_namespace.owned_segments() if "+mysession+" in n]
    assert SessionRegistry().exists(random_name)


@pytest.mark.parametrize("argv,code", [
    (["new", "a/b"], 2), (["new", ".."], 2), (["new", "x" * 65], 2), (["destroy", "nosuch"], 1),
    (["destroy", "../etc"], 2), (["stat", "a/b"], 2), ([], 2), (["bogus"], 2),
    (["stat", "--bogus"], 2), (["destroy"], 2), (["new", "a", "b"], 2), (["stat", ""], 2),
    (["new", "--", "-rf"], 2), (["new", "s", "--spill-dir", ""], 2),
])
def test_bad_arguments_exit_codes(capsys, argv, code):
    got, out, err = run(capsys, *argv)
    assert got == code, (argv, got, err)
    assert err.strip(), "an error says something on stderr"
    assert SessionRegistry().list() == []


def test_destroy_refuses_a_session_in_use_without_force(capsys):
    SessionRegistry().create("busy")
    with process_attached_to("busy") as proc:
        got, _, err = run(capsys, "destroy", "busy")
        assert got == 1 and str(proc.pid) in err and "--force" in err  # 1: not a usage error
        assert SessionRegistry().exists("busy")
        got, _, _ = run(capsys, "destroy", "--force", "busy")
        assert got == 0 and not SessionRegistry().exists("busy")


_OPEN_THEN_CLOSE = """
import sys
from shmcache import ShmDatasetCache
cache = ShmDatasetCache(session="closing", name="c", size=8)
cache.put(1, "one")
print("open", flush=True)
sys.stdin.readline()
cache.close()
print("closed", flush=True)
sys.stdin.read()  # keeps running, detached
"""


def test_destroy_without_force_succeeds_once_the_process_closed_its_caches():
    """close() used to leave the process attached, so destroy without --force refused."""
    proc = subprocess.Popen([sys.executable, "-c", _OPEN_THEN_CLOSE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "open"
        destroy = [sys.executable, "-m", "shmcache", "destroy", "closing"]
        busy = subprocess.run(destroy, capture_output=True, text=True, timeout=60)
        assert busy.returncode == 1 and str(proc.pid) in busy.stderr  # attached while open
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "closed"
        done = subprocess.run(destroy, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert not SessionRegistry().exists("closing")
        assert proc.poll() is None, "the process is still running"
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        proc.stdout.close()


def test_gc_reports_what_it_removed(capsys, populated, shm_namespace):
    ghost = shm_namespace.segment_name("ghost", "c", "root")
    posix_ipc.SharedMemory(ghost, posix_ipc.O_CREX, mode=0o600, size=4096).close_fd()
    code, out, _ = run(capsys, "gc", "--json")
    assert code == 0
    report = json.loads(out)
    assert {"removed_segments", "removed_dirs", "removed_locks", "reclaimed_entries"} <= set(report)
    assert report["removed_segments"] == [ghost]
    assert report["reclaimed_entries"] == 0
    assert ghost not in shm_namespace.owned_segments()
    assert populated.stats()["items_mem"] == 3  # live caches untouched
    code, out, _ = run(capsys, "gc")
    assert code == 0 and out.startswith("gc: 0 orphaned segments removed")


def test_info(capsys, shm_namespace, populated):
    code, out, _ = run(capsys, "info", "--json")
    assert code == 0
    info = json.loads(out)
    assert info["namespace"] == str(shm_namespace.root)
    assert info["segment_prefix"] == shm_namespace.prefix
    assert info["sessions"] == 2 and info["segments"] == len(shm_namespace.owned_segments())
    st = os.statvfs("/dev/shm")
    assert info["shm_total_bytes"] == st.f_blocks * st.f_frsize
    assert 0 < info["auto_capacity_bytes"] <= info["shm_free_bytes"]
    code, out, _ = run(capsys, "info")
    assert code == 0 and str(shm_namespace.root) in out and "/dev/shm" in out


_NO_TORCH = r"""
import runpy, sys
codes = []
for argv in (["stat"], ["stat", "--json"], ["stat", "train"], ["ls"], ["ls", "--json"],
             ["info"], ["gc"], ["new", "from-cli"], ["destroy", "from-cli"]):
    sys.argv = ["shmcache", *argv]
    try:
        runpy.run_module("shmcache", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        codes.append(exc.code)
torch = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print("RESULT", codes, torch[:5])
"""


def test_python_dash_m_shmcache_never_imports_torch(populated):
    proc = subprocess.run([sys.executable, "-c", _NO_TORCH], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    result = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    assert result == "RESULT [0, 0, 0, 0, 0, 0, 0, 0, 0] []", result


def test_python_dash_m_shmcache_stat_end_to_end(populated):
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "shmcache", "stat", "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    assert [(r["session"], r["name"], r["items_mem"]) for r in rows] == [("train", "images", 3)]
    imported = [ln.rsplit("|", 1)[-1].strip() for ln in proc.stderr.splitlines()
                if ln.startswith("import time:")]
    assert "shmcache.cache.store" in imported
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]


# --- last use: ls and gc --idle-for --------------------------------------------------------------

DAY = 86400.0


def _age(name, seconds):
    reg = SessionRegistry()
    reg.mark_used(name)
    t = time.time() - seconds
    os.utime(reg.session_dir(name) / "last_used", (t, t))


def test_ls_shows_when_each_session_was_last_used(capsys):
    reg = SessionRegistry()
    for name in ("busy", "old"):
        reg.create(name)
    _age("old", 3 * 3600 + 60)
    with process_attached_to("busy"):
        _age("busy", 5 * DAY)
        code, out, _ = run(capsys, "ls")
        assert code == 0
        lines = out.splitlines()
        assert "last used" in lines[0]
        rows = {ln.split()[0]: ln for ln in lines[2:]}
        assert "in use" in rows["busy"] and "3h ago" in rows["old"]
        code, out, _ = run(capsys, "ls", "--json")
        got = {r["session"]: r for r in json.loads(out)}
        assert got["busy"]["idle_s"] == 0 and abs(got["busy"]["last_used"] - time.time()) < 60
        assert 3 * 3600 < got["old"]["idle_s"] < 3 * 3600 + 120
        assert abs(got["old"]["last_used"] + got["old"]["idle_s"] - time.time()) < 60


def test_gc_idle_for_destroys_only_old_sessions_nobody_is_attached_to(capsys, shm_namespace):
    reg = SessionRegistry()
    for name in ("busy", "old", "fresh", "older"):
        reg.create(name)
    _age("old", 2 * DAY)
    _age("older", 3 * 7 * DAY)
    _age("fresh", 3600)
    with process_attached_to("busy"):
        _age("busy", 30 * DAY)
        code, out, _ = run(capsys, "gc", "--idle-for", "1d")
        assert code == 0
        assert "destroyed session 'old', unused for 2d" in out
        assert "destroyed session 'older', unused for 21d" in out
        assert [s.name for s in reg.list()] == ["busy", "fresh"]
        reg.create("old")
        _age("old", 3 * 3600)
        code, out, _ = run(capsys, "gc", "--json", "--idle-for", "2h")
        report = json.loads(out)
        assert [s["session"] for s in report["destroyed_idle_sessions"]] == ["old"]
        assert report["destroyed_idle_sessions"][0]["idle_s"] >= 3 * 3600
        assert [s.name for s in reg.list()] == ["busy", "fresh"]
    code, out, _ = run(capsys, "gc", "--json")
    assert json.loads(out)["destroyed_idle_sessions"] == []  # without --idle-for, sessions stay
    assert [s.name for s in reg.list()] == ["busy", "fresh"]


@pytest.mark.parametrize("text", ["1y", "1", "d", "-1d", "1.5.d", "", "nan d", "infh"])
def test_gc_idle_for_refuses_what_is_not_a_duration(capsys, text):
    SessionRegistry().create("s")
    code, _, err = run(capsys, "gc", f"--idle-for={text}")
    assert code == 2 and "--idle-for" in err and "90s, 30m, 12h, 1d, 2w" in err, err
    assert SessionRegistry().exists("s")


@pytest.mark.parametrize("text,seconds", [("90s", 90), ("30m", 1800), ("12h", 43200), ("1d", DAY),
                                          ("2w", 14 * DAY), ("1.5h", 5400), ("0s", 0)])
def test_durations(text, seconds):
    from shmcache.cli.main import _duration

    assert _duration(text) == seconds


def test_gc_does_not_call_the_slot_files_of_a_clean_exit_stale(capsys):
    SessionRegistry().create("s")
    with process_attached_to("s"):
        pass  # exited cleanly: its slot file stays, unlocked
    code, out, _ = run(capsys, "gc")
    assert code == 0 and "stale" not in out and "1 slot files of exited processes cleared" in out


# --- help ----------------------------------------------------------------------------------------


def test_every_argument_of_every_command_has_help():
    import argparse

    from shmcache.cli.main import _parser

    parser = _parser()
    missing = []
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in [("shmcache", parser), *sub.choices.items()]:
        for action in p._actions:
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert missing == []
    for choice in sub._choices_actions:
        assert choice.help, choice.dest


def test_destroy_error_on_the_command_line_says_dash_dash_force(capsys):
    SessionRegistry().create("busy")
    with process_attached_to("busy") as proc:
        code, _, err = run(capsys, "destroy", "busy")
        assert code == 1 and str(proc.pid) in err
        assert "`shmcache destroy --force busy`" in err and "force=True" not in err
