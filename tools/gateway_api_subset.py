"""Strict pydantic models of a SUBSET of Gateway API v1 (gateway.networking.k8s.io/v1): the
fields of `Gateway` and `HTTPRoute` that kvroute's manifests use, with the API reference's types,
defaults, enums and bounds (standard channel), and nothing more. No PyPI package has these models.

A field Gateway API has but this subset lacks is reported as unknown, like a misspelt one: when a
manifest needs it, add it here from the API reference. Of the API's CEL rules, only three a
manifest here could break are kept: unique listener names, a path match's leading `/`, and a port
on a backendRef to a Service.

Imported by istio-validate.py, which validates with strict=True (no "80" for 80).
"""

from typing import Annotated, Literal, Optional

from cloudcoil.apimachinery import ObjectMeta
from pydantic import Field, StringConstraints, field_validator, model_validator

# Gateway API's own types, which the Inference Extension's reuse.
from inference_pool import DNS_SUBDOMAIN, Group, Kind, ObjectName, PortNumber, Strict, unique

SectionName = Annotated[
    str, StringConstraints(min_length=1, max_length=253, pattern=rf"^{DNS_SUBDOMAIN}$")
]
Namespace = Annotated[
    str, StringConstraints(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
]
Hostname = Annotated[
    str, StringConstraints(min_length=1, max_length=253, pattern=rf"^(\*\.)?{DNS_SUBDOMAIN}$")
]
# A protocol name (HTTP, HTTPS, TCP, ...) or a domain-prefixed one.
Protocol = Annotated[
    str,
    StringConstraints(
        min_length=1,
        max_length=255,
        pattern=rf"^[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?$|{DNS_SUBDOMAIN}\/[A-Za-z0-9]+$",
    ),
]
# Gateway API's duration: up to four units among h, m, s, ms ("0s", "1h30m").
Duration = Annotated[str, StringConstraints(pattern=r"^([0-9]{1,5}(h|m|s|ms)){1,4}$")]


class Listener(Strict):
    name: SectionName
    hostname: Optional[Hostname] = None
    port: PortNumber
    protocol: Protocol


class GatewaySpec(Strict):
    gatewayClassName: ObjectName
    listeners: Annotated[list[Listener], Field(min_length=1, max_length=64)]

    @field_validator("listeners")
    @classmethod
    def names_are_unique(cls, listeners):
        message = "Listener name must be unique within the Gateway"
        return unique(listeners, lambda listener: listener.name, message)


class Gateway(Strict):
    apiVersion: Literal["gateway.networking.k8s.io/v1"]
    kind: Literal["Gateway"]
    metadata: Optional[ObjectMeta] = None
    spec: GatewaySpec


class ParentReference(Strict):
    group: Group = "gateway.networking.k8s.io"
    kind: Kind = "Gateway"
    namespace: Optional[Namespace] = None
    name: ObjectName
    sectionName: Optional[SectionName] = None
    port: Optional[PortNumber] = None


class HTTPPathMatch(Strict):
    type: Literal["Exact", "PathPrefix", "RegularExpression"] = "PathPrefix"
    value: Annotated[str, StringConstraints(max_length=1024)] = "/"

    @model_validator(mode="after")
    def a_path_starts_with_a_slash(self):
        if self.type != "RegularExpression" and not self.value.startswith("/"):
            raise ValueError("value must be an absolute path and start with '/' (Exact, PathPrefix)")
        return self


class HTTPRouteMatch(Strict):
    path: Optional[HTTPPathMatch] = None


class HTTPBackendRef(Strict):
    group: Group = ""
    kind: Kind = "Service"
    name: ObjectName
    namespace: Optional[Namespace] = None
    port: Optional[PortNumber] = None
    weight: Annotated[int, Field(ge=0, le=1000000)] = 1

    @model_validator(mode="after")
    def service_needs_a_port(self):
        if self.group == "" and self.kind == "Service" and self.port is None:
            raise ValueError("Must have port for Service reference")
        return self


class HTTPRouteTimeouts(Strict):
    request: Optional[Duration] = None
    backendRequest: Optional[Duration] = None


class HTTPRouteRule(Strict):
    matches: Optional[Annotated[list[HTTPRouteMatch], Field(max_length=64)]] = None
    backendRefs: Optional[Annotated[list[HTTPBackendRef], Field(max_length=16)]] = None
    timeouts: Optional[HTTPRouteTimeouts] = None


class HTTPRouteSpec(Strict):
    parentRefs: Optional[Annotated[list[ParentReference], Field(max_length=32)]] = None
    hostnames: Optional[Annotated[list[Hostname], Field(max_length=16)]] = None
    rules: Optional[Annotated[list[HTTPRouteRule], Field(min_length=1, max_length=16)]] = None


class HTTPRoute(Strict):
    apiVersion: Literal["gateway.networking.k8s.io/v1"]
    kind: Literal["HTTPRoute"]
    metadata: Optional[ObjectMeta] = None
    spec: HTTPRouteSpec
