"""The package as an operator gets it: the sdist and the wheel built from the
project's own files, the wheel installed into a fresh virtualenv outside the checkout
with the locked dependencies, and the installed `gate` run from a directory of its own.

    copy of pyproject.toml, README.md, LICENSE, CHANGELOG.md, MANIFEST.in, gate/, lua/, db/
      ──build_sdist──> gate-X.Y.Z.tar.gz ──unpacked, build_wheel──> gate-X.Y.Z-py3-none-any.whl
      (setuptools' PEP 517 hooks in a virtualenv of their own, as `python -m build` runs them)
    fresh venv: pip install --require-hashes -r requirements.lock
                pip install --no-index <wheel>          (every dependency already there)
    cwd = an empty directory, no GATE_LUA_DIR / GATE_DB_DIR, no PYTHONPATH:
      gate --version
      gate migrate          a fresh database (the wheel's SQL builds the whole schema),
                            then the suite's (schema current: the same files)
      gate serve            the suite's Redis and database, a port of its own
      a deal through the admin API, one reservation with a buyer token
      gate check --deal     the invariants hold, the hold is counted

pip's cache makes the second run quick; the first downloads the locked wheels.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pymysql
import pytest

from gate import __version__
from gate.base.settings import load_settings
from gate.store.db import notes_off_blocking
from tests.support import ROOT, Client, create_deal, free_port, reserve

pytestmark = pytest.mark.slow

# What the sdist is built from: the package and the files pyproject.toml names.
SOURCES = (
    "pyproject.toml",
    "README.md",
    "LICENSE",
    "CHANGELOG.md",
    "MANIFEST.in",
    "gate",
    "lua",
    "db",
)
PIP_SECONDS = 900
# A PEP 517 hook of setuptools, run in the source directory; prints the file it wrote.
BUILD = "import sys; from setuptools import build_meta as b; print(b.{hook}(sys.argv[1]))"
COMMAND_SECONDS = 120
READY_SECONDS = 60


def _run(args: list[str], cwd: Path) -> str:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=PIP_SECONDS)
    assert done.returncode == 0, f"{args}: {done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done.stdout


def _data_files(wheel: bool) -> set[str]:
    """The package's Lua scripts, SQL files and the buyer page's files, as paths inside
    the sdist (lua/, db/ as in the checkout) or the wheel (inside gate/: gate.lua,
    gate.db, pyproject.toml package-dir)."""
    found = {
        p.relative_to(ROOT).as_posix()
        for folder in ("lua", "db", "gate/room/static")
        for p in (ROOT / folder).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert "lua/admit.lua" in found and "db/001_schema.sql" in found
    assert "db/routines/__init__.py" in found and "db/superseded.txt" in found
    assert "gate/room/static/index.html" in found
    if wheel:
        found = {n if n.startswith("gate/") else f"gate/{n}" for n in found}
    return found


@dataclass(frozen=True)
class Built:
    sdist: Path
    wheel: Path


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    work = tmp_path_factory.mktemp("build")
    src = work / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    # The build backend pyproject.toml asks for, in a virtualenv of its own; the sdist,
    # then the wheel from the unpacked sdist, as `python -m build` makes them.
    tools = work / "tools"
    python = str(tools / "bin/python")
    _run([sys.executable, "-m", "venv", str(tools)], work)
    _run([python, "-m", "pip", "install", "-q", "--no-compile", "setuptools>=77"], work)
    dist = work / "dist"
    name = _run([python, "-c", BUILD.format(hook="build_sdist"), str(dist)], src).split()[-1]
    sdist = dist / name
    with tarfile.open(sdist) as tar:
        # filter= arrived in 3.11.4; Debian 12's python3 is 3.11.2 (our own sdist).
        if hasattr(tarfile, "data_filter"):
            tar.extractall(work / "unpacked", filter="data")
        else:
            tar.extractall(work / "unpacked")
    unpacked = work / "unpacked" / name.removesuffix(".tar.gz")
    name = _run([python, "-c", BUILD.format(hook="build_wheel"), str(dist)], unpacked).split()[-1]
    wheel = dist / name
    return Built(sdist, wheel)


def test_sdist_and_wheel_carry_the_lua_scripts_sql_and_license(built: Built) -> None:
    assert built.sdist.name == f"gate-{__version__}.tar.gz"
    assert built.wheel.name == f"gate-{__version__}-py3-none-any.whl"
    prefix = f"gate-{__version__}/"
    with tarfile.open(built.sdist) as tar:
        in_sdist = {n.removeprefix(prefix) for n in tar.getnames()}
    with zipfile.ZipFile(built.wheel) as whl:
        in_wheel = set(whl.namelist())
        metadata = whl.read(f"gate-{__version__}.dist-info/METADATA").decode()
    assert _data_files(wheel=False) <= in_sdist
    assert _data_files(wheel=True) <= in_wheel
    # Every module of the checkout's gate/ is in the wheel (pyproject.toml names each package).
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "gate").rglob("*.py")}
    assert modules <= in_wheel, sorted(modules - in_wheel)
    assert {"LICENSE", "CHANGELOG.md"} <= in_sdist
    assert f"gate-{__version__}.dist-info/licenses/LICENSE" in in_wheel
    assert f"Version: {__version__}" in metadata and "License-Expression: MIT" in metadata
    # The load tests and the test suite are checkout-only tools.
    assert not any(n.startswith(("loadtest/", "tests/", "lua/", "db/")) for n in in_wheel)


@pytest.fixture(scope="module")
def installed(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv with the locked dependencies and the wheel; its bin/."""
    venv = tmp_path_factory.mktemp("venv") / "gate"
    _run([sys.executable, "-m", "venv", str(venv)], venv.parent)
    # --no-compile: no bytecode for the whole dependency tree (it is written on import).
    pip = [str(venv / "bin/python"), "-m", "pip", "install", "-q", "--no-compile"]
    _run([*pip, "--require-hashes", "-r", str(ROOT / "requirements.lock")], venv.parent)
    # No index: the lock must already hold everything the wheel depends on.
    _run([*pip, "--no-index", str(built.wheel)], venv.parent)
    return venv / "bin"


