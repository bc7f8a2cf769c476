"""A small kustomize: builds deploy/kubernetes/ the way `kustomize build` does, for the
features its kustomizations use, so the suite can validate what an operator applies
without a kustomize binary (none is installed offline).

    build(dir)
      resources   files (one or more YAML documents) and directories (their own
                  kustomization, built first), in order
      patches     `- path: file`: a strategic merge patch of the resource of the same
                  kind and name (maps merge; lists of containers, env, volumes, ports
                  merge on their key; other lists are replaced)
      namespace   set on every namespaced resource
      labels      `pairs` into metadata.labels (and the pod templates' with
                  includeTemplates); includeSelectors is refused
      images      `name` → `newName` / `newTag` / `digest` in every container

Any other kustomization field raises Unsupported: a kustomization that needs more
than this must not pass the suite on a build that ignored part of it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

SUPPORTED = {"apiVersion", "kind", "resources", "patches", "namespace", "labels", "images"}
# Kinds without a namespace among those a kustomization here may hold.
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "PersistentVolume",
    "StorageClass",
    "CustomResourceDefinition",
    "PriorityClass",
}
# Kinds whose spec.template is a pod template.
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
# The strategic merge keys of the list fields this builder merges (the Kubernetes
# API's patchMergeKey for each); any other list in a patch replaces the original.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}


class Unsupported(Exception):
    """A kustomization uses a feature this builder does not implement."""


class BuildError(Exception):
    """What `kustomize build` would refuse too (a patch without a target, a duplicate)."""


def build(directory: Path) -> list[Obj]:
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - SUPPORTED
    if unknown:
        raise Unsupported(f"{directory}: kustomization fields not built here: {sorted(unknown)}")
    objects: list[Obj] = []
    for entry in spec.get("resources", []):
        path = (directory / entry).resolve()
        objects += build(path) if path.is_dir() else load_documents(path)
    check_unique(objects)
    for patch in spec.get("patches", []):
        if set(patch) != {"path"}:
            raise Unsupported(f"{directory}: only `- path:` patches are built here: {patch}")
        for doc in load_documents(directory / patch["path"]):
            apply_patch(objects, doc)
    if "namespace" in spec:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = spec["namespace"]
    for entry in spec.get("labels", []):
        add_labels(objects, entry)
    for image in spec.get("images", []):
        set_image(objects, image)
    return objects


def load_documents(path: Path) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def identity(obj: Obj) -> tuple[str, str, str, str]:
    group = obj["apiVersion"].rpartition("/")[0]
    meta = obj["metadata"]
    return group, obj["kind"], meta.get("namespace", ""), meta["name"]


def check_unique(objects: list[Obj]) -> None:
    seen: set[tuple[str, str, str, str]] = set()
    for obj in objects:
        key = identity(obj)
        if key in seen:
            raise BuildError(f"two resources {key}")
        seen.add(key)


def apply_patch(objects: list[Obj], patch: Obj) -> None:
    group, kind, namespace, name = identity(patch)
    targets = [
        obj
        for obj in objects
        if identity(obj)[:2] == (group, kind)
        and obj["metadata"]["name"] == name
        and (not namespace or obj["metadata"].get("namespace", "") == namespace)
    ]
    if len(targets) != 1:
        raise BuildError(f"patch of {kind}/{name} matches {len(targets)} resources")
    merged = merge(targets[0], patch)
    targets[0].clear()
    targets[0].update(merged)


def merge(original: Any, patch: Any, field: str = "") -> Any:
    """Strategic merge of `patch` into `original` (neither is changed)."""
    if isinstance(original, dict) and isinstance(patch, dict):
        out = copy.deepcopy(original)
        for key, value in patch.items():
            out[key] = merge(original[key], value, key) if key in original else value
        return out
    if isinstance(original, list) and isinstance(patch, list) and field in MERGE_KEYS:
        return merge_list(original, patch, MERGE_KEYS[field])
    return copy.deepcopy(patch)


def merge_list(original: list[Obj], patch: list[Obj], key: str) -> list[Obj]:
    out = copy.deepcopy(original)
    for item in patch:
        index = next((i for i, o in enumerate(out) if o.get(key) == item.get(key)), None)
        if index is None:
            out.append(copy.deepcopy(item))
        else:
            out[index] = merge(out[index], item)
    return out


def add_labels(objects: list[Obj], entry: Obj) -> None:
    if entry.get("includeSelectors"):
        raise Unsupported("labels with includeSelectors (selectors are immutable)")
    if set(entry) - {"pairs", "includeSelectors", "includeTemplates"}:
        raise Unsupported(f"labels fields not built here: {sorted(entry)}")
    for obj in objects:
        obj["metadata"].setdefault("labels", {}).update(entry["pairs"])
        if entry.get("includeTemplates") and obj["kind"] in WORKLOADS:
            template = obj["spec"]["template"].setdefault("metadata", {})
            template.setdefault("labels", {}).update(entry["pairs"])


def pod_spec(obj: Obj) -> Obj | None:
    if obj["kind"] in WORKLOADS:
        spec: Obj = obj["spec"]["template"]["spec"]
        return spec
    return None


def image_name(image: str) -> str:
    """The image reference without its tag or digest (a registry port stays)."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return name[: len(name) - len(last)] + last.split(":", 1)[0]


def set_image(objects: list[Obj], image: Obj) -> None:
    for obj in objects:
        spec = pod_spec(obj)
        if spec is None:
            continue
        for container in spec.get("containers", []) + spec.get("initContainers", []):
            if image_name(container["image"]) != image["name"]:
                continue
            name = image.get("newName", image["name"])
            if "digest" in image:
                container["image"] = f"{name}@{image['digest']}"
            elif "newTag" in image:
                container["image"] = f"{name}:{image['newTag']}"
            else:
                container["image"] = name + container["image"][len(image["name"]) :]
