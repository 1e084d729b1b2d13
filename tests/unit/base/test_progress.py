"""base/progress.py: one tqdm bar on stderr, or nothing (and tqdm not imported)."""

from __future__ import annotations

import subprocess
import sys

from shmcache.base.progress import NoBar, progress_bar


def test_no_bar_is_a_no_op_or_the_iterable_itself():
    bar = progress_bar(False, 10, "x")
    assert isinstance(bar, NoBar)
    bar.update(3)
    bar.close()
    items = [1, 2, 3]
    assert progress_bar(False, None, "x", iterable=items) is items


def test_none_draws_only_on_a_terminal(capsys):
    assert isinstance(progress_bar(None, 10, "x"), NoBar)  # pytest's stderr is no terminal


def test_a_bar_goes_to_stderr(capsys):
    bar = progress_bar(True, 2048, "export c", unit="B")
    bar.update(2048)
    bar.close()
    err = capsys.readouterr().err
    assert "export c" in err and "2.00k" in err  # bytes scale by 1024
    assert list(progress_bar(True, None, "warmup c", iterable=range(3), notebook=True)) == [0, 1, 2]
    assert "warmup c" in capsys.readouterr().err


def test_tqdm_is_imported_only_for_a_bar():
    code = ("import sys; from shmcache.base.progress import progress_bar; progress_bar(False, 1, 'x'); "
            "assert 'tqdm' not in sys.modules; progress_bar(True, 1, 'x').close(); assert 'tqdm' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
