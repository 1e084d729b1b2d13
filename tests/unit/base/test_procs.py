"""shmcache.base.procs: another process's parent and start time, read from /proc/PID/stat, whose
process name (in parentheses) may hold anything - ')' and spaces a process can give itself."""

from __future__ import annotations

import os
import subprocess
import sys

from shmcache.base import procs

NAMED = ("import ctypes, sys\n"
         "ctypes.CDLL(None).prctl(15, b'x) 1 2 (y', 0, 0, 0)  # PR_SET_NAME\n"
         "print('named', flush=True)\n"
         "sys.stdin.read()\n")


def test_a_process_named_with_parentheses_and_spaces_is_read_right():
    child = subprocess.Popen([sys.executable, "-c", NAMED], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "named"
        with open(f"/proc/{child.pid}/stat", "rb") as f:
            assert b"(x) 1 2 (y)" in f.read()  # the name the parser must see past
        assert procs.parent_pid(child.pid) == os.getpid()
        when = procs.start_time(child.pid)
        assert when.isdigit() and int(when) >= int(procs.start_time(os.getpid()))
        assert procs.started(child.pid) == f"{child.pid}@{when}"
    finally:
        child.stdin.close()
        child.stdout.close()
        child.wait(10)


def test_a_process_that_is_gone_says_nothing():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(10)  # reaped: its /proc entry is gone (its pid not reused this soon)
    assert procs.parent_pid(child.pid) is None and procs.start_time(child.pid) == ""
    assert procs.started(child.pid) == str(child.pid) and procs.started(None) == "?"
