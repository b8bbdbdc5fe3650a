"""Cache operations quote every shell word: a hostile cache.root runs nothing of its own."""

from __future__ import annotations

import subprocess
from pathlib import Path

from pyinfra.api import StringCommand

from hgxserve.operations.caches import _restore_commands, shell_words


def _run(command: StringCommand, cwd: Path) -> None:
    text = command.get_raw_value()
    subprocess.run(["sh", "-c", text], cwd=cwd, check=False, capture_output=True, timeout=30)


def test_hostile_cache_root_runs_no_touch(tmp_path: Path) -> None:
    proof = tmp_path / "p"
    root = f"{tmp_path}/x;touch {proof};#"
    commands = _restore_commands("k", "fk", root, "/dev/null", "ab" * 32, "/bin/true")
    for command in commands:
        if isinstance(command, StringCommand):
            _run(command, tmp_path)
    assert not proof.exists()
    # the directory was made under the literal name, as a quoted word
    assert (Path(root) / ".archives").is_dir()


def test_every_word_is_one_argument(tmp_path: Path) -> None:
    words = ["printf", "%s\\n", "a b", "$(touch p)", "`touch q`", "x'y", "-n"]
    done = subprocess.run(
        ["sh", "-c", shell_words(*words).get_raw_value()],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.splitlines() == words[2:]
    assert not (tmp_path / "p").exists() and not (tmp_path / "q").exists()
