"""The container image and the local stack: the Dockerfile's essentials, the compose
file's services and environment, and a real build where a container engine runs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from gate import __version__
from gate.base.settings import SettingsError, load_settings
from gate.payments.config import load_payment_settings
from gate.payments.sandbox.server import load_config as load_sandbox_config
from gate.payments.signing import decode_secrets
from tests.project.test_wheel import assert_one_held, reserve_one, wait_ready
from tests.support import ROOT, free_port

DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_DEV = ROOT / "docker-compose.dev.yml"
SECRET_NAMES = (
    "GATE_JWT_SECRET",
    "GATE_ADMIN_TOKEN",
    "GATE_WEBHOOK_SECRET",
    "GATE_ADMISSION_SECRET",
)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continuation"
    return out


def stages(text: str) -> list[list[tuple[str, str]]]:
    """The instructions of each stage, each list starting with its FROM (global ARGs
    before the first FROM belong to no stage)."""
    result: list[list[tuple[str, str]]] = []
    for ins in instructions(text):
        if ins[0] == "FROM":
            result.append([ins])
        elif result:
            result[-1].append(ins)
        else:
            assert ins[0] == "ARG", f"{ins[0]} before the first FROM"
    return result


def test_dockerfile_is_multi_stage_slim_non_root_with_healthcheck() -> None:
    text = DOCKERFILE.read_text()
    all_stages = stages(text)
    assert len(all_stages) >= 2, "build and runtime stages"
    args = dict(a.split("=", 1) for w, a in instructions(text) if w == "ARG" and "=" in a)
    for stage in all_stages:
        base = stage[0][1].split()[0]
        base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
        assert "slim" in base or "alpine" in base or "distroless" in base, base
    final = all_stages[-1]
    words = [w for w, _ in final]
    final_args = {w: a for w, a in final}
    # No compilers in the runtime stage: everything it installs comes as wheels.
    assert not any(w == "RUN" and "apt-get install" in a for w, a in final)

    users = [a for w, a in final if w == "USER"]
    assert users, "the runtime stage must switch to a non-root user"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), user
    assert words.index("USER") < words.index("ENTRYPOINT")

    health = final_args.get("HEALTHCHECK", "")
    assert "/healthz" in health and "CMD" in health
    assert "--interval" in health and "--timeout" in health
    assert "8000" in final_args.get("EXPOSE", "")

    entry = json.loads(final_args["ENTRYPOINT"])
    cmd = json.loads(final_args["CMD"])
    assert entry == ["gate"] and cmd[0] == "serve"
    assert "--host" in cmd and cmd[cmd.index("--host") + 1] == "0.0.0.0"

    # The package finds its Lua scripts and migrations itself: no override is set.
    env = " ".join(a for w, a in final if w == "ENV")
    assert "GATE_LUA_DIR" not in env and "GATE_DB_DIR" not in env
    baked = " ".join(a for w, a in instructions(text) if w in ("ENV", "ARG", "LABEL"))
    for name in SECRET_NAMES:
        assert name not in baked, f"{name} must come from the environment, not the image"


def test_dockerfile_builds_the_wheel_and_installs_it_with_the_lock() -> None:
    """The image runs the release's wheel: built in the build stage from the package's
    own files, installed in the runtime stage after the locked dependencies, with no
    index (the lock holds everything the wheel needs)."""
    all_stages = stages(DOCKERFILE.read_text())
    build, final = all_stages[0], all_stages[-1]
    build_runs = " ".join(a for w, a in build if w == "RUN")
    assert "pip wheel --no-deps" in build_runs and "/wheels" in build_runs
    copied = [a for w, a in build if w == "COPY"]
    # The package and its data packages (lua/ and db/ become gate.lua and gate.db).
    for folder in ("gate", "lua", "db"):
        assert any(a.split() == [folder, f"./{folder}"] for a in copied), folder
    assert any("pyproject.toml" in a.split() and "LICENSE" in a.split() for a in copied)
    runs = [a for w, a in final if w == "RUN"]
    lock = next(i for i, a in enumerate(runs) if "-r /tmp/requirements.lock" in a)
    wheel = next(i for i, a in enumerate(runs) if "gate-*.whl" in a)
    assert "pip install --require-hashes" in runs[lock]
    assert lock < wheel and "pip install --no-index" in runs[wheel]
    assert "--no-deps" not in runs[wheel], "pip must find every dependency installed"
    assert ("COPY", "--from=build /wheels /tmp/wheels") in final
    # Nothing of the source tree reaches the runtime stage but the wheel.
    sources = [a.split()[0] for w, a in final if w == "COPY" and not a.startswith("--from")]
    assert sources == ["requirements.lock"], sources


def test_dockerfile_copies_only_what_exists_and_is_not_ignored() -> None:
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv", ".local", ".env"} <= ignored
    for word, args in instructions(DOCKERFILE.read_text()):
        if word != "COPY" or args.startswith("--from"):
            continue
        sources = args.split()[:-1]
        for src in sources:
            assert (ROOT / src).exists(), src
            assert src.rstrip("/") not in ignored, f"{src} is excluded by .dockerignore"


class MissingVariable(Exception):
    """Compose's ${VAR:?message} with VAR unset or empty: `docker compose up` stops."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name
        self.message = message


