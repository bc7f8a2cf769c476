"""Every repository path and dotted name the prose names exists.

    the prose                           what is read
    Python comments and docstrings      gate/, tests/, loadtest/, scripts/, deploy/
    SQL comments                        the migrations and routines (DB_DIR)
    pages                               docs/*.md, README.md, loadtest/README.md

    a path       gate/… tests/… docs/… lua/… db/… loadtest/… scripts/… deploy/…
                 exists; a glob matches a file; `db/006` is a migration's number;
                 a placeholder (<name>, NNN) needs its directory
    "<path>.py Name"   a path followed by a CamelCase or CONSTANT name: the file
                       defines it (not merely imports it)
    "gate_r (<path>.sql)"  a routine named with its file: the file creates it
    <name>.sql/.lua    a bare file name: a file of that name is in the project
    gate.<mod>.<Name>  a module (or data package) and, after it, a name its top
                       level defines (and a class's member); or a name the code
                       writes as a string (a logger, a span attribute, a lock row);
                       or a member of the running Gate (gate/runtime.py), which the
                       prose calls `gate`

All resolved statically (files, AST), nothing imported. A file moved or a name
renamed fails here with each place that still names the old one.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
import tomllib
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

from tests.support import ROOT

TOPS = ("gate", "tests", "docs", "lua", "db", "loadtest", "scripts", "deploy")
PYTHON_DIRS = ("gate", "tests", "loadtest", "scripts", "deploy")
PAGES = (*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "loadtest" / "README.md")
DB_DIR = ROOT / "db"
# Packages that live outside gate/ (lua/ as gate.lua, db/ as gate.db).
PACKAGE_DIRS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["tool"][
    "setuptools"
]["package-dir"]

_PATH = re.compile(rf"(?<![\w./@:$~-])((?:{'|'.join(TOPS)})/[\w./*<>-]*)")
_PATH_NAME = re.compile(
    r"(?<![\w./@:$~-])((?:gate|tests|loadtest|scripts)/[\w/.-]+\.py)(?:'s)?[ `]+"
    r"([A-Z][a-z0-9]+[A-Z]\w*|[A-Z][A-Z0-9]*_[A-Z0-9_]+)\b"
)
# (gate.lua is the package, not a file.)
_BARE_FILE = re.compile(r"(?<![\w./*<>-])(?!gate\.lua\b)([a-z0-9]\w*\.(?:sql|lua))\b")
_DOTTED = re.compile(r"(?<![\w./$-])(gate(?:\.[A-Za-z_]\w*)+)")
_ROUTINE_FILE = re.compile(r"\b(gate_[a-z_]+) \((db/[\w/]+\.sql)\)")
_PLACEHOLDER = re.compile(r"<|NNN")
_STRING = re.compile(r"[\"'](gate(?:\.[A-Za-z_]\w*)+)[\"']")

# Where a run writes its output (git-ignored): named before any run made it.
GENERATED = ("loadtest/results/",)
# Names that are deliberately hypothetical, each with why.
ALLOWED = {
    # docs/deploy.md: the overlay the reader makes by copying overlays/example.
    "deploy/kubernetes/overlays/shop",
    # tests/reserve/test_parts.py: the shape of the import the test forbids, `x` any module.
    "gate.reserve.x",
}


def _prose_lines(path: Path) -> Callable[[int, int], bool]:
    """Whether (line, column) of a Python file is in a comment or a docstring."""
    source = path.read_text(encoding="utf-8")
    comments: dict[int, int] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.start[1]
    docs: set[int] = set()
    bodies: list[list[ast.stmt]] = [_tree(path).body]
    while bodies:
        body = bodies.pop()
        first = body[0] if body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            if isinstance(first.value.value, str):
                docs |= set(range(first.lineno, (first.end_lineno or first.lineno) + 1))
        for node in body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                bodies.append(node.body)
    return lambda line, column: line in docs or column >= comments.get(line, 1 << 30)


def _sql_prose(line: str, column: int) -> bool:
    return "--" in line[:column]


def path_exists(ref: str) -> bool:
    if ref.rstrip("/") in ALLOWED or f"{ref}/".startswith(GENERATED):
        return True
    ref = ref.rstrip("/")
    if _PLACEHOLDER.search(ref):
        return (ROOT / _PLACEHOLDER.split(ref)[0].rpartition("/")[0]).is_dir()
    path = ROOT / ref
    if "*" in ref:
        return any(path.parent.glob(path.name))
    if path.exists():
        return True
    # `db/006`: a migration by its number.
    return bool(re.fullmatch(r"\d{3}", path.name)) and any(path.parent.glob(f"{path.name}_*"))


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _defined(body: list[ast.stmt], imports: bool = True) -> set[str]:
    names: set[str] = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom) and imports:
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.If | ast.Try):
            names |= _defined(node.body, imports)
            names |= _defined(getattr(node, "orelse", []), imports)
    return names


def _members(cls: ast.ClassDef) -> set[str]:
    """What a class defines in its body and assigns to self anywhere in it."""
    names = _defined(cls.body)
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and isinstance(node.ctx, ast.Store)
        ):
            names.add(node.attr)
    return names


def _class(path: Path, name: str) -> ast.ClassDef | None:
    for node in _tree(path).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def name_in_module(path: Path, names: list[str]) -> bool:
    """names[0] at the top level of the module at path, names[1] a member of that class."""
    if not names:
        return True
    if names[0] not in _defined(_tree(path).body):
        return False
    cls = _class(path, names[0])
    return len(names) == 1 or cls is None or names[1] in _members(cls)


def _package_path(parts: list[str]) -> Path:
    """Where a dotted module or package lives in the checkout."""
    for cut in range(len(parts), 0, -1):
        mapped = PACKAGE_DIRS.get(".".join(parts[:cut]))
        if mapped is not None:
            return ROOT.joinpath(mapped, *parts[cut:])
    return ROOT.joinpath(*parts)


def _module_file(parts: list[str]) -> Path | None:
    base = _package_path(parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@cache
def data_files() -> frozenset[str]:
    """The names of the project's SQL and Lua files."""
    tops = [ROOT / top for top in (*PYTHON_DIRS, "lua", "db") if (ROOT / top).is_dir()]
    return frozenset(p.name for top in tops for p in (*top.rglob("*.sql"), *top.rglob("*.lua")))


