"""Placeholders are not secrets: outside GATE_ENV=dev a secret that starts with
CHANGE-ME (any case), or equals a value the repository's examples ship, stops
start-up (exit 2) naming the variable, never the value. The examples are read from
the repository's files, so a value added to one later is caught here unless
gate/base/published.py refuses it too."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import yaml

from gate.base.published import EXAMPLE_VALUES, published_reason
from gate.base.settings import SECRET_NAMES, SettingsError, load_settings
from tests.support import ROOT, serve_once

EXAMPLE_SECRETS = ROOT / "deploy" / "kubernetes" / "overlays" / "example" / "secrets.example.yaml"
# The secrets that are URLs: their password is the secret part.
URL_SECRETS = ("GATE_MYSQL_URL", "GATE_REDIS_URL")
# `NAME: value`, `NAME=value`, `-e NAME=value`, `export NAME=value`; quoted or bare;
# not a shell expansion (${NAME:-default}).
_ASSIGNMENT = re.compile(
    r"(?<![{$\w])(GATE_[A-Z0-9_]+)\s*([:=])\s*(?:\"([^\"]*)\"|'([^']*)'|([^\s\"'`|,;)]+))"
)
# What stands for "put yours here" in a doc, not a value: interpolations, ellipses,
# <angle brackets>, shell variables.
_NOT_A_VALUE = re.compile(r"\$|…|\.\.\.|<|>|^\*+$")


def example_files(root: Path = ROOT) -> Iterator[Path]:
    """Every file of the repository that shows a deployment's settings."""
    yield from sorted((root / "deploy").rglob("*.y*ml"))
    yield from sorted((root / "deploy").glob("*.example"))
    yield from sorted(root.glob("docker-compose*.yml"))
    yield from sorted(root.glob("Dockerfile*"))
    yield from sorted((root / "docs").rglob("*.md"))
    for name in ("README.md", "loadtest/README.md", "scripts/run", "scripts/debian-check"):
        if (root / name).is_file():
            yield root / name


@dataclass(frozen=True)
class Found:
    where: str
    name: str
    value: str


def secret_values(files: Iterable[Path], root: Path = ROOT) -> list[Found]:
    """Each literal value given to a secret in `files` (a URL secret: its password)."""
    found = []
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            comment = line.find("#")
            for match in _ASSIGNMENT.finditer(line):
                name = match[1]
                raw = next(g for g in match.groups()[2:] if g is not None)
                if name not in SECRET_NAMES or not raw:
                    continue
                if 0 <= comment < match.start() and match[2] != "=":
                    # "# NAME: what it does" is prose; "# NAME=value" an example.
                    continue
                where = f"{path.relative_to(root)}:{number}"
                for entry in raw.split():
                    if name in URL_SECRETS:
                        password = urlsplit(entry).password
                        entry = unquote(password) if password else ""
                    if entry and not _NOT_A_VALUE.search(entry):
                        found.append(Found(where, name, entry))
    return found


def test_every_secret_value_the_examples_ship_is_refused() -> None:
    found = secret_values(example_files())
    # The scan sees the examples: the Kubernetes example's six secrets and three
    # passwords, the development compose file's, the runbook's rotation spellings.
    names = {(f.where.split(":")[0], f.name) for f in found}
    example = str(EXAMPLE_SECRETS.relative_to(ROOT))
    for name in (
        "GATE_JWT_SECRET",
        "GATE_ADMIN_TOKEN",
        "GATE_WEBHOOK_SECRET",
        "GATE_ADMISSION_SECRET",
        "GATE_MYSQL_URL",
        "GATE_REDIS_URL",
        "GATE_MYSQL_APP_PASSWORD",
    ):
        assert (example, name) in names, (name, sorted(names))
    assert ("docker-compose.dev.yml", "GATE_PAYMENT_API_KEY") in names
    assert {"whsec_OLD", "whsec_NEW"} <= {f.value for f in found}
    accepted = [f for f in found if published_reason(f.value) is None]
    assert accepted == [], (
        "secret values shipped in the repository's examples that a production gate would"
        " accept: start them with CHANGE-ME or list them in gate/base/published.py"
        f" EXAMPLE_VALUES: {accepted}"
    )