def _outside_env(env: dict[str, str], **changes: str) -> dict[str, str]:
    out = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    assert "GATE_LUA_DIR" not in out and "GATE_DB_DIR" not in out
    return {**out, **changes}


def _gate(
    bin_dir: Path, cwd: Path, env: dict[str, str], *args: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(bin_dir / "gate"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=COMMAND_SECONDS,
    )


def _drop_database(env: dict[str, str]) -> None:
    target = load_settings(env).mysql
    host, port = target.node_list[0]
    conn = pymysql.connect(
        host=host, port=port, user=target.user, password=target.password.reveal()
    )
    try:
        with conn.cursor() as cur:
            notes_off_blocking(cur)
            cur.execute(f"DROP DATABASE IF EXISTS `{target.database}`")
    finally:
        conn.close()


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """An empty working directory: nothing of the checkout on the path."""
    cwd = tmp_path / "run"
    cwd.mkdir()
    return cwd


def test_installed_wheel_runs_from_anywhere(
    installed: Path, outside: Path, env: dict[str, str]
) -> None:
    run_env = _outside_env(env)
    version = _gate(installed, outside, run_env, "--version")
    assert version.returncode == 0 and version.stdout.strip() == f"gate {__version__}"
    where = subprocess.run(
        [
            str(installed / "python"),
            "-c",
            "import gate.store.scripts as s, gate.store.migrate as m;"
            " print(s.lua_dir()); print(m.db_dir())",
        ],
        cwd=outside,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=COMMAND_SECONDS,
    )
    site = installed.parent / "lib"
    lua, sql = (Path(line) for line in where.stdout.split())
    assert lua.is_relative_to(site) and (lua / "admit.lua").is_file(), where
    assert sql.is_relative_to(site) and (sql / "routines").is_dir(), where


def test_installed_wheel_migrates_a_fresh_database(
    installed: Path, outside: Path, env: dict[str, str]
) -> None:
    url = env["GATE_MYSQL_URL"]
    fresh = _outside_env(env, GATE_MYSQL_URL=f"{url}_wheel")
    _drop_database(fresh)
    try:
        first = _gate(installed, outside, fresh, "migrate")
        assert first.returncode == 0, first.stderr
        assert "001_schema" in first.stdout and "routine gate_reserve" in first.stdout
        again = _gate(installed, outside, fresh, "migrate")
        assert again.returncode == 0 and "schema is current" in again.stdout, again
    finally:
        _drop_database(fresh)


def wait_ready(url: str, alive: Callable[[], bool], log: Callable[[], str]) -> None:
    """Until the gate at `url` answers /readyz 200; fails with its log if it exits."""
    deadline = time.monotonic() + READY_SECONDS
    while time.monotonic() < deadline:
        assert alive(), f"gate exited: {log()[-3000:]}"
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=1.0) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            time.sleep(0.1)
    raise AssertionError(f"gate not ready: {log()[-3000:]}")