def _interpolate(value: Any, environ: dict[str, str]) -> str:
    """Compose's ${VAR:-default} / ${VAR:?message} / ${VAR} interpolation."""

    def repl(m: re.Match[str]) -> str:
        expr = m.group(1)
        if ":?" in expr:
            name, _, message = expr.partition(":?")
            if not environ.get(name):
                raise MissingVariable(name, message)
            return environ[name]
        name, _, default = expr.partition(":-")
        return environ.get(name) or default

    return re.sub(r"\$\{([^}]+)\}", repl, str(value))


def compose(path: Path = COMPOSE) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


def default_services(path: Path = COMPOSE) -> dict[str, Any]:
    """The services `docker compose up` starts (those of no profile)."""
    return {n: s for n, s in compose(path)["services"].items() if not s.get("profiles")}


# Database servers and one-shot migrate jobs: the only services that hold the root
# password (profile galera: docs/high-availability.md).
ROOT_HOLDERS = {"migrate", "mariadb", "migrate-galera", "galera-1", "galera-2", "galera-3"}


def service_env(service: dict[str, Any], environ: dict[str, str]) -> dict[str, str]:
    raw = service.get("environment", {})
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) for item in raw)
    return {k: _interpolate(v, environ) for k, v in raw.items()}


def strings(node: Any) -> list[str]:
    """Every string in a parsed compose file (where interpolation applies)."""
    if isinstance(node, dict):
        return [s for v in node.values() for s in strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in strings(v)]
    return [node] if isinstance(node, str) else []


# What docker-compose.yml must be given; none has a default.
PROD_SECRETS = {
    "GATE_JWT_SECRET": "j" * 40,
    "GATE_ADMIN_TOKEN": "a" * 32,
    "GATE_WEBHOOK_SECRET": "whsec_c2VjcmV0LXNlY3JldC1zZWNyZXQ=",
    "GATE_ADMISSION_SECRET": "s" * 40,
    "REDIS_PASSWORD": "r" * 32,
    "MARIADB_ROOT_PASSWORD": "m" * 32,
    "GATE_MYSQL_APP_PASSWORD": "p" * 32,
    "GRAFANA_ADMIN_PASSWORD": "g" * 20,
    "MYSQLD_EXPORTER_PASSWORD": "e" * 24,
}
# The production stack's exporters (the dev stack has none).
EXPORTERS = {"redis_exporter", "mysqld_exporter"}


