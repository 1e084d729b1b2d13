"""`shmcache top` as a person runs it: `--once` as a process of its own, and the live view in a
real terminal (tmux: send-keys, capture-pane)."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _journey import env, run

LOOP = Path(__file__).with_name("_stall_loop.py")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` is still running (a zombie not yet reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _columns(out: str, first: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line.split()[:1] == [first]]


def test_top_once_shows_caches_and_ranks(tmp_path):
    e = env()
    e["RANK"] = "2"
    run([LOOP, "timed", 0.0, 0.0], tmp_path, e)  # cold
    st = json.loads(run([LOOP, "timed", 0.0, 0.0], tmp_path, e).splitlines()[-1])  # warm
    out = run(["-m", "shmcache", "top", "--once", "--interval", "0.2"], tmp_path, env())
    cache_row, rank_row = _columns(out, "stall")
    assert st["hits"] >= 32
    assert cache_row[:4] == ["stall", "data", "32", f"{st['hits'] / (st['hits'] + st['misses']):.1%}"]
    assert rank_row[:3] == ["stall", "data", "2"]
    assert rank_row[3] == "0%"  # nobody reads now


def test_top_once_sees_a_starved_rank_waiting(tmp_path):
    e = env()
    e["RANK"] = "1"
    # 0.8 s per batch from the source, steps of no time: the loop waits nearly all the time
    loop = subprocess.Popen([sys.executable, str(LOOP), "timed", "0.2", "0.0"], cwd=tmp_path, env=e,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while "data" not in run(["-m", "shmcache", "stat"], tmp_path, env()):
            assert time.monotonic() < deadline and loop.poll() is None, loop.stderr.read()
            time.sleep(0.1)
        out = run(["-m", "shmcache", "top", "--once", "--interval", "0.5", "--sort", "s"], tmp_path, env())
        (rank_row,) = [r for r in _columns(out, "stall") if len(r) >= 6 and r[2] == "1"]
        assert float(rank_row[3].rstrip("%")) >= 50, out
    finally:
        loop.kill()
        loop.wait(10)
        loop.stderr.close()


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_top_live_sorts_and_quits_in_a_terminal(tmp_path):
    e = env()
    run([LOOP, "timed", 0.0, 0.0], tmp_path, e)
    # a socket of the test's own (-S): tmux -L leaves its socket file in /tmp/tmux-UID after kill-server
    tmux = ["tmux", "-S", str(tmp_path / "tmux.sock")]
    command = " ".join(shlex.quote(a) for a in [
        "env", f"SHMCACHE_DIR={e['SHMCACHE_DIR']}", f"PYTHONPATH={e.get('PYTHONPATH', '')}", "TERM=xterm",
        sys.executable, "-m", "shmcache", "top", "--interval", "0.2"])

    def screen() -> str:
        return subprocess.run([*tmux, "capture-pane", "-p", "-t", "top"], capture_output=True, text=True,
                              timeout=10).stdout

    def wait_for(what, timeout=30.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = screen()
            if what(text):
                return text
            assert time.monotonic() < deadline, f"the screen never showed it:\n{text}"
            time.sleep(0.1)

    try:
        subprocess.run([*tmux, "new-session", "-d", "-s", "top", "-x", "160", "-y", "40", command], check=True,
                       timeout=10, cwd=tmp_path)
        subprocess.run([*tmux, "set-option", "-t", "top", "remain-on-exit", "on"], check=True, timeout=10)
        pid = int(subprocess.run([*tmux, "display-message", "-p", "-t", "top", "#{pane_pid}"], capture_output=True,
                                 text=True, timeout=10).stdout)
        text = wait_for(lambda t: "sorted by hits/s" in t and "stall    data" in t)
        assert "hit ratio" in text and "stall share" in text
        subprocess.run([*tmux, "send-keys", "-t", "top", "n"], check=True, timeout=10)
        wait_for(lambda t: "sorted by name" in t)
        subprocess.run([*tmux, "send-keys", "-t", "top", "q"], check=True, timeout=10)
        deadline = time.monotonic() + 30
        while True:
            # tmux marks the pane dead when its terminal closes, and records the exit status once
            # it has reaped the process (a busy CI machine has shown a dead pane whose status tmux
            # never recorded): the process gone and nothing on the screen but top's is the quit
            dead = subprocess.run([*tmux, "display-message", "-p", "-t", "top",
                                   "#{pane_dead} status=#{pane_dead_status} signal=#{pane_dead_signal}"],
                                  capture_output=True, text=True, timeout=10).stdout.split()
            if dead[:1] == ["1"] and (dead[1:] != ["status=", "signal="] or not _alive(pid)):
                break
            assert time.monotonic() < deadline, f"top did not quit on q: {dead}\n{screen()}"
            time.sleep(0.1)
        assert dead[1:] in (["status=0", "signal="], ["status=", "signal="]), dead  # quit: status 0
        assert "Traceback" not in screen()
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=10)
