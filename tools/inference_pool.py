"""A strict pydantic model of the Gateway API Inference Extension's InferencePool
(inference.networking.k8s.io/v1), written from its API reference (GIE v1.6): every field of the
spec, its defaults, enums and bounds, and the two rules the CRD states in CEL (unique target port
numbers; a port for a Service picker). Unknown fields are rejected. No PyPI package has it.

Two deliberate differences from the v1.6 CRD: `endpointPickerRef` is required, as it was up to
GIE v1.5 and as Istio, agentgateway and NGINX Gateway Fabric still need it; and `status` is not
modelled, since a manifest never carries the controller's status. `appProtocol` arrived in v1.5,
eight `targetPorts` in v1.1 (v1.0 allowed one).

Imported by istio-validate.py, which validates with strict=True (no "8000" for 8000).
"""

from typing import Annotated, Literal, Optional

from cloudcoil.apimachinery import ObjectMeta
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"

PortNumber = Annotated[int, Field(ge=1, le=65535)]
# An API group: empty (the core group) or a DNS subdomain.
Group = Annotated[str, StringConstraints(max_length=253, pattern=rf"^$|^{DNS_SUBDOMAIN}$")]
Kind = Annotated[
    str,
    StringConstraints(min_length=1, max_length=63, pattern=r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"),
]
ObjectName = Annotated[str, StringConstraints(min_length=1, max_length=253)]
# Kubernetes' label syntax: an optional DNS-subdomain prefix and `/`, then a name of 1 to 63
# characters.
LabelKey = Annotated[
    str,
    StringConstraints(
        min_length=1,
        max_length=253,
        pattern=rf"^({DNS_SUBDOMAIN}/)?([A-Za-z0-9][-A-Za-z0-9_.]{{0,61}})?[A-Za-z0-9]$",
    ),
]
LabelValue = Annotated[
    str, StringConstraints(max_length=63, pattern=r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def unique(items, key, message):
    """`items`, if no two have the same `key`; else the API's `message`, naming the keys."""
    keys = [key(item) for item in items]
    if len(set(keys)) != len(keys):
        raise ValueError(f"{message}: {keys}")
    return items


class Port(Strict):
    """A port of the pool's pods, or the picker Service's port."""

    number: PortNumber


class LabelSelector(Strict):
    """Pods in the pool's namespace carrying every one of these labels (a Service's selector)."""

    matchLabels: Annotated[dict[LabelKey, LabelValue], Field(min_length=1, max_length=64)]


class EndpointPickerRef(Strict):
    """The endpoint picker the gateway asks over ext_proc, and what to do when it fails."""

    group: Group = ""
    kind: Kind = "Service"
    name: ObjectName
    # The Service's port (not the pod's target port); required for a Service.
    port: Optional[Port] = None
    # FailOpen: the gateway picks an endpoint itself; FailClose: the request fails.
    failureMode: Literal["FailOpen", "FailClose"] = "FailClose"

    @model_validator(mode="after")
    def service_needs_a_port(self):
        if self.kind == "Service" and self.port is None:
            raise ValueError("port is required when kind is 'Service' or unspecified")
        return self


class InferencePoolSpec(Strict):
    selector: LabelSelector
    # Each port of each selected pod is one endpoint (`podIP:number`).
    targetPorts: Annotated[list[Port], Field(min_length=1, max_length=8)]
    # HTTP/1.1, or HTTP/2 in cleartext, for every target port.
    appProtocol: Literal["http", "kubernetes.io/h2c"] = "http"
    endpointPickerRef: EndpointPickerRef

    @field_validator("targetPorts")
    @classmethod
    def numbers_are_unique(cls, ports):
        return unique(ports, lambda port: port.number, "port number must be unique")


class InferencePool(Strict):
    apiVersion: Literal["inference.networking.k8s.io/v1"]
    kind: Literal["InferencePool"]
    metadata: Optional[ObjectMeta] = None
    spec: InferencePoolSpec
