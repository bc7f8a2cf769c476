"""Python 3.11.0-3.11.2's asyncio.timeout / timeout_at can leak a CancelledError
(Debian 12 ships 3.11.2): gate code takes its deadlines from gate/base/timeouts.py."""

from __future__ import annotations

import ast
from pathlib import Path

GATE = Path(__file__).resolve().parents[2] / "gate"


def test_no_module_of_gate_uses_asyncio_timeout() -> None:
    found = []
    for path in sorted(GATE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("timeout", "timeout_at")
                and isinstance(node.value, ast.Name)
                and node.value.id == "asyncio"
            ):
                found.append(f"{path.relative_to(GATE.parent)}:{node.lineno}")
    assert found == []
