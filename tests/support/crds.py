"""Rendered Kubernetes manifests checked against the real schemas, offline.

- Built-in kinds (ServiceAccount, Role, RoleBinding, Job): kubernetes-validate's JSON schemas
  of Kubernetes KUBERNETES_VERSION, strict (an unknown field is an error). It passes a kind it
  has no schema for (exit 0 and a warning), so custom kinds never go there.
- Custom kinds (JobSet, PyTorchJob, TrainJob): jsonschema against the ``openAPIV3Schema`` of
  their CRDs at the pinned releases in tests/data/k8s-crds/, turned into JSON Schema: every
  object with ``properties`` refuses other keys unless it says
  ``x-kubernetes-preserve-unknown-fields`` (the API server would prune them silently; a
  strict client is refused), ``x-kubernetes-int-or-string`` is integer or string, ``nullable``
  admits null. Not evaluated: CEL rules, defaulting, admission webhooks. ``metadata`` is only
  ``type: object`` in a CRD, so the name is checked here (RFC 1035, at most 63).
"""

from __future__ import annotations

import functools
import gzip
import re
from pathlib import Path

import jsonschema
import yaml

DATA = Path(__file__).resolve().parents[1] / "data" / "k8s-crds"
KUBERNETES_VERSION = "1.33.0"  # the cluster version the built-in kinds are checked at
CRDS = {
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobset.x-k8s.io_jobsets-v0.12.0.yaml.gz",
    ("kubeflow.org/v1", "PyTorchJob"): "kubeflow.org_pytorchjobs-v1.9.4.yaml.gz",
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): "trainer.kubeflow.org_trainjobs-v2.3.0.yaml.gz",
}
NAME = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")


def strict(node):
    """A CRD's structural schema as strict JSON Schema (see the module's docstring)."""
    if isinstance(node, list):
        return [strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    if ("properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):  # fmt: skip
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_schema(api_version: str, kind: str) -> dict:
    crd = yaml.safe_load(gzip.decompress((DATA / CRDS[(api_version, kind)]).read_bytes()))
    version = api_version.split("/")[1]
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return strict(v["schema"]["openAPIV3Schema"])


# Kubernetes' OpenAPI types quantities as string-or-number and has no enumerations for these
# core fields; the values the API server accepts (apimachinery's quantity syntax, the
# documented enumerations) are checked here wherever gptflow writes them
QUANTITY = re.compile(
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+"
    r"(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
ENUMS = {
    "restartPolicy": {"Always", "OnFailure", "Never", "ExitCode"},  # ExitCode: PyTorchJob's
    "imagePullPolicy": {"Always", "IfNotPresent", "Never"},
    "medium": {"", "Memory", "HugePages"},
    "effect": {"NoSchedule", "PreferNoSchedule", "NoExecute"},
}


def core_problems(node, path: str = "") -> list[str]:
    """Quantities and enumerations (above) anywhere in `node`."""
    found = []
    if isinstance(node, list):
        for i, item in enumerate(node):
            found += core_problems(item, f"{path}.{i}")
    elif isinstance(node, dict):
        for key, value in node.items():
            here = f"{path}.{key}".lstrip(".")
            if key in ("requests", "limits") and isinstance(value, dict):
                found += [f"{here}.{k}: {v!r} is not a quantity" for k, v in value.items()
                          if not (isinstance(v, int) or QUANTITY.match(str(v)))]  # fmt: skip
            elif key == "sizeLimit" and not QUANTITY.match(str(value)):
                found.append(f"{here}: {value!r} is not a quantity")
            elif key in ENUMS and isinstance(value, str) and value not in ENUMS[key]:
                found.append(f"{here}: {value!r} is not one of {sorted(ENUMS[key])}")
            else:
                found += core_problems(value, here)
    return found


def problems(obj: dict) -> list[str]:
    """What the real schema refuses in `obj` (empty: valid); a kind with no schema here is a
    problem, never a pass."""
    return core_problems(obj) + schema_problems(obj)


def schema_problems(obj: dict) -> list[str]:
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key in CRDS:
        validator = jsonschema.Draft7Validator(crd_schema(*key))
        found = [f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
                 for e in validator.iter_errors(obj)]  # fmt: skip
        name = (obj.get("metadata") or {}).get("name", "")
        if not NAME.fullmatch(name):
            found.append(f"metadata.name: {name!r} is not an RFC 1035 name of at most 63")
        return found
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError

    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except SchemaNotFoundError:
        return [f"no schema for {key}: not validated"]
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.path)) or '(root)'}: {e.message}"]
    return []
