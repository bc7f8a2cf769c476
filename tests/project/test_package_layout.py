"""The design card's layout: lua/ and db/ at the top of the checkout, shipped inside
the package as gate.lua and gate.db.

    pyproject.toml [tool.setuptools]  packages: every package of gate/ and the two
                                      data packages, named (a `find` cannot name
                                      packages that live outside gate/)
                   package-dir        gate.lua -> lua/, gate.db -> db/,
                                      gate.db.routines -> db/routines/
    importlib.resources               finds gate.lua and gate.db in the checkout

The wheel built from these files is tests/project/test_wheel.py's.
"""

from __future__ import annotations

import importlib.resources
import tomllib
from pathlib import Path

from gate.store.migrate import DB_DIR
from gate.store.scripts import LUA_DIR
from tests.support import ROOT

SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["tool"]["setuptools"]
DATA_PACKAGES = {"gate.lua": "lua", "gate.db": "db", "gate.db.routines": "db/routines"}


def test_pyproject_names_every_package_and_maps_lua_and_db() -> None:
    code = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "gate").rglob("__init__.py")
    }
    assert set(SETUPTOOLS["packages"]) == code | set(DATA_PACKAGES), (
        "pyproject.toml [tool.setuptools] packages: add "
        f"{sorted(code - set(SETUPTOOLS['packages']))},"
        f" drop {sorted(set(SETUPTOOLS['packages']) - code - set(DATA_PACKAGES))}"
    )
    assert SETUPTOOLS["package-dir"] == DATA_PACKAGES
    for folder in DATA_PACKAGES.values():
        # An editable install maps a package only with its __init__.py.
        assert (ROOT / folder / "__init__.py").is_file(), folder
    assert not (ROOT / "gate" / "lua").exists() and not (ROOT / "gate" / "db").exists()


def test_the_checkout_finds_its_scripts_and_migrations_as_package_data() -> None:
    assert Path(str(importlib.resources.files("gate.lua"))) == ROOT / "lua" == LUA_DIR
    assert Path(str(importlib.resources.files("gate.db"))) == ROOT / "db" == DB_DIR
    assert (LUA_DIR / "admit.lua").is_file()
    assert (DB_DIR / "001_schema.sql").is_file() and (DB_DIR / "routines").is_dir()
