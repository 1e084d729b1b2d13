"""The README's quick start holds exactly two commands, and CI runs the second one verbatim."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_quick_start_has_two_commands_with_torch_pinned():
    commands = quick_start_commands()
    assert len(commands) == 2, commands
    for cmd in commands:
        assert "\n" not in cmd
        assert "torch==2.13.0" in cmd, "every install step pins torch (no CUDA wheels)"
    assert "shmcache.launch --nproc 2" in commands[0]
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert quick_start_commands()[1] in ci


def test_readme_lists_exactly_the_keys_that_stats_returns():
    from shmcache.cache.store import CacheStore

    store = CacheStore("readme", "c", capacity_bytes=4 << 20)
    keys = set(store.stats())
    store.close()
    text = (ROOT / "README.md").read_text()
    bullet = text.split("- **`stats()`**", 1)[1].split("\n- ", 1)[0]
    assert set(re.findall(r"`(\w+)`", bullet)) == keys


def test_pyproject_states_a_torch_range_open_upward():
    """A library states the torch it needs, never caps it at today's version (installing shmcache
    into an environment with a newer torch must not downgrade it); the README's commands pin it."""
    text = (ROOT / "pyproject.toml").read_text()
    deps = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    (torch,) = re.findall(r'"(torch[^"]*)"', deps)
    assert re.fullmatch(r"torch>=[\d.]+", torch), torch
