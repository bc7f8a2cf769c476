"""The reservation path stays assembled from parts (gate/reserve/path.py): no class
in gate/reserve/ inherits behaviour (only `typing.Protocol` ports and enums have
bases), no module reaches into another's private names, and the endpoint makes one
call into the path."""

from __future__ import annotations

import ast
from pathlib import Path

import gate

GATE = Path(gate.__file__).parent
RESERVE = GATE / "reserve"
ALLOWED_BASES = {"Protocol", "enum.Enum"}


def _modules(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


def test_no_class_in_the_reservation_path_inherits_behaviour() -> None:
    found = [
        f"{path.name}: {node.name}({', '.join(ast.unparse(b) for b in node.bases)})"
        for path in _modules(RESERVE)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
        and any(ast.unparse(b) not in ALLOWED_BASES for b in node.bases)
    ]
    assert not found, found


def test_no_private_name_of_the_reservation_path_is_used_in_another_module() -> None:
    """`from gate.reserve.x import _name` anywhere in gate/, and `obj._name` on
    anything but `self` or `cls` inside gate/reserve/."""
    found: list[str] = []
    for path in _modules(GATE):
        inside = path.parent == RESERVE
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gate.reserve"):
                found += [f"{path}: imports {a.name}" for a in node.names if a.name[0] == "_"]
            elif (
                inside
                and isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def test_the_endpoint_makes_one_call_into_the_reservation_path() -> None:
    """gate/api/reservations.py names the path once, `take`: the near-caches, the
    queue-mode callback and the coroutine are the path's to choose, in its order."""
    tree = ast.parse((GATE / "api" / "reservations.py").read_text())
    calls = [
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "reservations"
        and ast.unparse(node.value.value).split(".")[-1] == "gate"
    ]
    assert calls == ["take"], calls
