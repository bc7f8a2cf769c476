"""SQL lives in its domain's store module (issue 47, requirement 3).

    every module under gate/ ──> the AST's string literals (docstrings aside, f-strings' literal
        parts too) ──> those that read as a statement (SELECT … FROM, INSERT INTO,
        UPDATE … SET, DELETE FROM, CALL name(, START TRANSACTION, …)
        ──> each in a store module: gate/store/ (the store layer itself) or a module
            named store.py, queries.py or repository.py inside its domain
        ──> or in a module of NOT_YET_MOVED below, which may only shrink: an entry
            whose module holds no SQL any more fails too, so it is taken out

Areas, CLIs and console panels call the domain's functions instead of holding
statements of their own.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support import ROOT

GATE = ROOT / "gate"
STORE_NAMES = {"store.py", "queries.py", "repository.py"}
_KEYWORD = re.compile(
    r"^\s*(SELECT|INSERT|UPDATE|DELETE|REPLACE|CALL|START\s+TRANSACTION|WITH|DO|SET|LOCK|UNLOCK)(\s|$)"
)
_ANYWHERE = re.compile(
    r"\b(SELECT|INSERT|UPDATE|DELETE|REPLACE|CALL|START\s+TRANSACTION|WITH|DO|SET|LOCK|UNLOCK)\b"
)
# What makes the keyword a statement rather than a word in prose or an HTTP method.
_STATEMENT = re.compile(r"\bFROM\b|\bINTO\b|\bSET\b|%s|\w\(|TRANSACTION|^\s*SELECT\s+\d")

# Modules still holding SQL of their own, each to be moved into its domain's store
# module. The list only shrinks (an entry without SQL fails the test).
NOT_YET_MOVED = {
    # The probes of readiness and the console's one snapshot query: web/console
    # layers reading MariaDB directly.
    "gate/api/health.py",
    "gate/console/snapshot.py",
    # Expiry (the sweeper, the invariant monitor): its own store module is still to come.
    "gate/expiry/invariant_monitor.py",
    "gate/expiry/sweeper.py",
    # Inventory: to move into gate/inventory/store.py (deals.py is being reworked
    # separately).
    "gate/inventory/deals.py",
    "gate/inventory/mirror.py",
    # The reservation path (being recomposed separately).
    "gate/reserve/buyer_keys.py",
    "gate/reserve/commit.py",
    "gate/reserve/groups.py",
    "gate/reserve/no_redis.py",
    # The waiting room (being renamed and reworked separately).
    "gate/room/console_panel.py",
    "gate/room/gatekeeper.py",
    "gate/room/page.py",
    "gate/room/service.py",
}


def _docstrings(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def is_sql(text: str) -> bool:
    return bool(_KEYWORD.match(text) and _STATEMENT.search(text))


def _text(node: ast.expr) -> str | None:
    """A string literal's text; an f-string's with each placeholder as {}."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_text(v) or "{}" for v in node.values)
    return None


def sql_lines(path: Path) -> list[int]:
    source = path.read_text()
    # Most modules name no statement keyword at all: not parsed.
    if not _ANYWHERE.search(source):
        return []
    return _lines(ast.parse(source, str(path)))


def _lines(tree: ast.AST) -> list[int]:
    skip = _docstrings(tree)
    lines: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant | ast.JoinedStr):
            continue
        text = _text(node)
        if text is not None and id(node) not in skip and is_sql(text):
            lines.add(node.lineno)
    return sorted(lines)


def sql_lines_of(source: str) -> list[int]:
    return _lines(ast.parse(source))


def is_store_module(rel: str) -> bool:
    return rel.startswith("gate/store/") or rel.rsplit("/", 1)[-1] in STORE_NAMES


def holders() -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for path in sorted(GATE.rglob("*.py")):
        lines = sql_lines(path)
        if lines:
            found[path.relative_to(ROOT).as_posix()] = lines
    return found


def test_the_detector_tells_statements_from_prose() -> None:
    assert is_sql("SELECT 1")
    assert is_sql("SELECT id FROM deals WHERE id = %s")
    assert is_sql("INSERT IGNORE INTO outbox (event_id) VALUES (%s)")
    assert is_sql("UPDATE deals SET mode = %s WHERE id = %s")
    assert is_sql("CALL gate_reserve_group(%s, %s)")
    assert is_sql("START TRANSACTION")
    assert sql_lines_of('x = f"SELECT {columns} FROM orders WHERE id = %s"\n') == [1]
    assert not is_sql("DELETE")
    assert not is_sql("DELETE /v1/deals/{id}/queue: the buyer's ticket given up.")
    assert not is_sql("SELECT is not allowed in cluster mode")


def test_sql_lives_in_its_domains_store_module() -> None:
    found = holders()
    strays = {
        f"{rel} (lines {', '.join(map(str, lines))})"
        for rel, lines in found.items()
        if not is_store_module(rel) and rel not in NOT_YET_MOVED
    }
    assert not strays, (
        "SQL outside a store module: move it into the domain's store.py / queries.py /"
        f" repository.py and call it from there: {sorted(strays)}"
    )
    stale = sorted(NOT_YET_MOVED - set(found))
    assert not stale, f"no SQL left in these: take them out of NOT_YET_MOVED: {stale}"
