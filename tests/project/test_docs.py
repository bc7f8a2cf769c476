"""The reference pages stay true to the code, and the project names nothing outside it.

    docs/configuration.md  <->  every GATE_* name the code reads (AST of gate/, loadtest/,
                                tests/support.py; the set-up scripts), with the defaults
                                and bounds of env_int/env_float/env_bool calls
    docs/cli.md            <->  the argparse tree of gate/cli/__init__.py (and the areas' commands)
    docs/api.md            <->  /openapi.json as a running gate serves it (gate/api/markdown.py)

A variable, command or option added later fails here, naming itself, until its row
is written.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
from pathlib import Path
from typing import Any

import pytest

from gate.api import markdown
from gate.base.limits import SCOPES
from gate.cli import parser
from tests.support import ROOT, Client

CONFIG_DOC = ROOT / "docs" / "configuration.md"
CLI_DOC = ROOT / "docs" / "cli.md"
NAME = re.compile(r"^GATE_[A-Z0-9_]*[A-Z0-9]$")
SHELL_NAME = re.compile(r"\b(GATE_[A-Z0-9_]+)\b")
# Names built at run time, expanded here: GATE_LIMIT_<scope> (gate/base/settings.py).
DYNAMIC = {"GATE_LIMIT_": [f"GATE_LIMIT_{scope.upper()}" for scope in SCOPES]}
SHELL_SCRIPTS = (
    "scripts/lib.sh",
    "scripts/test",
    "scripts/run",
    "scripts/lock",
    "scripts/debian-check",
)
ENV_READERS = ("env_int", "env_float", "env_bool")


def _python_sources() -> list[Path]:
    return [
        *sorted((ROOT / "gate").rglob("*.py")),
        *sorted((ROOT / "loadtest").rglob("*.py")),
        ROOT / "tests" / "support.py",
        ROOT / "tests" / "conftest.py",
        ROOT / "tests" / "store" / "test_cluster.py",
    ]


def _literal(node: ast.expr) -> Any:
    """A literal number, also written as arithmetic (90 * 86_400); None otherwise."""
    if not all(isinstance(n, ast.Constant | ast.BinOp | ast.operator) for n in ast.walk(node)):
        return None
    return eval(compile(ast.Expression(node), "<literal>", "eval"))  # constants only


def code_variables() -> tuple[dict[str, set[str]], dict[str, tuple[str, list[Any]]]]:
    """{name: files that read it}, {name: (reader, [default, lo, hi] literals or None)}."""
    readers: dict[str, set[str]] = {}
    calls: dict[str, tuple[str, list[Any]]] = {}
    for path in _python_sources():
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if NAME.match(node.value):
                    readers.setdefault(node.value, set()).add(rel)
            elif isinstance(node, ast.JoinedStr) and node.values:
                head = node.values[0]
                if (
                    isinstance(head, ast.Constant)
                    and re.fullmatch(r"GATE_[A-Z0-9_]*", str(head.value))
                    and len(node.values) > 1
                ):
                    expanded = DYNAMIC.get(str(head.value))
                    assert expanded, (
                        f"{rel}:{node.lineno} builds a GATE_* name at run time"
                        f" ({head.value!r}…); list its expansions in DYNAMIC here"
                    )
                    for name in expanded:
                        readers.setdefault(name, set()).add(rel)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ENV_READERS
                and len(node.args) >= 3
                and isinstance(node.args[1], ast.Constant)
            ):
                calls[str(node.args[1].value)] = (
                    node.func.id,
                    [_literal(a) for a in node.args[2:]],
                )
    for script in SHELL_SCRIPTS:
        for name in SHELL_NAME.findall((ROOT / script).read_text(encoding="utf-8")):
            readers.setdefault(name, set()).add(script)
    return readers, calls


def doc_rows(path: Path) -> dict[str, list[str]]:
    """First-column name -> the row's cells, from every table of a page."""
    rows: dict[str, list[str]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        name = cells[0].strip("`").split()[0].strip("`")
        assert name not in rows, f"{path.name}: two rows for {name}"
        rows[name] = cells
    return rows


def _number(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _plain(cell: str) -> str:
    return cell.replace("`", "").replace("_", "").replace(" ", "")


def test_every_variable_has_a_row_and_every_row_a_variable() -> None:
    readers, _ = code_variables()
    rows = {n: c for n, c in doc_rows(CONFIG_DOC).items() if n.startswith("GATE_")}
    missing = sorted(set(readers) - set(rows))
    assert not missing, "no row in docs/configuration.md for: " + ", ".join(
        f"{n} (read by {', '.join(sorted(readers[n]))})" for n in missing
    )
    stale = sorted(set(rows) - set(readers))
    assert not stale, f"docs/configuration.md describes variables nothing reads: {stale}"


def test_each_row_names_where_it_is_read() -> None:
    readers, _ = code_variables()
    for name, cells in doc_rows(CONFIG_DOC).items():
        assert len(cells) == 5, f"{name}: expected variable | default | bounds | read by | meaning"
        named = set(re.findall(r"`([^`]+)`", cells[3]))
        assert named & readers[name], (
            f"{name}: 'read by' should name one of {sorted(readers[name])}, says {cells[3]!r}"
        )


def test_defaults_and_bounds_are_the_code_s() -> None:
    _, calls = code_variables()
    rows = doc_rows(CONFIG_DOC)
    assert len(calls) > 60
    for name, (reader, (default, *bounds)) in calls.items():
        _, doc_default, doc_bounds, _, _ = rows[name]
        if default is not None:
            assert _plain(doc_default) == _number(default), (
                f"{name}: the code's default is {_number(default)}, the doc says {doc_default!r}"
            )
        if reader == "env_bool":
            continue
        lo, hi = bounds
        if lo is not None:
            assert _plain(doc_bounds).startswith(f"{_number(lo)}–"), (
                f"{name}: the code's bounds start at {_number(lo)}, the doc says {doc_bounds!r}"
            )
        if hi is not None:
            assert re.match(rf"^[^–]*–{re.escape(_number(hi))}(\D|$)", _plain(doc_bounds)), (
                f"{name}: the code's upper bound is {_number(hi)}, the doc says {doc_bounds!r}"
            )


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## `gate (\S+)`\s*$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_cli_page_describes_every_command_option_and_exit_code() -> None:
    sections = _sections(CLI_DOC.read_text(encoding="utf-8"))
    commands = _commands()
    assert not set(commands) - set(sections), (
        f"commands without a section in docs/cli.md: {sorted(set(commands) - set(sections))}"
    )
    assert not set(sections) - set(commands), (
        f"docs/cli.md describes commands gate lacks: {sorted(set(sections) - set(commands))}"
    )
    for name, sub in commands.items():
        text = sections[name]
        assert re.search(r"^Exit codes: 0 ", text, re.M), f"gate {name}: no 'Exit codes:' line"
        rows = {}
        for line in text.splitlines():
            if line.startswith("| `"):
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                rows[cells[0].strip("`").split()[0]] = cells
        expected: dict[str, Any] = {}
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            key = max(action.option_strings, key=len) if action.option_strings else action.dest
            key = key if action.option_strings else key.upper()
            expected[key] = action
        assert set(rows) == set(expected), (
            f"gate {name}: options in docs/cli.md {sorted(rows)}, in the parser {sorted(expected)}"
        )
        for key, action in expected.items():
            default = action.default
            if default not in (None, False) and not isinstance(default, bool):
                assert rows[key][1].strip("`") == str(default), (
                    f"gate {name} {key}: default {default!r} in the parser, {rows[key][1]!r} here"
                )
        if not expected:
            assert "No options." in text, f"gate {name}: say 'No options.'"


async def test_api_page_is_what_the_served_document_gives(client: Client) -> None:
    served = await client.get("/openapi.json")
    assert served.status_code == 200
    text = markdown.API_DOC.read_text(encoding="utf-8")
    assert markdown.splice(text, markdown.render(served.json())) == text, (
        "docs/api.md is not what /openapi.json gives: run `.venv/bin/python -m gate.api.markdown`"
    )
    # Every operation, status and problem code of the document is on the page.
    doc = served.json()
    for path, item in doc["paths"].items():
        for method, op in item.items():
            assert f"### {method.upper()} `{path}`" in text
            for status in op["responses"]:
                assert f"| {status} |" in text
    for code in doc["components"]["schemas"]["Problem"]["properties"]["code"]["enum"]:
        assert f"| `{code}` |" in text


def _project_files() -> list[Path]:
    skip = {".git", ".local", "__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache"}
    out = []
    # Pruned while walking: .local may hold a Debian root file system with /proc mounted.
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [
            d for d in dirs if not (d in skip or d.startswith(".venv") or d.endswith(".egg-info"))
        ]
        for name in files:
            path = Path(top) / name
            if path.suffix not in (".png", ".lock") and path.is_file():
                out.append(path)
    return out


def test_no_file_names_a_path_outside_the_project() -> None:
    outside = ".." + "/shared"  # spelled apart so that this file does not name it
    for path in _project_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        assert outside not in text, f"{path.relative_to(ROOT)} names {outside}"
        if path.suffix != ".md":
            continue
        for target in re.findall(r"\]\(([^)#\s]+)", text):
            if "://" in target or target.startswith("mailto:"):
                continue
            resolved = (path.parent / target).resolve()
            assert resolved.is_relative_to(ROOT), f"{path.relative_to(ROOT)} links {target}"
            assert resolved.exists(), f"{path.relative_to(ROOT)} links {target}, which is missing"


@pytest.mark.parametrize("page", ["configuration.md", "cli.md", "api.md"])
def test_readme_points_at_the_reference(page: str) -> None:
    assert f"docs/{page}" in (ROOT / "README.md").read_text(encoding="utf-8")
