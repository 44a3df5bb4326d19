"""The part of kustomize that deploy/k8s uses, so the manifests render where kustomize is not
installed: resources (files and kustomization folders), namespace, images, patches (strategic
merge of whole objects, found by kind and name) and secretGenerator without name hashes.

Anything else in a kustomization is refused, so a new feature cannot be silently skipped; where
kubectl is installed, test_k8s_manifests.py checks this renders what `kubectl kustomize` does.
"""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import yaml

Object = dict[str, Any]

SUPPORTED = {"apiVersion", "kind", "resources", "namespace", "images", "patches", "secretGenerator", "generatorOptions"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PriorityClass", "StorageClass"}
# Lists a strategic merge patch merges item by item (by this key) instead of replacing.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
}


class UnsupportedKustomization(Exception):
    pass


def render(folder: Path) -> list[Object]:
    """The objects `kubectl kustomize folder` prints, in no particular order."""
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(spec) - SUPPORTED
    if unknown:
        raise UnsupportedKustomization(f"{folder}: {sorted(unknown)}")
    objects: list[Object] = []
    for resource in spec.get("resources", []):
        path = (folder / resource).resolve()
        objects += render(path) if path.is_dir() else load_objects(path)
    objects += _generated_secrets(folder, spec)
    for patch in spec.get("patches", []):
        if set(patch) != {"path"}:
            raise UnsupportedKustomization(f"{folder}: only whole-object patches by path ({patch})")
        for patch_object in load_objects(folder / patch["path"]):
            _apply_patch(objects, patch_object)
    if "namespace" in spec:
        for item in objects:
            if item["kind"] not in CLUSTER_SCOPED:
                item["metadata"]["namespace"] = spec["namespace"]
    for image in spec.get("images", []):
        for item in objects:
            for container in _containers(item):
                container["image"] = _set_image(container["image"], image)
    return objects


def load_objects(path: Path) -> list[Object]:
    return [item for item in yaml.safe_load_all(path.read_text()) if item]


def strategic_merge(base: Any, patch: Any, key: str = "") -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for name, value in patch.items():
            if value is None:
                merged.pop(name, None)
            elif name in merged:
                merged[name] = strategic_merge(merged[name], value, name)
            else:
                merged[name] = copy.deepcopy(value)
        return merged
    if isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS:
        # As kubectl orders them: the patch's items (merged into the base's of the same key)
        # in the patch's order, then the base's other items.
        merge_key = MERGE_KEYS[key]
        patched = {item.get(merge_key) for item in patch}
        olds = {item.get(merge_key): item for item in base}
        merged_list = [
            strategic_merge(olds[item.get(merge_key)], item) if item.get(merge_key) in olds else copy.deepcopy(item) for item in patch
        ]
        return merged_list + [copy.deepcopy(item) for item in base if item.get(merge_key) not in patched]
    return copy.deepcopy(patch)


def _apply_patch(objects: list[Object], patch: Object) -> None:
    name = patch["metadata"]["name"]
    targets = [i for i, item in enumerate(objects) if item["kind"] == patch["kind"] and item["metadata"]["name"] == name]
    if len(targets) != 1:
        raise UnsupportedKustomization(f"patch {patch['kind']}/{name} matches {len(targets)} objects")
    objects[targets[0]] = strategic_merge(objects[targets[0]], patch)


def _generated_secrets(folder: Path, spec: Object) -> list[Object]:
    generators = spec.get("secretGenerator", [])
    if generators and not spec.get("generatorOptions", {}).get("disableNameSuffixHash"):
        raise UnsupportedKustomization(f"{folder}: secretGenerator with name hashes")
    secrets = []
    for generator in generators:
        if set(generator) - {"name", "namespace", "files", "literals", "type"}:
            raise UnsupportedKustomization(f"{folder}: secretGenerator {generator['name']}: {sorted(generator)}")
        data: dict[str, bytes] = {}
        for literal in generator.get("literals", []):
            key, value = literal.split("=", 1)
            data[key] = value.encode()
        for source in generator.get("files", []):
            key, path = source.split("=", 1) if "=" in source else (Path(source).name, source)
            data[key] = (folder / path).read_bytes()
        metadata = {"name": generator["name"]} | ({"namespace": generator["namespace"]} if "namespace" in generator else {})
        secrets.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": metadata,
                "type": generator.get("type", "Opaque"),
                "data": {key: _base64(value) for key, value in data.items()},
            }
        )
    return secrets


def _containers(item: Object) -> list[Object]:
    pod = item.get("spec", {}).get("template", {}).get("spec", {})
    return [*pod.get("initContainers", []), *pod.get("containers", [])]


def _set_image(current: str, image: Object) -> str:
    name, tag = current, ""
    if ":" in current.rsplit("/", 1)[-1]:  # a tag, not a registry's port
        name, tag = current.rsplit(":", 1)
    if name != image["name"]:
        return current
    name = image.get("newName", name)
    tag = image.get("newTag", tag)
    return f"{name}:{tag}" if tag else name


def _base64(value: bytes) -> str:
    """As kustomize writes a Secret's value: base64 in lines of 70, each ended by a newline once
    there are two or more."""
    text = base64.b64encode(value).decode()
    if len(text) < 70:
        return text
    return "".join(f"{text[start : start + 70]}\n" for start in range(0, len(text), 70))
