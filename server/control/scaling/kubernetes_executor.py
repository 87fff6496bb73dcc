"""The Kubernetes executor of the autoscaler and deployer: a Deployment's replica count through the
scale subresource, and the pod calls a warm pool needs (``server.control.scaling.kube_warm_pool``).

    executor = KubernetesExecutor.from_settings(settings)
    n = await executor.get_replicas("triton-general")
    await executor.set_replicas("triton-general", n + 1)

``GET  /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale`` answers an ``autoscaling/v1``
``Scale`` (``spec.replicas`` is the desired count); ``PATCH`` on the same path with
``application/merge-patch+json`` and ``{"spec": {"replicas": n}}`` sets it. These are exactly what
the Role in ``deploy/base/control/rbac.yaml`` grants (``deployments/scale``: get, patch, update).
Kubernetes places and restarts the pods; this only says how many. A warm pool's calls: ``GET
/api/v1/namespaces/{ns}/pods?labelSelector=...`` (the raw ``PodList``), a merge patch of a pod's
``metadata.labels``, and a pod's ``DELETE`` (Role ``inferplane-warm-pods``: pods list, patch, delete).

The namespace is the one given, else ``settings.kubernetes_namespace``, else the pod's own
(the service-account file every pod gets). The ``kubernetes`` client is synchronous: its calls run
in a thread so the event loop never waits on the API server.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from server.errors import BackendUnavailable, InvalidRequest, ModelNotFound, PermissionDenied

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
MERGE_PATCH = "application/merge-patch+json"
FIELD_MANAGER = "inferplane-control-plane"


class ScaleForbidden(PermissionDenied):
    """The API server refused the call (RBAC): the service account lacks the Role's grant."""


def _namespace(namespace: str | None, settings=None, sa_file: Path = SERVICE_ACCOUNT_NAMESPACE) -> str:
    if namespace:
        return namespace
    configured = getattr(settings, "kubernetes_namespace", None) if settings is not None else None
    if configured:
        return configured
    try:
        text = sa_file.read_text().strip()
    except OSError:
        text = ""
    if not text:
        raise InvalidRequest(
            f"no Kubernetes namespace: pass one, set INFERPLANE_KUBERNETES_NAMESPACE, or run in a pod ({sa_file} is absent)"
        )
    return text


class KubernetesExecutor:
    def __init__(self, namespace: str | None = None, *, configuration=None, settings=None, sa_file: Path = SERVICE_ACCOUNT_NAMESPACE):
        from kubernetes import client, config

        if configuration is None:
            configuration = client.Configuration()
            try:
                config.load_incluster_config(client_configuration=configuration)
            except config.ConfigException:
                config.load_kube_config(client_configuration=configuration)
        self.namespace = _namespace(namespace, settings, sa_file)
        self._configuration = configuration
        self._api = client.AppsV1Api(client.ApiClient(configuration))
        self._core = client.CoreV1Api(client.ApiClient(configuration))

    @classmethod
    def from_settings(cls, settings, **kw) -> "KubernetesExecutor":
        return cls(settings=settings, **kw)

    async def get_replicas(self, deployment: str) -> int:
        """The desired replica count of ``deployment`` (its scale subresource's ``spec.replicas``)."""
        scale = await self._call(self._named("deployment", deployment), self._api.read_namespaced_deployment_scale, deployment, self.namespace)
        return int((scale.spec.replicas if scale.spec is not None else None) or 0)

    async def set_replicas(self, deployment: str, n: int) -> None:
        """Set the desired replica count of ``deployment`` to ``n`` (a merge patch of the scale subresource)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidRequest(f"replicas must be an integer >= 0, got {n!r}")
        await self._call(
            self._named("deployment", deployment),
            self._api.patch_namespaced_deployment_scale,
            deployment,
            self.namespace,
            {"spec": {"replicas": n}},
            field_manager=FIELD_MANAGER,
            _content_type=MERGE_PATCH,
        )

    async def list_pods(self, selector: str) -> list[dict]:
        """The pods ``selector`` (``key=value,...``) selects, as the API answers them (JSON objects)."""
        answer = await self._call(f"pods in {self.namespace}", self._core.list_namespaced_pod, self.namespace, label_selector=selector, _preload_content=False)
        return json.loads(answer.data).get("items") or []

    async def label_pod(self, pod: str, labels: dict[str, str | None]) -> None:
        """Set (or, with None, remove) labels of ``pod``: a merge patch of ``metadata.labels`` only."""
        await self._call(self._named("pod", pod), self._core.patch_namespaced_pod, pod, self.namespace, {"metadata": {"labels": labels}},
                         field_manager=FIELD_MANAGER, _content_type=MERGE_PATCH, _preload_content=False)  # fmt: skip

    async def delete_pod(self, pod: str) -> None:
        """Delete ``pod`` (its grace period: Triton finishes what it has, the frontends drain it)."""
        await self._call(self._named("pod", pod), self._core.delete_namespaced_pod, pod, self.namespace, _preload_content=False)

    def describe(self) -> dict:
        return {
            "executor": "kubernetes",
            "namespace": self.namespace,
            "api_server": self._configuration.host,
            "subresource": "apps/v1 deployments/scale",
            "patch": MERGE_PATCH,
            "field_manager": FIELD_MANAGER,
        }

    def _named(self, kind: str, name: str) -> str:
        """How errors name one object of this namespace ("deployment ns/name"); an empty name is refused here."""
        if not name:
            raise InvalidRequest(f"a {kind} name is required")
        return f"{kind} {self.namespace}/{name}"

    async def _call(self, where: str, method, *args, **kw):
        """``method(*args)`` in a thread; its API errors as domain errors that name ``where`` (what it acts on)."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return await asyncio.to_thread(method, *args, **kw)
        except ApiException as err:
            if err.status == 404:
                raise ModelNotFound(f"{where} does not exist") from None
            if err.status in (401, 403):
                raise ScaleForbidden(f"{where}: the API server refused ({err.status} {err.reason}); check the Role and RoleBinding") from None
            if err.status == 422 or err.status == 400:
                raise InvalidRequest(f"{where}: the API server rejected the request ({err.status}): {err.body}") from None
            raise BackendUnavailable(f"{where}: API server answered {err.status} {err.reason}", retry_after_s=1.0) from None
        except (OSError, HTTPError) as err:  # connection refused, DNS, TLS
            raise BackendUnavailable(f"Kubernetes API server unreachable: {err}", retry_after_s=1.0) from None
