"""The Kubernetes API spoken directly (issue 27): the pod's service-account token and the cluster CA, over aiohttp.

Two users, both in the namespace the platform runs in:

* the control plane's leader election on a ``coordination.k8s.io/v1`` Lease
  (``server.control.service.kube_lease``; Role ``inferplane-leader-lease`` in deploy/base/control/rbac.yaml);
* the frontends' discovery of Triton pods with their zones from ``discovery.k8s.io/v1`` EndpointSlices
  (``EndpointSliceSource`` below; Role ``inferplane-read-endpointslices`` in deploy/base/frontend/rbac.yaml):
  a DNS answer carries no zone, an EndpointSlice names each endpoint's ``zone``, so the locality routing
  (server.dataplane.locality_policy) prefers the Tritons of the frontend's own zone.

``ClusterAccess.from_dir`` reads a service-account folder (``token``, ``ca.crt``, ``namespace``: the
automounted one, or a projected volume laid out the same way) and the API server's address from the
``KUBERNETES_SERVICE_HOST``/``_PORT`` variables every pod gets. The token is read again for every call
(the kubelet rotates projected tokens). Each call opens its own HTTP session: the calls are seconds apart.

Never run against a real API server here (no ``kube-apiserver`` ships in a package this project can
install): tests/unit/test_kube_api.py checks the parsing and the lease arithmetic, not an API server.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


class KubeError(Exception):
    """The API server answered an error (``status``: its HTTP status; 0: it could not be reached)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status


class Conflict(KubeError):
    """409: the object changed since the ``resourceVersion`` sent (or it exists already, on create)."""


class NotFound(KubeError):
    """404: no such object."""


@dataclass(frozen=True)
class ClusterAccess:
    api: str  # https://10.96.0.1:443
    token_file: Path
    ca_file: Path | None
    namespace: str

    @classmethod
    def from_dir(cls, folder: Path = SERVICE_ACCOUNT_DIR, namespace: str | None = None, env: Mapping[str, str] = os.environ) -> "ClusterAccess":
        host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise KubeError(0, "KUBERNETES_SERVICE_HOST is not set: not in a Kubernetes pod")
        if not namespace:
            try:
                namespace = (folder / "namespace").read_text().strip()
            except OSError:
                namespace = ""
        if not namespace:
            raise KubeError(0, f"no namespace: set INFERPLANE_KUBERNETES_NAMESPACE or mount {folder / 'namespace'}")
        host = f"[{host}]" if ":" in host else host
        ca = folder / "ca.crt"
        return cls(f"https://{host}:{port}", folder / "token", ca if ca.exists() else None, namespace)


class KubeAPI:
    def __init__(self, access: ClusterAccess, timeout_s: float = 5.0):
        self.access = access
        self.timeout_s = timeout_s
        self._ssl = ssl.create_default_context(cafile=str(access.ca_file)) if access.ca_file is not None else None

    @property
    def namespace(self) -> str:
        return self.access.namespace

    async def request(self, method: str, path: str, body: dict | None = None) -> dict:
        token = self.access.token_file.read_text().strip()
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        url = self.access.api.rstrip("/") + path
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as session:
                async with session.request(method, url, data=None if body is None else json.dumps(body), headers=headers, ssl=self._ssl) as answer:
                    text = await answer.text()
                    status = answer.status
        except (aiohttp.ClientError, TimeoutError, OSError) as err:
            raise KubeError(0, f"{method} {path}: {type(err).__name__}: {err}") from None
        if status >= 400:
            raise _error(status, f"{method} {path}: {_message(text)}")
        return json.loads(text) if text else {}

    async def get(self, path: str) -> dict:
        return await self.request("GET", path)

    async def create(self, path: str, body: dict) -> dict:
        return await self.request("POST", path, body)

    async def replace(self, path: str, body: dict) -> dict:
        """PUT: refused with Conflict unless ``body.metadata.resourceVersion`` is the object's current one."""
        return await self.request("PUT", path, body)


def _error(status: int, message: str) -> KubeError:
    return {409: Conflict, 404: NotFound}.get(status, KubeError)(status, message)


def _message(text: str) -> str:
    try:
        return str(json.loads(text).get("message", text))[:300]
    except (ValueError, AttributeError):
        return text[:300]


# ---- EndpointSlices: the Triton pods of a Service and their zones ------------------------------------


def slice_targets(slices: list[dict], port: int) -> dict[str, str]:
    """``{"addr:port": zone}`` for every ready endpoint of the slices (zone '' where the slice names none).

    ``conditions.ready`` absent counts as ready (the API's rule); a terminating or unready pod is left out,
    as a headless Service's DNS leaves it out."""
    out: dict[str, str] = {}
    for item in slices:
        for endpoint in item.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            zone = str(endpoint.get("zone") or "")
            for address in endpoint.get("addresses") or []:
                out[f"[{address}]:{port}" if ":" in address else f"{address}:{port}"] = zone
    return out


def service_of(name: str, namespace: str) -> tuple[str, str]:
    """(service, namespace) of a group's Service name: ``svc``, ``svc.ns`` or ``svc.ns.svc.cluster.local``."""
    parts = name.split(".")
    return parts[0], parts[1] if len(parts) > 1 and parts[1] else namespace


@dataclass
class EndpointSliceSource:
    """A Service's ready pods as replica members, with their zones (``zones``: target -> zone), listed
    from its EndpointSlices on every discovery round — the same interface as
    ``server.dataplane.replicas.DnsSource``. When the API server does not answer (or refuses: RBAC), the
    round asks ``fallback`` (the group's DnsSource: the same pods, zones as last known) or, without one,
    keeps the last members: discovery never depends on the API server, only the zones do."""

    name: str  # the group's Service (triton-general, or triton-general.NAMESPACE)
    port: int
    group: str
    capacity: str
    api: KubeAPI
    fallback: object | None = None  # anything with ``async targets() -> set[str]``: the group's DnsSource
    zones: dict[str, str] = field(default_factory=dict)

    def path(self) -> str:
        service, namespace = service_of(self.name, self.api.namespace)
        selector = urllib.parse.quote(f"{SERVICE_NAME_LABEL}={service}", safe="")
        return f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices?labelSelector={selector}"

    async def targets(self) -> set[str]:
        try:
            listed = await self.api.get(self.path())
        except KubeError as err:
            if self.fallback is None:
                log.warning("listing the EndpointSlices of %s failed (%s): its members stay as they were", self.name, err)
                return set(self.zones)
            log.warning("listing the EndpointSlices of %s failed (%s): its members from DNS this round", self.name, err)
            targets = await self.fallback.targets()
            self.zones = {t: self.zones.get(t, "") for t in targets}
            return targets
        self.zones = slice_targets(listed.get("items") or [], self.port)
        return set(self.zones)
