"""Fork helpers for lock tests: a holder that dies while an idle child it forked lives on."""

from __future__ import annotations

import os
import time


def die_holding_after_forking_an_idle_child(hold, pid_file) -> int:
    """Fork P: P takes ``hold()`` once (its descriptor stays open), forks an idle child C (which
    never touches the lock), takes it again and dies holding it. Returns C's pid once P is gone."""
    p = os.fork()
    if p == 0:  # P
        try:
            release = hold()
            release()
            c = os.fork()
            if c == 0:  # C: idle until killed
                time.sleep(60)
                os._exit(0)
            pid_file.write_text(str(c))
            hold()
        finally:
            os._exit(0)  # dies holding: no release, no finalisers
    os.waitpid(p, 0)
    return int(pid_file.read_text())


def reap(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass
    for _ in range(200):  # C was re-parented: wait until it is gone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)

