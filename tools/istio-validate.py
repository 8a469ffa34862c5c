"""Validates Kubernetes YAML (stdin, or each file given) against Istio's CRD schemas, Kubernetes' own
(Deployment, Service, ServiceAccount, ConfigMap, Role, RoleBinding), the Gateway API Inference
Extension's InferencePool and the part of Gateway API the manifests use, rejecting unknown fields.

The schemas are the Istio API models of PyPI's cloudcoil-models-istio (generated from Istio's CRDs)
and the Kubernetes ones of cloudcoil-models-kubernetes (from Kubernetes' OpenAPI).
As shipped they ignore unknown fields (pydantic's default) and accept snake_case spellings of
camelCase fields; an API server with strict field validation rejects both, so this turns both off
before the models are built, and validates in strict mode (no "8000" for 8000).
No package has models of InferencePool or Gateway API: inference_pool.py is one written from the
InferencePool API reference, whole; gateway_api_subset.py covers only the Gateway and HTTPRoute
fields the manifests use (any other field is reported unknown).
Prints one line per error; exits 1 if any document is invalid.
"""

import sys

import cloudcoil.pydantic

# Before the model modules are imported: their classes inherit this config as they are created.
cloudcoil.pydantic.BaseModel.model_config.update(
    extra="forbid", populate_by_name=False, validate_by_name=False, validate_by_alias=True
)

import yaml  # noqa: E402
from cloudcoil.models.istio.extensions import v1alpha1 as extensions_v1alpha1  # noqa: E402
from cloudcoil.models.istio.networking import v1 as networking_v1  # noqa: E402
from cloudcoil.models.istio.networking import v1alpha3 as networking_v1alpha3  # noqa: E402
from cloudcoil.models.istio.networking import v1beta1 as networking_v1beta1  # noqa: E402
from cloudcoil.models.istio.security import v1 as security_v1  # noqa: E402
from cloudcoil.models.istio.telemetry import v1 as telemetry_v1  # noqa: E402
from cloudcoil.models.kubernetes.apps import v1 as apps_v1  # noqa: E402
from cloudcoil.models.kubernetes.core import v1 as core_v1  # noqa: E402
from cloudcoil.models.kubernetes.rbac import v1 as rbac_v1  # noqa: E402

import gateway_api_subset  # noqa: E402
import inference_pool  # noqa: E402

MODULES = {
    "extensions.istio.io/v1alpha1": extensions_v1alpha1,
    "networking.istio.io/v1": networking_v1,
    "networking.istio.io/v1alpha3": networking_v1alpha3,
    "networking.istio.io/v1beta1": networking_v1beta1,
    "security.istio.io/v1": security_v1,
    "telemetry.istio.io/v1": telemetry_v1,
    "apps/v1": apps_v1,
    "v1": core_v1,
    "rbac.authorization.k8s.io/v1": rbac_v1,
    "inference.networking.k8s.io/v1": inference_pool,
    "gateway.networking.k8s.io/v1": gateway_api_subset,
}


# Enum values Istio added after the release these models were generated from (1.24), which the
# manifests rely on (Istio >= 1.28 is required anyway): each is checked as a value the models know
# and behaves alike for the schema. WasmPlugin's FAIL_RELOAD arrived in Istio 1.27.
NEWER_ENUMS = {("WasmPlugin", "failStrategy"): {"FAIL_RELOAD": "FAIL_OPEN"}}


def as_known(doc):
    """`doc` with the newer enum values of NEWER_ENUMS replaced by ones the models know."""
    spec = doc.get("spec")
    for (kind, field), values in NEWER_ENUMS.items():
        if doc.get("kind") == kind and isinstance(spec, dict) and spec.get(field) in values:
            doc = {**doc, "spec": {**spec, field: values[spec[field]]}}
    return doc


def errors(doc):
    """The schema errors of one document (a list of strings, empty if valid)."""
    if not isinstance(doc, dict):
        return [f"not a Kubernetes object: {doc!r:.60}"]
    doc = as_known(doc)
    api, kind = doc.get("apiVersion"), doc.get("kind")
    model = getattr(MODULES.get(api), kind or "", None) if api in MODULES else None
    if model is None:
        return [f"{api}/{kind}: not an object this validator knows"]
    try:
        model.model_validate(doc, strict=True)
        return []
    except Exception as e:  # pydantic.ValidationError; anything else is as much a failure
        name = (doc.get("metadata") or {}).get("name")
        return [f"{kind}/{name}: {line}" for line in str(e).splitlines() if line.strip()]


def check(stream, prefix):
    """Validates every document of `stream`, printing errors and a summary: whether all passed."""
    count = bad = 0
    for doc in yaml.safe_load_all(stream):
        if doc is None:
            continue
        count += 1
        found = errors(doc)
        bad += bool(found)
        for line in found:
            print(f"{prefix}{line}")
    print(f"{prefix}{count - bad} valid, {bad} invalid")
    return count > 0 and bad == 0


def main(paths):
    """Each file is checked on its own (lines prefixed with its path): one interpreter start for
    many files, since importing the models is most of the cost."""
    if not paths:
        return 0 if check(sys.stdin, "") else 1
    results = []
    for path in paths:
        with open(path) as f:
            results.append(check(f, f"{path}: "))
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
