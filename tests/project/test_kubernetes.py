"""deploy/kubernetes/: every manifest, and what the base and the example overlay build
to, validates against the Kubernetes schemas (kubernetes-validate ships them: no
cluster, no download); the gate Deployment's probes, shutdown timing and security
context; the Services, the NetworkPolicy, the migrate Job's database user and the
secrets read as files. The builds come from tests/project/kustomize.py, which does
what `kustomize build` does for the features these kustomizations use."""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from gate.base.settings import SettingsError, load_settings, metrics_port_for
from gate.store.migrate import load_app_user
from tests.project import kustomize
from tests.support import ROOT

K8S = ROOT / "deploy" / "kubernetes"
BASE = K8S / "base"
OVERLAY = K8S / "overlays" / "example"
# The oldest Kubernetes release the manifests are meant for (every field used is
# stable there), and the newest the package knows.
VERSIONS = ("1.29.0", latest_version())
# The variables that hold a secret (a password in a URL counts): never a plain value
# in a manifest, always NAME_FILE on a mounted Secret.
SECRET_VARIABLES = {
    "GATE_REDIS_URL",
    "GATE_MYSQL_URL",
    "GATE_JWT_SECRET",
    "GATE_ADMIN_TOKEN",
    "GATE_WEBHOOK_SECRET",
    "GATE_ADMISSION_SECRET",
    "GATE_MYSQL_APP_PASSWORD",
}
Obj = dict[str, Any]


def one(objects: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def container(workload: Obj) -> Obj:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    result: Obj = containers[0]
    return result


def env_of(c: Obj) -> dict[str, str]:
    assert all("valueFrom" not in e for e in c["env"]), "secrets come as files, not env refs"
    return {e["name"]: e["value"] for e in c["env"]}


def validate(obj: Obj) -> None:
    for version in VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.fixture(scope="module")
def overlay() -> list[Obj]:
    return kustomize.build(OVERLAY)


# -- schemas -----------------------------------------------------------------------------


def manifest_files() -> list[Path]:
    """Every complete manifest: all YAML under deploy/kubernetes/ but the
    kustomizations and the patches they name (partial objects)."""
    patches: set[Path] = set()
    for k in K8S.rglob("kustomization.yaml"):
        spec = yaml.safe_load(k.read_text())
        patches |= {(k.parent / p["path"]).resolve() for p in spec.get("patches", [])}
    return [
        p
        for p in sorted(K8S.rglob("*.yaml"))
        if p.name != "kustomization.yaml" and p.resolve() not in patches
    ]


def test_every_manifest_and_build_validates_against_the_kubernetes_schemas(
    overlay: list[Obj],
) -> None:
    files = manifest_files()
    assert len(files) >= 8
    for path in files:
        for obj in kustomize.load_documents(path):
            validate(obj)
    base = kustomize.build(BASE)
    assert {o["kind"] for o in base} >= {
        "Deployment",
        "Service",
        "Job",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "ServiceAccount",
    }
    for obj in [*base, *overlay]:
        validate(obj)


def test_the_schema_check_rejects_a_wrong_field(overlay: list[Obj]) -> None:
    deployment = one(overlay, "Deployment", "gate")
    broken = kustomize.merge(deployment, {"spec": {"replicas": "three"}})
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken)
    unknown = kustomize.merge(deployment, {"spec": {"template": {"spec": {"sidecar": True}}}})
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(unknown)


