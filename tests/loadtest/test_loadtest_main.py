"""`python -m loadtest NAME`: one entry point that runs each load test's own `main`."""

from __future__ import annotations

import importlib
import subprocess
import sys

from loadtest.__main__ import COMMANDS
from tests.support import ROOT


def test_every_name_runs_a_module_with_a_main() -> None:
    for name, (module, _) in COMMANDS.items():
        assert callable(getattr(importlib.import_module(module), "main", None)), name


def test_every_experiment_has_a_name() -> None:
    """An experiment moved under loadtest/experiments/ stays runnable by its name."""
    folder = ROOT / "loadtest" / "experiments"
    found = {f"loadtest.experiments.{p.stem}" for p in folder.glob("*.py") if p.stem != "__init__"}
    assert found and found <= {module for module, _ in COMMANDS.values()}


def test_the_list_names_every_command_and_an_unknown_name_exits_2() -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "loadtest"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert listed.returncode == 2
    assert all(f"  {name} " in listed.stdout for name in COMMANDS)
    unknown = subprocess.run(
        [sys.executable, "-m", "loadtest", "nope"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert unknown.returncode == 2
    assert "unknown name 'nope'" in unknown.stderr


def test_a_name_hands_its_arguments_to_the_module() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "loadtest", "verify", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert shown.returncode == 0
    assert "--record" in shown.stdout
