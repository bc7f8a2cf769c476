"""scripts/lib.sh `find_python`, which scripts/test uses to run the pure tests on the
other supported Python: a candidate counts only when it runs and is that version, and
none found is a plain non-zero status (scripts/test then says it skipped)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT

OWN_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


def find_python(
    version: str, path_dirs: list[Path], home: Path
) -> subprocess.CompletedProcess[str]:
    """find_python VERSION with nothing on PATH but `path_dirs` and the one tool
    scripts/lib.sh needs to be sourced (dirname): no system Python, pyenv or uv."""
    tools = home / "tools"
    if not tools.exists():
        tools.mkdir()
        (tools / "dirname").symlink_to(shutil.which("dirname") or "/usr/bin/dirname")
    env = {
        "PATH": os.pathsep.join(map(str, [*path_dirs, tools])),
        "HOME": str(home),
        "PYENV_ROOT": str(home / "pyenv"),
    }
    return subprocess.run(
        [
            shutil.which("bash") or "/bin/bash",
            "-c",
            'source scripts/lib.sh && find_python "$1"',
            "find",
            version,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_an_interpreter_of_that_version_on_path_is_found(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / f"python{OWN_VERSION}").symlink_to(sys.executable)
    found = find_python(OWN_VERSION, [bin_dir], tmp_path)
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()).resolve() == Path(sys.executable).resolve()


def test_one_that_is_another_version_or_does_not_run_is_not(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # A python3.77 that is really this interpreter, and one that cannot run.
    (bin_dir / "python3.77").symlink_to(sys.executable)
    (bin_dir / "python3.78").write_text("#!/bin/sh\nexit 127\n")
    (bin_dir / "python3.78").chmod(0o755)
    for version in ("3.77", "3.78", "3.79"):
        found = find_python(version, [bin_dir], tmp_path)
        assert found.returncode == 1, (version, found.stdout, found.stderr)
        assert found.stdout == "", version


def test_a_pyenv_version_is_found(tmp_path: Path) -> None:
    versions = tmp_path / "pyenv" / "versions" / f"{OWN_VERSION}.99" / "bin"
    versions.mkdir(parents=True)
    (versions / f"python{OWN_VERSION}").symlink_to(sys.executable)
    found = find_python(OWN_VERSION, [], tmp_path)
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()).resolve() == Path(sys.executable).resolve()