def test_the_overlay_builds_into_one_namespace_with_the_released_image(
    overlay: list[Obj],
) -> None:
    for obj in overlay:
        if obj["kind"] == "Namespace":
            assert obj["metadata"]["name"] == "gate" and "namespace" not in obj["metadata"]
            assert obj["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
        else:
            assert obj["metadata"]["namespace"] == "gate", obj["metadata"]["name"]
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "flash-sale"
    for name in ("Deployment", "Job"):
        workload = next(o for o in overlay if o["kind"] == name)
        assert container(workload)["image"] == "registry.example.com/shop/gate:0.1.0"
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/part-of"] == "flash-sale"
    deployment = one(overlay, "Deployment", "gate")
    assert deployment["spec"]["replicas"] == 3
    # The patch added to the base's environment; it replaced nothing it did not name.
    env = env_of(container(deployment))
    assert env["GATE_REDIS_MODE"] == "cluster" and env["GATE_AUTO_MIGRATE"] == "0"


# -- the gate Deployment -------------------------------------------------------------


def test_deployment_probes_and_shutdown_timing(overlay: list[Obj]) -> None:
    deployment = one(overlay, "Deployment", "gate")
    pod = deployment["spec"]["template"]["spec"]
    gate = container(deployment)
    ports = {p["name"]: p["containerPort"] for p in gate["ports"]}
    # The metrics port is the default for the public port (--port + 10000).
    assert ports == {"http": 8000, "metrics": metrics_port_for(8000)}
    assert gate["args"][0] == "serve"
    assert gate["args"][gate["args"].index("--host") + 1] == "0.0.0.0"
    assert int(gate["args"][gate["args"].index("--port") + 1]) == ports["http"]

    ready, live = gate["readinessProbe"], gate["livenessProbe"]
    assert ready["httpGet"]["path"] == "/readyz" and live["httpGet"]["path"] == "/healthz"
    for probe in (ready, live, gate["startupProbe"]):
        assert probe["httpGet"]["port"] in ("http", ports["http"])
    # Out of the endpoints within a few seconds of a stopping gate's first 503.
    assert ready["failureThreshold"] <= 2

    env = env_of(gate)
    delay = float(env.get("GATE_SHUTDOWN_DELAY_SECONDS", "5"))
    grace = float(env.get("GATE_SHUTDOWN_GRACE_SECONDS", "10"))
    # The delay has to outlast a readiness check or two, or balancers keep sending.
    assert delay >= ready["periodSeconds"] * ready["failureThreshold"]
    assert pod["terminationGracePeriodSeconds"] > delay + grace
    # Either the gate waits (its delay) or a preStop hook does, never both.
    assert "lifecycle" not in gate or delay == 0
    rollout = deployment["spec"]["strategy"]["rollingUpdate"]
    assert rollout["maxUnavailable"] == 0

    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(gate["resources"][kind]), kind
    assert env["GATE_METRICS_ADDR"] == f"0.0.0.0:{ports['metrics']}"


@pytest.mark.parametrize("kind,name", [("Deployment", "gate"), ("Job", "gate-migrate")])
def test_pods_run_locked_down(overlay: list[Obj], kind: str, name: str) -> None:
    workload = one(overlay, kind, name)
    pod = workload["spec"]["template"]["spec"]
    c = container(workload)
    assert pod["automountServiceAccountToken"] is False
    account = one(overlay, "ServiceAccount", pod["serviceAccountName"])
    assert account["automountServiceAccountToken"] is False
    for context in (pod["securityContext"], c["securityContext"]):
        assert context["runAsNonRoot"] is True
        assert context["runAsUser"] == 10001 and context["runAsGroup"] == 10001
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc.get("privileged", False) is False
    # What the gate writes goes to emptyDirs: /tmp, and the metric files' directory.
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    env = env_of(c)
    if "GATE_METRICS_DIR" in env:
        assert env["PROMETHEUS_MULTIPROC_DIR"] == env["GATE_METRICS_DIR"]
        assert "emptyDir" in volumes[mounts[env["GATE_METRICS_DIR"]]]
    for m in c["volumeMounts"]:
        if "emptyDir" not in volumes[m["name"]]:
            assert m.get("readOnly") is True, m


# -- Services, disruption budget, network policy -------------------------------------


def test_only_the_public_port_is_in_the_public_service(overlay: list[Obj]) -> None:
    deployment = one(overlay, "Deployment", "gate")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    public = one(overlay, "Service", "gate")
    assert [(p["port"], p["targetPort"]) for p in public["spec"]["ports"]] == [(8000, "http")]
    metrics = one(overlay, "Service", "gate-metrics")
    assert [p["port"] for p in metrics["spec"]["ports"]] == [18000]
    assert metrics["spec"]["clusterIP"] == "None"
    for service in (public, metrics):
        assert service["spec"]["selector"].items() <= pod_labels.items()
    budget = one(overlay, "PodDisruptionBudget", "gate")
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    # A drain never takes every gate: the budget leaves at least one pod serving.
    assert budget["spec"]["maxUnavailable"] < deployment["spec"]["replicas"]


def test_only_the_monitoring_namespace_reaches_the_metrics_port(overlay: list[Obj]) -> None:
    deployment = one(overlay, "Deployment", "gate")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selecting = [
        p
        for p in overlay
        if p["kind"] == "NetworkPolicy"
        and p["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    ]
    assert len(selecting) == 1
    policy = selecting[0]["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    reach: dict[int, list[Any]] = {}
    for rule in policy["ingress"]:
        for port in rule["ports"]:
            reach.setdefault(port["port"], []).append(rule.get("from"))
    assert set(reach) == {8000, 18000}
    assert reach[18000] == [
        [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    ]
    # The migrate Job's pods accept nothing.
    job_labels = one(overlay, "Job", "gate-migrate")["spec"]["template"]["metadata"]["labels"]
    closed = [
        p["spec"]
        for p in overlay
        if p["kind"] == "NetworkPolicy"
        and p["spec"]["podSelector"]["matchLabels"].items() <= job_labels.items()
    ]
    assert closed == [{**closed[0], "policyTypes": ["Ingress"]}] and "ingress" not in closed[0]


# -- secrets as files, the database users --------------------------------------------


def resolved_env(overlay: list[Obj], workload: Obj) -> dict[str, str]:
    """The container's environment with each NAME_FILE replaced by NAME and the
    Secret key its mounted file holds, as the gate reads it."""
    c = container(workload)
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    mounted: dict[str, Obj] = {}
    for m in c["volumeMounts"]:
        source = volumes[m["name"]].get("secret")
        if source is not None:
            mounted[m["mountPath"]] = one(overlay, "Secret", source["secretName"])
    env: dict[str, str] = {}
    for name, value in env_of(c).items():
        assert name not in SECRET_VARIABLES, f"{name} as a plain value: use {name}_FILE"
        if not name.endswith("_FILE"):
            env[name] = value
            continue
        directory, _, key = value.rpartition("/")
        assert directory in mounted, f"{name}: {value} is on no mounted Secret"
        data = mounted[directory]["stringData"]
        assert key in data, f"{name}: Secret {mounted[directory]['metadata']['name']} has no {key}"
        env[name.removesuffix("_FILE")] = data[key]
    return env


def filled(env: dict[str, str]) -> dict[str, str]:
    """`env` with the example's placeholders replaced by values of one's own, the same
    placeholder by the same value everywhere (the app password in two Secrets)."""

    def own(match: re.Match[str]) -> str:
        return "own-" + hashlib.sha256(match[0].encode()).hexdigest()[:40]

    out = {name: re.sub(r"CHANGE-ME[\w-]*", own, value) for name, value in env.items()}
    if "GATE_WEBHOOK_SECRET" in out:
        key = base64.b64encode(b"own webhook key 01234567").decode()
        out["GATE_WEBHOOK_SECRET"] = f"whsec_{key}"
    return out


def test_secrets_are_read_as_files_and_the_example_values_are_fake(overlay: list[Obj]) -> None:
    deployment = one(overlay, "Deployment", "gate")
    env = resolved_env(overlay, deployment)
    assert SECRET_VARIABLES - {"GATE_MYSQL_APP_PASSWORD"} <= set(env)
    for secret in (o for o in overlay if o["kind"] == "Secret"):
        assert "data" not in secret, "readable placeholders: stringData"
        for key, value in secret["stringData"].items():
            assert "CHANGE-ME" in value or value.startswith("whsec_"), key
    # A production gate refuses the example as shipped (placeholders are not
    # secrets); with values of one's own in their places it runs on Redis Cluster
    # and the three Galera nodes.
    with pytest.raises(SettingsError, match="is a placeholder"):
        load_settings(env)
    settings = load_settings(filled(env))
    assert not settings.is_dev and settings.dev_secrets_used == ()
    assert [host for host, _ in settings.mysql.node_list] == [
        "gate-db-0.gate-db-internal.db.svc",
        "gate-db-1.gate-db-internal.db.svc",
        "gate-db-2.gate-db-internal.db.svc",
    ]
    assert settings.mysql.user == "gate_app"
    assert urlsplit(env["GATE_REDIS_URL"]).hostname in env["GATE_REDIS_CLUSTER_NODES"]


def test_only_the_migrate_job_holds_the_database_administrator(overlay: list[Obj]) -> None:
    deployment = one(overlay, "Deployment", "gate")
    job = one(overlay, "Job", "gate-migrate")
    assert container(job)["args"] == ["migrate"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] in ("OnFailure", "Never")
    gate_env = filled(resolved_env(overlay, deployment))
    job_env = filled(resolved_env(overlay, job))
    admin = load_settings(job_env).mysql
    app = load_settings(gate_env).mysql
    assert admin.node_list == app.node_list and admin.database == app.database
    user = load_app_user(job_env, admin)
    assert user is not None
    # The gate connects as the user the Job creates, with the password it sets.
    assert (user.name, app.user) == ("gate_app", "gate_app") and admin.user != app.user
    assert app.password.reveal() == job_env["GATE_MYSQL_APP_PASSWORD"]
    # The gate pods never see the administrator's Secret.
    secret_names = {
        v["secret"]["secretName"]
        for v in deployment["spec"]["template"]["spec"]["volumes"]
        if "secret" in v
    }
    assert secret_names == {"gate-secrets"}
    assert admin.password.reveal() not in " ".join(gate_env.values())


# -- the builder itself ------------------------------------------------------------------


def write(path: Path, *docs: Obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump_all(docs))


DEPLOY: Obj = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "web"},
    "spec": {
        "template": {
            "metadata": {"labels": {"app": "web"}},
            "spec": {
                "containers": [
                    {
                        "name": "web",
                        "image": "web:1",
                        "args": ["a", "b"],
                        "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
                        "volumeMounts": [{"name": "x", "mountPath": "/x"}],
                    },
                    {"name": "side", "image": "registry:5000/side"},
                ]
            },
        }
    },
}


def test_the_builder_merges_patches_like_kustomize(tmp_path: Path) -> None:
    write(tmp_path / "base/kustomization.yaml", {"resources": ["web.yaml"]})
    write(tmp_path / "base/web.yaml", DEPLOY)
    patch = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 4,
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "web",
                            "args": ["c"],
                            "env": [{"name": "B", "value": "3"}, {"name": "C", "value": "4"}],
                            "volumeMounts": [{"name": "y", "mountPath": "/x"}],
                        }
                    ]
                }
            },
        },
    }
    write(tmp_path / "over/patch.yaml", patch)
    write(
        tmp_path / "over/kustomization.yaml",
        {
            "namespace": "shop",
            "resources": ["../base", "ns.yaml"],
            "patches": [{"path": "patch.yaml"}],
            "labels": [{"pairs": {"team": "sale"}, "includeTemplates": True}],
            "images": [
                {"name": "web", "newName": "reg.example/web", "newTag": "2"},
                {"name": "registry:5000/side", "digest": "sha256:" + "0" * 64},
            ],
        },
    )
    write(
        tmp_path / "over/ns.yaml",
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}},
    )
    built = kustomize.build(tmp_path / "over")
    web = one(built, "Deployment", "web")
    ns = one(built, "Namespace", "shop")
    assert web["metadata"] == {"name": "web", "namespace": "shop", "labels": {"team": "sale"}}
    assert "namespace" not in ns["metadata"] and ns["metadata"]["labels"] == {"team": "sale"}
    assert web["spec"]["replicas"] == 4
    assert web["spec"]["template"]["metadata"]["labels"] == {"app": "web", "team": "sale"}
    main, side = web["spec"]["template"]["spec"]["containers"]
    assert main["args"] == ["c"]  # a list without a merge key is replaced
    assert main["env"] == [
        {"name": "A", "value": "1"},
        {"name": "B", "value": "3"},
        {"name": "C", "value": "4"},
    ]
    assert main["volumeMounts"] == [{"name": "y", "mountPath": "/x"}]
    assert main["image"] == "reg.example/web:2"
    assert side == {"name": "side", "image": "registry:5000/side@sha256:" + "0" * 64}
    # The base's file is untouched by the overlay's build.
    assert kustomize.build(tmp_path / "base")[0] == DEPLOY


@pytest.mark.parametrize(
    "kustomization,error",
    [
        ({"resources": ["web.yaml"], "commonLabels": {"a": "b"}}, kustomize.Unsupported),
        ({"resources": ["web.yaml"], "secretGenerator": []}, kustomize.Unsupported),
        (
            {
                "resources": ["web.yaml"],
                "labels": [{"pairs": {"a": "b"}, "includeSelectors": True}],
            },
            kustomize.Unsupported,
        ),
        ({"resources": ["web.yaml", "web.yaml"]}, kustomize.BuildError),
        ({"resources": ["web.yaml"], "patches": [{"path": "other.yaml"}]}, kustomize.BuildError),
    ],
)
def test_the_builder_refuses_what_it_does_not_build(
    tmp_path: Path, kustomization: Obj, error: type[Exception]
) -> None:
    write(tmp_path / "web.yaml", DEPLOY)
    write(
        tmp_path / "other.yaml",
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "other"}},
    )
    write(tmp_path / "kustomization.yaml", kustomization)
    with pytest.raises(error):
        kustomize.build(tmp_path)
