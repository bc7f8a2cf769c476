"""The package layering of gate/, read from the code's own imports (no import is run).

    areas       expiry  payments  room  queuemode  console   (never each other)
    cli         the `gate` command
    api         the HTTP application and operations
    runtime     the running gate (gate/runtime.py)
    extensions  how an area plugs in (gate/extensions.py)
    reserve     the reservation path and the ports areas plug into
    inventory   deals, mirror, orders, checks, repair, advice, resync, janitor
    web         edge, guard, HTTP helpers, OpenAPI, docs page, auth
    store       MariaDB, Redis/RESP, scripts, keys, migrations, leases
    base        settings, errors, metrics, logs, clock, codes

A module may import its own package and any package of a lower layer, never one of
its own layer or above, and no modules import each other in a circle. Every import
counts, those under `if TYPE_CHECKING:` and inside functions too: a type named
across the layers ties the packages as much as a call does. Only what importlib loads
by name (the areas listed in gate/extensions.py AREAS) is not an import: that is how
the core reaches the areas without naming them.
"""

from __future__ import annotations

import ast
import shutil
from collections.abc import Iterable
from pathlib import Path

from tests.support import ROOT

# Bottom to top: the one table of which package may import which.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("base",),
    ("store",),
    ("web",),
    ("inventory",),
    ("reserve",),
    ("extensions",),
    ("runtime",),
    ("api",),
    ("cli",),
    ("expiry", "payments", "room", "queuemode", "webhooks", "console"),
)
# gate/__init__.py holds the version only: any module may read it.
ROOT_MODULE = "gate"
MODULE_LINES_MAX = 800

Graph = dict[str, set[str]]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(root: Path) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _imported(node: ast.AST, name: str, is_package: bool, known: Iterable[str]) -> set[str]:
    """The gate modules one import statement names."""
    known = set(known)
    found: set[str] = set()
    if isinstance(node, ast.Import):
        found = {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            module = ".".join([*base, *([node.module] if node.module else [])])
        else:
            module = node.module or ""
        # `from gate.room import tokens` names the submodule; the package itself only
        # when a name is taken from it.
        subs = {f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in known}
        found = subs if len(subs) == len(node.names) else {module, *subs}
    return {m for m in found if m in known}


def import_graph(root: Path) -> Graph:
    """Module -> the gate modules it imports, for every module under `root` (gate/)."""
    modules = _modules(root)
    graph: Graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges |= _imported(node, name, path.name == "__init__.py", modules)
        edges.discard(name)
        graph[name] = edges
    return graph


def unit(module: str) -> str:
    """The package (or top-level module) that layering places: gate.inventory.deals -> inventory."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT_MODULE


def layer_of(name: str) -> int | None:
    for index, layer in enumerate(LAYERS):
        if name in layer:
            return index
    return None


def violations(graph: Graph) -> list[str]:
    """Each import that runs to its own layer's other package or above, and each
    package no layer places."""
    found: list[str] = []
    for importer, imported in sorted(graph.items()):
        src = unit(importer)
        if src == ROOT_MODULE:
            continue
        src_layer = layer_of(src)
        if src_layer is None:
            found.append(f"{importer}: package {src!r} is in no layer (see LAYERS)")
            continue
        for target in sorted(imported):
            dst = unit(target)
            if dst in (src, ROOT_MODULE):
                continue
            dst_layer = layer_of(dst)
            if dst_layer is None or dst_layer >= src_layer:
                found.append(f"{importer} -> {target}: {src} may not import {dst}")
    return found


def circles(graph: Graph) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_package_of_gate_has_a_layer() -> None:
    units = {unit(m) for m in _modules(ROOT / "gate")} - {ROOT_MODULE}
    placed = {name for layer in LAYERS for name in layer}
    assert units - placed == set()
    assert placed - units == set(), "a layer names a package that does not exist"


def test_no_import_runs_against_the_layering() -> None:
    assert violations(import_graph(ROOT / "gate")) == []


def test_no_modules_import_each_other_in_a_circle() -> None:
    assert circles(import_graph(ROOT / "gate")) == []


def test_an_upward_import_added_to_a_copy_is_caught(tmp_path: Path) -> None:
    copy = tmp_path / "gate"
    shutil.copytree(ROOT / "gate", copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert violations(import_graph(copy)) == []
    clock = copy / "base" / "clock.py"
    clock.write_text(clock.read_text() + "\nfrom gate.api import app  # noqa\n")
    assert violations(import_graph(copy)) == [
        "gate.base.clock -> gate.api.app: base may not import api"
    ]


def test_an_import_between_two_areas_is_caught() -> None:
    graph: Graph = {
        "gate.room.service": {"gate.queuemode.service"},
        "gate.queuemode.service": set(),
    }
    assert violations(graph) == [
        "gate.room.service -> gate.queuemode.service: room may not import queuemode"
    ]


def test_a_circle_is_caught_even_inside_one_package() -> None:
    graph: Graph = {
        "gate.cli": {"gate.cli.deals"},
        "gate.cli.deals": {"gate.cli"},
        "gate.base.clock": set(),
    }
    assert violations(graph) == []
    assert circles(graph) == [["gate.cli", "gate.cli.deals"]]


def test_no_module_of_gate_is_over_800_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in (ROOT / "gate").rglob("*.py")
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MODULE_LINES_MAX
    }
    assert long == {}