STOCK = 5


def reserve_one(url: str, key_prefix: str) -> int:
    """A deal of STOCK units through the admin API, one unit reserved with a buyer
    token (201); the deal's id."""

    async def go() -> tuple[int, int, Any]:
        client = Client(url)
        try:
            deal_id = await create_deal(client, stock=STOCK)
            resp = await reserve(client, deal_id, user_id=4242, key=f"{key_prefix}-{deal_id}")
            return deal_id, resp.status_code, resp.json()
        finally:
            await client.close()

    deal_id, status, body = asyncio.run(go())
    assert status == 201, body
    assert body["deal_id"] == deal_id and body["quantity"] == 1
    assert body["status"] == "PENDING_PAYMENT"
    return deal_id


def assert_one_held(check: subprocess.CompletedProcess[str]) -> None:
    """`gate check --deal ID --json` of reserve_one's deal: invariants hold, one held."""
    assert check.returncode == 0, check.stdout + check.stderr
    report = json.loads(check.stdout)
    assert report["ok"] is True
    (deal,) = report["deals"]
    assert deal["totals"] == {"total": STOCK, "available": STOCK - 1, "held": 1, "sold": 0}
    assert deal["redis"]["loaded"] and deal["redis"]["available"] == STOCK - 1, deal


class Served:
    def __init__(self, bin_dir: Path, cwd: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = cwd / "serve.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [str(bin_dir / "gate"), "serve", "--port", str(self.port)],
                cwd=cwd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return int(self.proc.returncode)


@pytest.fixture
def served(installed: Path, outside: Path, env: dict[str, str], prepared: None) -> Iterator[Served]:
    """The installed `gate serve` on the suite's Redis and database (a gate beside the
    suite's own, as several gate hosts share them)."""
    gate = Served(installed, outside, _outside_env(env))
    try:
        yield gate
    finally:
        gate.stop()


def test_installed_wheel_serves_a_reservation_and_checks(
    installed: Path, outside: Path, env: dict[str, str], served: Served
) -> None:
    run_env = _outside_env(env)
    # The suite's database was migrated from the checkout: the wheel's files are the same.
    current = _gate(installed, outside, run_env, "migrate")
    assert current.returncode == 0 and "schema is current" in current.stdout, current
    wait_ready(served.url, lambda: served.proc.poll() is None, served.output)
    deal_id = reserve_one(served.url, "wheel-reservation")
    assert_one_held(_gate(installed, outside, run_env, "check", "--deal", str(deal_id), "--json"))
    # Stopped by SIGTERM, gracefully: not killed (one worker may end by the signal
    # uvicorn re-raises after its shutdown, hence -SIGTERM as well as 0).
    assert served.stop() in (0, -signal.SIGTERM), served.output()[-3000:]