@cache
def code_strings() -> frozenset[str]:
    """The dotted strings gate/ writes: logger names, span attributes, lock rows."""
    found: set[str] = set()
    for path in (ROOT / "gate").rglob("*.py"):
        found |= set(_STRING.findall(path.read_text(encoding="utf-8")))
    return frozenset(found)


def dotted_exists(ref: str) -> bool:
    if ref in ALLOWED or ref in code_strings():
        return True
    parts = ref.split(".")
    for cut in range(len(parts), 1, -1):
        module = _module_file(parts[:cut])
        if module is not None:
            return name_in_module(module, parts[cut:])
        if _package_path(parts[:cut]).is_dir():  # a package of data files only
            return cut == len(parts)
    # `gate.stop()`: the running Gate, as the code names it too.
    gate = _class(ROOT / "gate" / "runtime.py", "Gate")
    return gate is not None and parts[1] in _members(gate)


def problems(text: str) -> Iterator[tuple[int, str]]:
    """(offset, what is wrong) for each name in text that points nowhere."""
    for match in _PATH.finditer(text):
        ref = match.group(1).rstrip(".,:;'`")
        if not path_exists(ref):
            yield match.start(), f"{ref} does not exist"
    for match in _PATH_NAME.finditer(text):
        path, name = ROOT / match.group(1), match.group(2)
        if path.is_file() and name not in _defined(_tree(path).body, imports=False):
            yield match.start(), f"{match.group(1)} does not define {name}"
    for match in _ROUTINE_FILE.finditer(text):
        routine, path = match.group(1), ROOT / match.group(2)
        creates = re.compile(rf"CREATE (OR REPLACE )?(PROCEDURE|FUNCTION) {routine}\b")
        if path.is_file() and not creates.search(path.read_text(encoding="utf-8")):
            yield match.start(), f"{match.group(2)} does not create {routine}"
    for match in _BARE_FILE.finditer(text):
        if match.group(1) not in data_files():
            yield match.start(), f"{match.group(1)} does not exist"
    for match in _DOTTED.finditer(text):
        if not dotted_exists(match.group(1)):
            yield match.start(), f"{match.group(1)} does not exist"


def stale_references() -> list[str]:
    """Each name in the prose that points nowhere, as "file:line: what"."""
    found = set()
    sources = [
        *(p for top in PYTHON_DIRS for p in (ROOT / top).rglob("*.py")),
        *DB_DIR.rglob("*.sql"),
        *PAGES,
    ]
    for path in sources:
        text = path.read_text(encoding="utf-8")
        stale = list(problems(text))
        if not stale:
            continue
        in_prose = _prose_lines(path) if path.suffix == ".py" else None
        lines = text.splitlines()
        for offset, what in stale:
            line = text.count("\n", 0, offset) + 1
            column = offset - (text.rfind("\n", 0, offset) + 1)
            if path.suffix == ".sql" and not _sql_prose(lines[line - 1], column):
                continue
            if in_prose is not None and not in_prose(line, column):
                continue
            found.add(f"{path.relative_to(ROOT).as_posix()}:{line}: {what}")
    return sorted(found)


def test_every_named_path_and_dotted_name_exists() -> None:
    stale = stale_references()
    assert not stale, "names that point nowhere:\n" + "\n".join(stale)


def test_the_check_sees_a_stale_name() -> None:
    good = (
        "gate/store/db.py, db/006, lua/<name>.lua, admit.lua, gate.store.db.Database,"
        " gate.base.codes.DbCode, gate.access (a logger), gate.stop() (the running Gate),"
        " gate/web/recorder.py RequestRecorder, gate_reserve (db/routines/gate_reserve.sql),"
        " gate.lua, gate.db.routines (the data packages lua/ and db/routines/)"
    )
    assert list(problems(good)) == []
    bad = (
        "gate/store/nowhere.py, gate.codes.DbCode, gate.store.db.Nowhere, nowhere.lua,"
        " gate/api/ops.py RequestRecorder, gate_expire_batch (db/004_expiry.sql),"
        " gate/lua/admit.lua"
    )
    assert [what for _, what in problems(bad)] == [
        "gate/store/nowhere.py does not exist",
        "gate/lua/admit.lua does not exist",
        "gate/api/ops.py does not define RequestRecorder",
        "db/004_expiry.sql does not create gate_expire_batch",
        "nowhere.lua does not exist",
        "gate.codes.DbCode does not exist",
        "gate.store.db.Nowhere does not exist",
    ]