def test_compose_runs_the_whole_stack() -> None:
    for path, extra in ((COMPOSE, EXPORTERS), (COMPOSE_DEV, {"sandbox"})):
        services = default_services(path)
        expected = {"gate", "migrate", "redis", "mariadb", "prometheus", "grafana"} | extra
        assert set(services) == expected, (path.name, set(services))
        gate, migrate = services["gate"], services["migrate"]
        assert gate["build"] == "." and migrate["build"] == "."
        assert gate["command"][0] == "serve" and "--workers" in gate["command"]
        assert migrate["command"] == ["migrate"]
        # Listens beyond its container's loopback, or nothing else can reach it.
        assert gate["command"][gate["command"].index("--host") + 1] == "0.0.0.0"
        # The gate starts once the schema and its database user exist.
        assert gate["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        for dep in ("redis", "mariadb"):
            assert gate["depends_on"][dep]["condition"] == "service_healthy"
            assert services[dep]["healthcheck"]["test"]
        assert migrate["depends_on"]["mariadb"]["condition"] == "service_healthy"
        assert "noeviction" in services["redis"]["command"]
        if "sandbox" in services:
            sandbox = services["sandbox"]
            assert sandbox["command"][0] == "sandbox" and "healthcheck" in sandbox
        # Files mounted into Prometheus and Grafana exist in the repository.
        for name in ("prometheus", "grafana"):
            for volume in services[name].get("volumes", []):
                source = str(volume).split(":", 1)[0]
                if source.startswith("./"):
                    assert (ROOT / source).exists(), f"{name} mounts missing {source}"
    # The two stacks never share volumes (a dev root password on production data).
    assert compose(COMPOSE_DEV)["name"] != compose(COMPOSE).get("name", ROOT.name)


def test_compose_refuses_to_start_without_each_secret() -> None:
    data = compose()
    text = " ".join(strings(data))
    for name in PROD_SECRETS:
        # Every use of a secret stops the run when it is missing, with a message.
        uses = re.findall(r"\$\{" + name + r"([^}]*)\}", text)
        assert uses, name
        for use in uses:
            assert use.startswith(":?") and len(use) > 3, (name, use)
        given = {k: v for k, v in PROD_SECRETS.items() if k != name}
        with pytest.raises(MissingVariable) as missing:
            for value in strings(data):
                _interpolate(value, given)
        assert missing.value.name == name and missing.value.message
        with pytest.raises(MissingVariable):
            for value in strings(data):
                _interpolate(value, {**given, name: ""})
    # With all of them, everything interpolates.
    for value in strings(data):
        _interpolate(value, PROD_SECRETS)


def test_compose_publishes_only_the_gate_and_runs_in_production() -> None:
    services = compose()["services"]
    published = {name: [str(p) for p in s.get("ports", [])] for name, s in services.items()}
    assert published["gate"] == ["8000:8000"]
    for name in ("prometheus", "grafana"):
        assert published[name] and all(p.startswith("127.0.0.1:") for p in published[name])
    for name in ("redis", "mariadb", "migrate", *EXPORTERS):
        assert published[name] == [], name
    # The dev stack: everything on loopback.
    for name, service in compose(COMPOSE_DEV)["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)

    env = service_env(services["gate"], PROD_SECRETS)
    assert env["GATE_ENV"] == "production"
    settings = load_settings(env)
    assert not settings.is_dev and settings.dev_secrets_used == ()
    assert settings.jwt_secret.reveal() == PROD_SECRETS["GATE_JWT_SECRET"]
    # Payments off until a provider is configured, and then only https with a key.
    assert load_payment_settings(env).provider_url is None
    with pytest.raises(SettingsError, match="GATE_PAYMENT_API_KEY is required"):
        load_payment_settings({**env, "GATE_PAYMENT_PROVIDER_URL": "https://psp.example"})
    # Redis asks for its password, and the gate has it.
    redis_cmd = [_interpolate(c, PROD_SECRETS) for c in services["redis"]["command"]]
    password = redis_cmd[redis_cmd.index("--requirepass") + 1]
    assert password == PROD_SECRETS["REDIS_PASSWORD"]
    assert urlsplit(env["GATE_REDIS_URL"]).password == password
    assert urlsplit(env["GATE_REDIS_URL"]).hostname == "redis"


def test_compose_gate_connects_as_the_app_user_and_only_migrate_as_root() -> None:
    for path, given in ((COMPOSE, PROD_SECRETS), (COMPOSE_DEV, {})):
        services = compose(path)["services"]
        gate_env = service_env(services["gate"], given)
        migrate_env = service_env(services["migrate"], given)
        gate_db = urlsplit(gate_env["GATE_MYSQL_URL"])
        admin_db = urlsplit(migrate_env["GATE_MYSQL_URL"])
        assert gate_db.hostname == "mariadb" and gate_db.path == "/gate"
        assert gate_db.username == migrate_env["GATE_MYSQL_APP_USER"] != "root"
        assert gate_db.password == migrate_env["GATE_MYSQL_APP_PASSWORD"]
        assert admin_db.username == "root" and admin_db.path == "/gate"
        assert admin_db.password == service_env(services["mariadb"], given)["MARIADB_ROOT_PASSWORD"]
        # Only the one-shot migrate job holds the root password.
        for name, service in services.items():
            if name in ROOT_HOLDERS:
                continue
            values = " ".join(service_env(service, given).values())
            assert admin_db.password not in values, name
            assert "mysql://root" not in values, name
        # The app user may not migrate: the gate only checks the schema at start.
        assert gate_env["GATE_AUTO_MIGRATE"] == "0"


def test_compose_exporters_reach_the_servers_with_least_privilege() -> None:
    services = compose()["services"]
    redis = service_env(services["redis_exporter"], PROD_SECRETS)
    assert urlsplit(redis["REDIS_ADDR"]).hostname == "redis"
    assert redis["REDIS_PASSWORD"] == PROD_SECRETS["REDIS_PASSWORD"]
    mysqld = services["mysqld_exporter"]
    flags = dict(flag.split("=", 1) for flag in mysqld["command"])
    assert flags["--mysqld.address"] == "mariadb:3306"
    # Its own user: neither root nor the gate's (which may change the sale's data).
    assert flags["--mysqld.username"] == "exporter"
    password = service_env(mysqld, PROD_SECRETS)["MYSQLD_EXPORTER_PASSWORD"]
    assert password == PROD_SECRETS["MYSQLD_EXPORTER_PASSWORD"]
    # MariaDB creates that user from the init script it mounts, with that password.
    mariadb = services["mariadb"]
    assert service_env(mariadb, PROD_SECRETS)["MYSQLD_EXPORTER_PASSWORD"] == password
    init = next(v for v in mariadb["volumes"] if "/docker-entrypoint-initdb.d" in v)
    script = (ROOT / init.split(":", 1)[0] / "10-exporter-user.sh").read_text()
    assert "'exporter'@'%'" in script and "${MYSQLD_EXPORTER_PASSWORD}" in script
    grants = re.findall(r"^GRANT (.+) ON (\S+) TO", script, re.M)
    assert grants == [("PROCESS, REPLICA MONITOR", "*.*"), ("SELECT", "performance_schema.*")]
    for name in EXPORTERS:
        assert services[name]["depends_on"], name


def test_compose_galera_profile_runs_the_gate_on_three_nodes() -> None:
    services = compose()["services"]
    nodes = ("galera-1", "galera-2", "galera-3")
    assert {n for n, s in services.items() if s.get("profiles") == ["galera"]} == {
        *nodes,
        "migrate-galera",
        "gate-galera",
    }
    gate_env = service_env(services["gate-galera"], PROD_SECRETS)
    target = load_settings(gate_env).mysql
    assert [h for h, _ in target.node_list] == list(nodes) and target.database == "gate"
    assert target.user == "gate_app" and gate_env["GATE_AUTO_MIGRATE"] == "0"
    migrate_env = service_env(services["migrate-galera"], PROD_SECRETS)
    assert load_settings(migrate_env).mysql.node_list == target.node_list
    assert gate_env["GATE_MYSQL_URL"].split("@")[0].endswith(migrate_env["GATE_MYSQL_APP_PASSWORD"])
    # The settings Gate needs of every node, and Synced before anything uses it.
    cnf = (ROOT / "deploy" / "galera" / "gate-galera.cnf").read_text()
    for line in ("wsrep_on", "binlog_format", "innodb_autoinc_lock_mode"):
        assert re.search(rf"^{line}\s*=\s*(ON|ROW|2)$", cnf, re.M), line
    for name in nodes:
        node = services[name]
        assert "--galera_online" in node["healthcheck"]["test"]
        assert any(v.endswith(":/etc/mysql/conf.d/gate-galera.cnf:ro") for v in node["volumes"])
        assert f"--wsrep-node-name={name}" in node["command"]
    # Only galera-1 founds the cluster (empty gcomm:// unless told to join).
    addresses = {n: [c for c in services[n]["command"] if "cluster-address" in c] for n in nodes}
    assert addresses["galera-1"] == ["--wsrep-cluster-address=${GALERA_1_ADDRESS:-gcomm://}"]
    for name in nodes[1:]:
        assert addresses[name] == ["--wsrep-cluster-address=gcomm://galera-1,galera-2,galera-3"]


def test_compose_grafana_and_prometheus_are_locked_down() -> None:
    for path, given in ((COMPOSE, PROD_SECRETS), (COMPOSE_DEV, {})):
        services = compose(path)["services"]
        prometheus = services["prometheus"]["command"]
        assert not any("enable-lifecycle" in str(flag) for flag in prometheus), path.name
        assert not any("enable-admin-api" in str(flag) for flag in prometheus), path.name
        grafana = service_env(services["grafana"], given)
        assert grafana.get("GF_SECURITY_ADMIN_PASSWORD", "admin") != "admin"
        assert grafana.get("GF_USERS_ALLOW_SIGN_UP") == "false"
        if grafana.get("GF_AUTH_ANONYMOUS_ENABLED", "false") == "true":
            # Only in the loopback-bound dev stack, and only to look.
            assert path == COMPOSE_DEV
            assert grafana["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    prod = compose()["services"]["grafana"]["environment"]
    assert str(prod["GF_SECURITY_ADMIN_PASSWORD"]).startswith("${GRAFANA_ADMIN_PASSWORD:?")
    assert prod["GF_AUTH_ANONYMOUS_ENABLED"] == "false"


def test_compose_dev_stack_is_a_working_development_demo() -> None:
    services = compose(COMPOSE_DEV)["services"]
    env = service_env(services["gate"], {})
    assert env["GATE_ENV"] == "dev"
    settings = load_settings(env)
    assert settings.is_dev and set(settings.dev_secrets_used) == set(SECRET_NAMES)
    payments = load_payment_settings(env)
    assert payments.provider_url is not None
    assert urlsplit(payments.provider_url).hostname == "sandbox"
    # The sandbox starts (dev only), accepts the gate's callback URL on its allow-list,
    # signs with the secret the gate verifies with, and wants the key the gate sends.
    sandbox_env = service_env(services["sandbox"], {})
    assert "GATE_WEBHOOK_SECRET" not in sandbox_env
    config = load_sandbox_config(sandbox_env, "0.0.0.0", 8090)
    assert config.signing_keys == decode_secrets(settings.webhook_secrets)
    assert config.api_key == env["GATE_PAYMENT_API_KEY"]
    assert payments.callback_url is not None
    assert config.notify_allow.allows(payments.callback_url)
    assert urlsplit(config.webhook_url).hostname == "gate"
    # The production file has no sandbox, and the sandbox refuses production anyway.
    assert "sandbox" not in compose()["services"]
    with pytest.raises(SettingsError, match="GATE_ENV=dev"):
        load_sandbox_config({**sandbox_env, "GATE_ENV": "production"}, "0.0.0.0", 8090)


def _engine() -> tuple[str | None, str]:
    docker = shutil.which("docker") or shutil.which("podman")
    if docker is None:
        return None, "no container engine installed (docker/podman not found)"
    probe = subprocess.run([docker, "info"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        reason = (probe.stderr or probe.stdout).strip().splitlines()[-1:]
        return None, f"no container engine running ({docker} info: {' '.join(reason)})"
    return docker, ""


IMAGE_TAG = "gate:test-ops"
CONTAINER_SECONDS = 120


@pytest.fixture(scope="module")
def image() -> Iterator[tuple[str, str]]:
    """(engine, tag) of the image built from this checkout; skips, saying why, where
    no container engine runs."""
    docker, why = _engine()
    if docker is None:
        pytest.skip(why)
    build = subprocess.run(
        [docker, "build", "-t", IMAGE_TAG, str(ROOT)], capture_output=True, text=True, timeout=1200
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    try:
        yield docker, IMAGE_TAG
    finally:
        subprocess.run([docker, "image", "rm", "-f", IMAGE_TAG], capture_output=True, timeout=120)


def _in_image(image: tuple[str, str], *args: str, env: Mapping[str, str] | None = None) -> Any:
    """`docker run --rm` of the image on the host's network (the test Redis and
    MariaDB on loopback), with the GATE_* variables of `env`."""
    docker, tag = image
    flags = [f"--env={k}={v}" for k, v in (env or {}).items() if k.startswith("GATE_")]
    return subprocess.run(
        [docker, "run", "--rm", "--network=host", *flags, tag, *args],
        capture_output=True,
        text=True,
        timeout=CONTAINER_SECONDS,
    )


@pytest.mark.slow
def test_image_builds_and_runs_as_non_root(image: tuple[str, str]) -> None:
    docker, tag = image
    user = subprocess.run(
        [docker, "image", "inspect", "-f", "{{.Config.User}}", tag],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert user.stdout.strip().split(":")[0] not in ("", "root", "0")
    helped = _in_image(image, "--help")
    assert helped.returncode == 0 and "serve" in helped.stdout
    version = _in_image(image, "--version")
    assert version.stdout.strip() == f"gate {__version__}", version


@pytest.mark.slow
def test_image_migrates_serves_a_reservation_and_checks(
    image: tuple[str, str], request: pytest.FixtureRequest
) -> None:
    """The image against the suite's Redis and database, as a gate beside the suite's."""
    env: dict[str, str] = request.getfixturevalue("env")
    request.getfixturevalue("prepared")
    current = _in_image(image, "migrate", env=env)
    assert current.returncode == 0 and "schema is current" in current.stdout, current
    docker, tag = image
    port = free_port()
    name = f"gate-test-ops-{port}"
    flags = [f"--env={k}={v}" for k, v in env.items() if k.startswith("GATE_")]
    started = subprocess.run(
        [docker, "run", "-d", f"--name={name}", "--network=host", *flags, tag,
         "serve", "--host", "127.0.0.1", "--port", str(port)],
        capture_output=True, text=True, timeout=CONTAINER_SECONDS,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr

    def running() -> bool:
        state = subprocess.run(
            [docker, "inspect", "-f", "{{.State.Running}}", name],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        return state.stdout.strip() == "true"

    def logs() -> str:
        out = subprocess.run([docker, "logs", name], capture_output=True, text=True, timeout=60)
        return out.stdout + out.stderr

    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, running, logs)
        deal_id = reserve_one(url, "image-reservation")
        assert_one_held(_in_image(image, "check", "--deal", str(deal_id), "--json", env=env))
        stopped = subprocess.run(
            [docker, "stop", "--time=30", name], capture_output=True, timeout=CONTAINER_SECONDS
        )
        assert stopped.returncode == 0
        code = subprocess.run(
            [docker, "inspect", "-f", "{{.State.ExitCode}}", name],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        # SIGTERM handled: 0, or 143 where the signal is re-raised after the shutdown.
        assert code.stdout.strip() in ("0", "143"), logs()[-3000:]
    finally:
        subprocess.run([docker, "rm", "-f", name], capture_output=True, timeout=CONTAINER_SECONDS)
