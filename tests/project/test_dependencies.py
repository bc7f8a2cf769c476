"""Dependencies: everything the code imports is declared, the lock files pin what
pyproject.toml allows (with hashes), and the suite runs on exactly the locked
versions (docs/dependencies.md).

Regenerating the lock needs the network; `scripts/lock --check` does that. These
checks need nothing but the files and the running environment.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PIN = re.compile(r"^([A-Za-z0-9_.-]+)==([^\s;]+)\s*(?:;\s*([^\\]+?))?\s*\\?$")


def requirements(group: str) -> dict[str, Requirement]:
    """The requirements of [project.dependencies] ('') or of an extra, by name."""
    project = PYPROJECT["project"]
    raw = project["dependencies"] if group == "" else project["optional-dependencies"][group]
    found = {}
    for line in raw:
        req = Requirement(line)
        if canonicalize_name(req.name) != "gate":  # gate[loadtest] inside dev
            found[canonicalize_name(req.name)] = req
    return found


def locked(path: Path) -> dict[str, tuple[str, str | None]]:
    """name -> (version, marker) of a lock file; every pin must carry hashes."""
    pins: dict[str, tuple[str, str | None]] = {}
    lines = path.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        match = PIN.match(line)
        if not match:
            continue
        assert "--hash=sha256:" in lines[i + 1], f"{path.name}: {match[1]} has no hash"
        pins[canonicalize_name(match[1])] = (match[2], match[3])
    assert pins, path
    return pins


DEV_LOCK = locked(ROOT / "requirements-dev.lock")
RUNTIME_LOCK = locked(ROOT / "requirements.lock")


def test_lock_files_say_how_to_regenerate_them() -> None:
    for name in ("requirements-dev.lock", "requirements.lock"):
        head = (ROOT / name).read_text(encoding="utf-8").splitlines()[:6]
        assert any("scripts/lock" in line for line in head), name


@pytest.mark.parametrize("group", ["", "dev", "loadtest", "otel"])
def test_every_declared_requirement_is_pinned_within_its_range(group: str) -> None:
    for name, req in requirements(group).items():
        assert name in DEV_LOCK, f"{name} is declared but not locked: run scripts/lock"
        version = DEV_LOCK[name][0]
        assert req.specifier.contains(version), f"{name}=={version} is outside {req.specifier}"
        assert req.specifier.filter([version]), name
        assert any(s.operator == "<" for s in req.specifier), f"{name}: no cap in pyproject.toml"


def test_runtime_lock_is_the_dev_lock_without_the_tools() -> None:
    for name, (version, _) in RUNTIME_LOCK.items():
        assert DEV_LOCK[name][0] == version, f"{name}: {version} vs {DEV_LOCK[name][0]}"
    # The image carries the otel extra (OTEL_* alone turns traces on, docs/tracing.md).
    for name in [*requirements(""), *requirements("otel")]:
        assert name in RUNTIME_LOCK, f"{name} missing from requirements.lock"
    for tool in ("pytest", "ruff", "mypy", "locust", "schemathesis", "python-ulid"):
        assert tool not in RUNTIME_LOCK, f"{tool} belongs to the dev lock only"


def _imports(paths: list[Path]) -> set[str]:
    found: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    local = {"gate", "tests", "loadtest"}
    return {m for m in found if m not in sys.stdlib_module_names and m not in local}


def _distributions(modules: set[str]) -> dict[str, set[str]]:
    """The distributions that may provide each module: one, or several for a
    namespace package (`opentelemetry`: the api, the sdk, the proto …)."""
    owners = importlib.metadata.packages_distributions()
    out = {}
    for module in modules:
        # Not installed (the `bench` extra's matplotlib): its distribution's own name.
        out[module] = {canonicalize_name(d) for d in owners.get(module, [module])}
    return out


@pytest.mark.parametrize(
    "tree, groups",
    [
        ("gate", ["", "otel"]),
        ("loadtest", ["", "loadtest", "bench", "otel"]),
        ("tests", ["", "loadtest", "dev", "otel"]),
    ],
)
def test_every_import_is_declared(tree: str, groups: list[str]) -> None:
    """What the code imports is declared directly, not left to arrive with another
    package (hiredis, PyMySQL …); load-test-only packages are the `loadtest` extra."""
    declared = set().union(*(requirements(g) for g in groups))
    for module, dists in _distributions(_imports(sorted((ROOT / tree).rglob("*.py")))).items():
        assert dists & declared, f"{tree}/ imports {module} ({dists}): declare it in {groups}"


def test_the_server_s_loop_and_parser_are_declared() -> None:
    # Named as strings to uvicorn (gate/cli/__init__.py run_server), not imported.
    assert {"uvloop", "httptools"} <= set(requirements(""))


@pytest.mark.skipif(
    os.environ.get("GATE_DEPS") == "newest", reason="scripts/test --upgrade runs unlocked"
)
def test_the_suite_runs_on_the_locked_versions() -> None:
    wrong = {}
    for name, (version, marker) in DEV_LOCK.items():
        if marker and not Marker(marker).evaluate():
            continue
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            wrong[name] = "not installed"
            continue
        if canonicalize_name(installed) != canonicalize_name(version):
            wrong[name] = f"{installed} installed, {version} locked"
    assert not wrong, f"not the locked versions (run scripts/test, or ensure_venv): {wrong}"