def test_the_scan_catches_a_newly_added_example_value(tmp_path: Path) -> None:
    """The scan is not vacuous: a new example with a value of its own is reported."""
    (tmp_path / "deploy").mkdir()
    added = tmp_path / "deploy" / "new-overlay.yaml"
    added.write_text(
        "stringData:\n"
        '  GATE_ADMIN_TOKEN: "an-example-admin-token-nobody-listed-0123"\n'
        "  GATE_MYSQL_URL: mysql://gate_app:another-example-password@db:3306/gate\n"
        "  GATE_JWT_SECRET: ${GATE_JWT_SECRET:?set it}\n"
        "  GATE_ADMISSION_SECRET: …\n"
    )
    found = secret_values(example_files(tmp_path), tmp_path)
    assert [(f.name, f.value) for f in found] == [
        ("GATE_ADMIN_TOKEN", "an-example-admin-token-nobody-listed-0123"),
        ("GATE_MYSQL_URL", "another-example-password"),
    ]
    assert [published_reason(f.value) for f in found] == [None, None]


def example_secrets() -> list[tuple[str, str]]:
    """(name, value) of every secret of the Kubernetes example, both Secrets."""
    return [
        (name, value)
        for doc in yaml.safe_load_all(EXAMPLE_SECRETS.read_text())
        for name, value in doc["stringData"].items()
    ]


@pytest.mark.parametrize("gate_env", ["production", "test"])
def test_the_kubernetes_example_secrets_stop_start_up(env: dict[str, str], gate_env: str) -> None:
    """`kubectl apply -k` of the example as it is: every one of its secrets, alone,
    is refused by name with exit 2, its value never printed."""
    pairs = example_secrets()
    assert len(pairs) == 8, pairs
    for name, value in pairs:
        given = {**env, "GATE_ENV": gate_env, name: value}
        if name == "GATE_MYSQL_APP_PASSWORD":
            # Read by `gate migrate`, checked with every secret at start-up.
            given["GATE_MYSQL_APP_USER"] = "gate_app"
        with pytest.raises(SettingsError, match=f"^{name}.* is a placeholder") as refused:
            load_settings(given)
        assert "CHANGE-ME" not in str(refused.value)
        out = serve_once(given)
        assert out.returncode == 2, (name, out.stderr)
        assert name in out.stderr and "placeholder" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
        secret = urlsplit(value).password if name in URL_SECRETS else value
        assert secret and secret not in out.stdout + out.stderr
    # All of them at once, as the overlay runs them.
    out = serve_once({**env, "GATE_ENV": gate_env, **dict(pairs)})
    assert out.returncode == 2 and "placeholder" in out.stderr, out.stderr


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("GATE_JWT_SECRET", "change-me-0123456789abcdef0123456789abcdef"),
        ("GATE_ADMIN_TOKEN", "Change-Me-please-0123456789abcdef0123"),
        ("GATE_ADMISSION_SECRET", "CHANGE-ME" + "x" * 40),
        ("GATE_CONSOLE_SECRET", "change-me-console-secret-0123456789abcdef"),
        ("GATE_PAYMENT_API_KEY", "CHANGE-ME"),
        ("GATE_STRIPE_API_KEY", "change-me-sk_live"),
        # One entry of a rotation list is enough.
        ("GATE_WEBHOOK_SECRET", "whsec_dGVzdC13ZWJob29rLXNlY3JldC0wMTIzNDU2Nzg5 whsec_OLD"),
        # A webhook key whose bytes are a placeholder ("change-me-webhook").
        ("GATE_WEBHOOK_SECRET", "whsec_Y2hhbmdlLW1lLXdlYmhvb2s"),
        ("GATE_REDIS_URL", "redis://:CHANGE-ME@127.0.0.1:6379/0"),
        ("GATE_MYSQL_URL", "mysql://gate_app:change-me-too@127.0.0.1:3306/gate"),
    ],
)
def test_any_change_me_value_is_refused_outside_dev(
    env: dict[str, str], name: str, value: str
) -> None:
    with pytest.raises(SettingsError, match=f"^{name}.* is a placeholder"):
        load_settings({**env, "GATE_ENV": "production", name: value})
    # With GATE_ENV=dev a placeholder is the developer's business.
    load_settings({**env, "GATE_ENV": "dev", name: value})


def test_the_example_values_are_listed_once_and_refused() -> None:
    for value in EXAMPLE_VALUES:
        assert published_reason(value) is not None, value
    # A value of one's own, even one that mentions change-me later on, is accepted.
    assert published_reason("prod-token-change-me-never-0123456789abcdef") is None
