"""The complexity bound: no function in gate/ past McCabe 15, enforced by ruff (C901).

    pyproject.toml [tool.ruff.lint]   select C90, mccabe max-complexity = 15,
                                      tests/** and loadtest/** exempt
    scripts/test                      ruff check gate tests loadtest (fails the run)

A copy of the configuration is run on planted functions, so that the lint is seen to
fail: one of complexity 16 in gate/ is reported, one of 15 is not, and the same 16
in tests/ and loadtest/ is not. An exception in gate/ is a `# noqa: C901` that says
why, on its line or in a comment right above; one without a reason fails here.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.support import ROOT

RUFF = Path(sys.executable).with_name("ruff")
COMPLEXITY_MAX = 15
EXEMPT = {"tests/**", "loadtest/**"}
_CODE = r"[A-Z]+[0-9]*"
# A noqa (line or file): bare silences C901 too; with codes, maybe followed by a reason.
_NOQA_RE = re.compile(rf"#\s*(?:ruff:\s*)?noqa\b(?P<codes>:\s*{_CODE}(?:\s*,\s*{_CODE})*)?")


def branches(name: str, count: int) -> str:
    """A function of McCabe complexity count + 1: `count` ifs in a row."""
    body = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(count))
    return f"def {name}(x: int) -> int:\n{body}    return -1\n"


def lint(root: Path) -> list[dict[str, object]]:
    """What `ruff check gate tests loadtest` (as scripts/test runs it) reports in `root`."""
    done = subprocess.run(
        [str(RUFF), "check", "--no-cache", "--output-format", "json", "gate", "tests", "loadtest"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode in (0, 1), done.stderr
    found: list[dict[str, object]] = json.loads(done.stdout)
    return found


def test_the_bound_is_configured_for_gate_only() -> None:
    lint_config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert "C90" in lint_config["select"] or "C901" in lint_config["select"]
    assert lint_config["mccabe"]["max-complexity"] == COMPLEXITY_MAX
    assert "C901" not in lint_config.get("ignore", []) and "C90" not in lint_config["ignore"]
    for pattern, codes in lint_config.get("per-file-ignores", {}).items():
        if {"C90", "C901"} & set(codes):
            assert pattern in EXEMPT, f"{pattern} is exempt from the complexity bound"
    script = (ROOT / "scripts" / "test").read_text()
    assert '"$VENV/bin/ruff" check gate tests loadtest' in script


def test_a_function_past_the_bound_in_gate_fails_the_lint(tmp_path: Path) -> None:
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for folder in ("gate", "tests", "loadtest"):
        (tmp_path / folder).mkdir()
    (tmp_path / "gate" / "planted.py").write_text(
        branches("at_the_bound", COMPLEXITY_MAX - 1)
        + "\n\n"
        + branches("past_the_bound", COMPLEXITY_MAX)
        + "\n\n# The way an exception is written: with its reason.\n"
        + branches("excused", COMPLEXITY_MAX).replace(":\n", ":  # noqa: C901 one flat table\n", 1)
    )
    for folder in ("tests", "loadtest"):
        (tmp_path / folder / "planted.py").write_text(branches("long_scenario", COMPLEXITY_MAX))
    found = lint(tmp_path)
    assert [(f["code"], Path(str(f["filename"])).relative_to(tmp_path)) for f in found] == [
        ("C901", Path("gate/planted.py"))
    ], found
    assert "`past_the_bound` is too complex (16 > 15)" in str(found[0]["message"])


def unjustified(text: str) -> list[int]:
    """The lines (1-based) of `text` that silence C901 without saying why: a reason
    after the codes on the line, or a comment on the line right above."""
    lines = text.splitlines()
    found = []
    for number, line in enumerate(lines, 1):
        match = _NOQA_RE.search(line)
        if match is None:
            continue
        codes = re.findall(_CODE, match["codes"] or "")
        if codes and not {"C90", "C901"} & set(codes):
            continue
        reason = line[match.end() :].strip(" -—:()")
        above = lines[number - 2].strip() if number > 1 else ""
        if not reason and not above.startswith("#"):
            found.append(number)
    return found


def test_every_exception_in_gate_says_why() -> None:
    bare = {
        str(path.relative_to(ROOT)): lines
        for path in sorted((ROOT / "gate").rglob("*.py"))
        if (lines := unjustified(path.read_text(encoding="utf-8")))
    }
    assert not bare, f"noqa: C901 without a reason (lines): {bare}"


def test_an_exception_without_a_reason_is_caught() -> None:
    assert unjustified("x = 1\ndef f():  # noqa: C901\n    pass\n") == [2]
    assert unjustified("def f():  # noqa\n    pass\n") == [1]
    assert unjustified("def f():  # noqa: E501, C901\n") == [1]
    assert unjustified("def f():  # noqa: E501\n") == []
    assert unjustified("def f():  # noqa: C901 one table of 40 codes, read as one\n") == []
    assert unjustified("# One table of 40 codes, read as one.\ndef f():  # noqa: C901\n") == []
