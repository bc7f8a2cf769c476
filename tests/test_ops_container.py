"""The container image and the local stack: the Dockerfile's essentials, the compose
file's services and environment, and a real build where a container engine runs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from gate.settings import load_settings
from tests.support import ROOT

DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
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
    assert any(w == "COPY" and a.startswith("--from=build") for w, a in final)
    # Compilers and pip caches stay in the build stage.
    assert not any(w == "RUN" and ("apt-get install" in a or "pip install" in a) for w, a in final)

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

    # Lua scripts and migrations ship with the image and the gate is told where.
    env = " ".join(a for w, a in final if w == "ENV")
    assert "GATE_LUA_DIR=/app/lua" in env and "GATE_DB_DIR=/app/db" in env
    baked = " ".join(a for w, a in instructions(text) if w in ("ENV", "ARG", "LABEL"))
    for name in SECRET_NAMES:
        assert name not in baked, f"{name} must come from the environment, not the image"


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


def _interpolate(value: Any, environ: dict[str, str]) -> str:
    """Compose's ${VAR:-default} / ${VAR} interpolation, enough for this file."""

    def repl(m: re.Match[str]) -> str:
        name, _, default = m.group(1).partition(":-")
        return environ.get(name) or default

    return re.sub(r"\$\{([^}]+)\}", repl, str(value))


def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def service_env(service: dict[str, Any], environ: dict[str, str]) -> dict[str, str]:
    raw = service.get("environment", {})
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) for item in raw)
    return {k: _interpolate(v, environ) for k, v in raw.items()}


def test_compose_runs_the_whole_local_stack() -> None:
    data = compose()
    services = data["services"]
    assert {"gate", "sandbox", "redis", "mariadb", "prometheus"} <= set(services)

    gate, sandbox = services["gate"], services["sandbox"]
    assert gate["build"] == "." and sandbox["build"] == "."
    assert gate["command"][0] == "serve" and "--workers" in gate["command"]
    assert sandbox["command"][0] == "sandbox"
    # Both listen beyond their container's loopback, or nothing else can reach them.
    for service in (gate, sandbox):
        command = service["command"]
        assert command[command.index("--host") + 1] == "0.0.0.0", command
    assert any(str(p).endswith(":8000") for p in gate["ports"])

    # The gate waits for healthy dependencies, and each dependency says when it is.
    for dep in ("redis", "mariadb"):
        assert gate["depends_on"][dep]["condition"] == "service_healthy"
        assert services[dep]["healthcheck"]["test"]
    assert "noeviction" in services["redis"]["command"]
    assert "healthcheck" in sandbox

    # Files mounted into Prometheus and Grafana exist in the repository.
    for name in ("prometheus", "grafana"):
        for volume in services.get(name, {}).get("volumes", []):
            source = str(volume).split(":", 1)[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"


def test_compose_gives_the_gate_a_valid_environment() -> None:
    services = compose()["services"]
    env = service_env(services["gate"], {})
    for name in ("GATE_ENV", "GATE_REDIS_URL", "GATE_MYSQL_URL", *SECRET_NAMES):
        assert name in env, name
    assert urlsplit(env["GATE_REDIS_URL"]).hostname == "redis"
    mysql = urlsplit(env["GATE_MYSQL_URL"])
    assert mysql.hostname == "mariadb" and mysql.path == "/gate"
    mariadb_env = service_env(services["mariadb"], {})
    assert mysql.password == mariadb_env["MARIADB_ROOT_PASSWORD"]
    # The defaults start in dev mode, which the gate accepts (and says so) ...
    settings = load_settings(env)
    assert settings.is_dev and set(settings.dev_secrets_used) == set(SECRET_NAMES)
    # ... and real secrets given to compose reach the gate, with production checks.
    given = {
        "GATE_ENV": "production",
        "GATE_JWT_SECRET": "j" * 40,
        "GATE_ADMIN_TOKEN": "a" * 20,
        "GATE_WEBHOOK_SECRET": "whsec_c2VjcmV0LXNlY3JldC1zZWNyZXQ=",
        "GATE_ADMISSION_SECRET": "r" * 40,
    }
    prod = load_settings(service_env(services["gate"], given))
    assert not prod.is_dev and prod.jwt_secret.reveal() == "j" * 40
    # The gate and the sandbox sign and verify with the same secret.
    sandbox_env = service_env(services["sandbox"], given)
    assert sandbox_env["GATE_WEBHOOK_SECRET"] == given["GATE_WEBHOOK_SECRET"]
    assert urlsplit(sandbox_env["GATE_SANDBOX_WEBHOOK_URL"]).hostname == "gate"
    # Several workers share the metric files in a directory that starts empty.
    assert env["PROMETHEUS_MULTIPROC_DIR"] in " ".join(services["gate"]["tmpfs"])


def _engine() -> tuple[str | None, str]:
    docker = shutil.which("docker") or shutil.which("podman")
    if docker is None:
        return None, "no container engine installed (docker/podman not found)"
    probe = subprocess.run([docker, "info"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        reason = (probe.stderr or probe.stdout).strip().splitlines()[-1:]
        return None, f"no container engine running ({docker} info: {' '.join(reason)})"
    return docker, ""


@pytest.mark.slow
def test_image_builds_and_runs_as_non_root() -> None:
    docker, why = _engine()
    if docker is None:
        pytest.skip(why)
    tag = "gate:test-ops"
    build = subprocess.run(
        [docker, "build", "-t", tag, str(ROOT)], capture_output=True, text=True, timeout=1200
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    try:
        user = subprocess.run(
            [docker, "image", "inspect", "-f", "{{.Config.User}}", tag],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert user.stdout.strip().split(":")[0] not in ("", "root", "0")
        helped = subprocess.run(
            [docker, "run", "--rm", tag, "--help"], capture_output=True, text=True, timeout=120
        )
        assert helped.returncode == 0 and "serve" in helped.stdout
    finally:
        subprocess.run([docker, "image", "rm", "-f", tag], capture_output=True, timeout=120)
