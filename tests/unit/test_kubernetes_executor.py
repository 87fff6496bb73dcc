"""The Kubernetes executor against a local HTTP server that plays the API server for exactly the
endpoints it may call (the scale subresource's GET and PATCH; a warm pool's pod list, label patch and
delete), with the documented shapes: ``autoscaling/v1`` ``Scale`` objects, ``v1`` ``PodList``,
``application/merge-patch+json`` bodies."""

from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from server.control.scaling.kubernetes_executor import MERGE_PATCH, KubernetesExecutor, ScaleForbidden, _namespace
from server.errors import BackendUnavailable, InvalidRequest, ModelNotFound

from kubernetes import client  # noqa: E402

SCALE_PATH = "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"


def _scale(name: str, ns: str, replicas: int, status: int | None = None) -> dict:
    return {
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {"name": name, "namespace": ns, "uid": "6f1c2a2e-0000-4000-8000-000000000001", "resourceVersion": "4242"},
        "spec": {"replicas": replicas},
        "status": {"replicas": replicas if status is None else status, "selector": "app.kubernetes.io/component=triton"},
    }


def pod(name: str, labels: dict, ip: str = "10.0.0.9", *, phase: str = "Running", ready: bool = True, deleting: bool = False) -> dict:
    """A ``v1`` Pod as the API answers it (the fields the warm pool reads)."""
    meta = {"name": name, "namespace": "inferplane", "labels": dict(labels), "uid": f"uid-{name}", "resourceVersion": "1"}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-07T09:00:00Z"
    status = {"phase": phase, "podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    return {"kind": "Pod", "apiVersion": "v1", "metadata": meta, "spec": {"containers": [{"name": "triton"}]}, "status": status}


def _selected(selector: str, labels: dict) -> bool:
    """An equality-based label selector (``a=b,c=d``), the only form the executor sends."""
    return all(labels.get(k) == v for k, _, v in (term.partition("=") for term in selector.split(",") if term))


def _merge(target: dict, patch: dict) -> None:
    """RFC 7386 merge patch: null removes a key."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict):
            _merge(target.setdefault(key, {}), value)
        else:
            target[key] = value


class FakeApiServer:
    """Deployments by name -> replicas, pods by name -> Pod objects; records every request (method, path,
    query, headers, body). ``forbid``: names (deployments, or "pods" for every pod call) answered 403."""

    def __init__(self, deployments: dict[str, int], namespace: str = "inferplane", forbid: set[str] = frozenset(), pods: list[dict] = ()):
        self.deployments = dict(deployments)
        self.pods = {p["metadata"]["name"]: p for p in pods}
        self.namespace = namespace
        self.forbid = forbid
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                path, _, query = self.path.partition("?")
                server.requests.append(
                    {"method": method, "path": path, "query": query, "headers": {k.lower(): v for k, v in self.headers.items()}, "body": raw}
                )
                parts = path.split("/")
                if parts[1:4] == ["api", "v1", "namespaces"] and len(parts) in (6, 7) and parts[5] == "pods":
                    return self._pods(method, parts[4], parts[6] if len(parts) == 7 else None, query, raw)
                # /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale
                if len(parts) != 9 or parts[1:5] != ["apis", "apps", "v1", "namespaces"] or parts[6:9:2] != ["deployments", "scale"]:
                    return self._answer(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404})
                ns, name = parts[5], parts[7]
                if name in server.forbid:
                    return self._answer(403, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403,
                                              "message": f'deployments.apps "{name}" is forbidden'})  # fmt: skip
                if ns != server.namespace or name not in server.deployments:
                    return self._answer(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404,
                                              "message": f'deployments.apps "{name}" not found'})  # fmt: skip
                if method == "PATCH":
                    if self.headers.get("Content-Type") != MERGE_PATCH:
                        return self._answer(415, {"kind": "Status", "status": "Failure", "code": 415})
                    patch = json.loads(raw)
                    server.deployments[name] = patch["spec"]["replicas"]
                self._answer(200, _scale(name, ns, server.deployments[name]))

            def _pods(self, method: str, ns: str, name: str | None, query: str, raw: bytes) -> None:
                # /api/v1/namespaces/{ns}/pods?labelSelector=...  and  /api/v1/namespaces/{ns}/pods/{name}
                if "pods" in server.forbid:
                    return self._answer(403, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403,
                                              "message": 'pods is forbidden: User cannot list resource "pods"'})  # fmt: skip
                if ns != server.namespace or (name is not None and name not in server.pods):
                    return self._answer(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404,
                                              "message": f'pods "{name}" not found'})  # fmt: skip
                if name is None and method == "GET":
                    selector = urllib.parse.parse_qs(query).get("labelSelector", [""])[0]
                    items = [p for p in server.pods.values() if _selected(selector, p["metadata"]["labels"])]
                    return self._answer(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "7"}, "items": items})
                if method == "PATCH" and name is not None:
                    if self.headers.get("Content-Type") != MERGE_PATCH:
                        return self._answer(415, {"kind": "Status", "status": "Failure", "code": 415})
                    _merge(server.pods[name], json.loads(raw))
                    return self._answer(200, server.pods[name])
                if method == "DELETE" and name is not None:
                    return self._answer(200, server.pods.pop(name))
                self._answer(405, {"kind": "Status", "status": "Failure", "code": 405})

            def do_GET(self):
                self._handle("GET")

            def do_DELETE(self):
                self._handle("DELETE")

            def do_PATCH(self):
                self._handle("PATCH")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def _executor(api: FakeApiServer, namespace: str = "inferplane") -> KubernetesExecutor:
    configuration = client.Configuration()
    configuration.host = api.url
    configuration.api_key = {"BearerToken": "test-token"}
    configuration.api_key_prefix = {"BearerToken": "Bearer"}
    return KubernetesExecutor(namespace, configuration=configuration)


async def test_get_replicas_reads_the_scale_subresource():
    with FakeApiServer({"triton-general": 3}) as api:
        n = await _executor(api).get_replicas("triton-general")
    assert n == 3
    (req,) = api.requests
    assert req["method"] == "GET"
    assert req["path"] == "/apis/apps/v1/namespaces/inferplane/deployments/triton-general/scale"
    assert req["body"] == b""
    assert req["headers"]["authorization"] == "Bearer test-token"
    assert "application/json" in req["headers"]["accept"]


async def test_set_replicas_sends_a_merge_patch_of_spec_replicas_only():
    with FakeApiServer({"triton-general": 1}) as api:
        executor = _executor(api)
        await executor.set_replicas("triton-general", 5)
        assert await executor.get_replicas("triton-general") == 5
    patch, get = api.requests
    assert patch["method"] == "PATCH"
    assert patch["path"] == SCALE_PATH.format(ns="inferplane", name="triton-general")
    assert patch["headers"]["content-type"] == "application/merge-patch+json"
    body = json.loads(patch["body"])
    assert body == {"spec": {"replicas": 5}}  # nothing else: no metadata, no status
    assert type(body["spec"]["replicas"]) is int
    assert "fieldManager=inferplane-control-plane" in patch["query"]
    assert api.deployments["triton-general"] == 5
    assert get["method"] == "GET"


async def test_scale_to_zero_is_a_patch_of_zero():
    with FakeApiServer({"triton-general": 2}) as api:
        await _executor(api).set_replicas("triton-general", 0)
    assert json.loads(api.requests[0]["body"]) == {"spec": {"replicas": 0}}
    assert api.deployments["triton-general"] == 0


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True, None])
async def test_bad_replica_counts_are_refused_before_any_request(bad):
    with FakeApiServer({"triton-general": 2}) as api:
        with pytest.raises(InvalidRequest, match="replicas must be an integer"):
            await _executor(api).set_replicas("triton-general", bad)
    assert api.requests == []


async def test_api_errors_become_domain_errors_naming_the_deployment():
    with FakeApiServer({"triton-general": 2}, forbid={"triton-secret"}) as api:
        executor = _executor(api)
        with pytest.raises(ModelNotFound, match="inferplane/triton-missing does not exist"):
            await executor.get_replicas("triton-missing")
        with pytest.raises(ScaleForbidden, match="403"):
            await executor.set_replicas("triton-secret", 1)
    assert api.deployments == {"triton-general": 2}


async def test_unreachable_api_server_is_unavailable_with_a_retry_hint():
    with FakeApiServer({}) as api:
        url = api.url
    configuration = client.Configuration()
    configuration.host = url  # closed now
    configuration.retries = 0
    executor = KubernetesExecutor("inferplane", configuration=configuration)
    with pytest.raises(BackendUnavailable) as info:
        await executor.get_replicas("triton-general")
    assert info.value.retry_after_s == 1.0


POD_LABELS = {"app.kubernetes.io/component": "triton-warm", "inferplane.io/model-group": "general"}


async def test_list_pods_sends_the_label_selector_and_answers_the_pods_json():
    pods = [pod("warm-a", POD_LABELS, "10.0.0.5"), pod("other", {"app.kubernetes.io/component": "frontend"})]
    with FakeApiServer({}, pods=pods) as api:
        listed = await _executor(api).list_pods("app.kubernetes.io/component=triton-warm,inferplane.io/model-group=general")
    assert [p["metadata"]["name"] for p in listed] == ["warm-a"] and listed[0]["status"]["podIP"] == "10.0.0.5"
    (req,) = api.requests
    assert req["method"] == "GET" and req["path"] == "/api/v1/namespaces/inferplane/pods"
    assert urllib.parse.parse_qs(req["query"])["labelSelector"] == ["app.kubernetes.io/component=triton-warm,inferplane.io/model-group=general"]


async def test_label_pod_merge_patches_the_labels_only_and_delete_pod_deletes_it():
    with FakeApiServer({}, pods=[pod("warm-a", POD_LABELS)]) as api:
        executor = _executor(api)
        await executor.label_pod("warm-a", {"app.kubernetes.io/component": "triton", "gone": None})
        assert api.pods["warm-a"]["metadata"]["labels"] == {"app.kubernetes.io/component": "triton", "inferplane.io/model-group": "general"}
        await executor.delete_pod("warm-a")
        assert api.pods == {}
        with pytest.raises(ModelNotFound, match="pod inferplane/warm-a does not exist"):
            await executor.delete_pod("warm-a")
    patch, delete, _ = api.requests
    assert patch["method"] == "PATCH" and patch["path"] == "/api/v1/namespaces/inferplane/pods/warm-a"
    assert patch["headers"]["content-type"] == MERGE_PATCH and "fieldManager=inferplane-control-plane" in patch["query"]
    assert json.loads(patch["body"]) == {"metadata": {"labels": {"app.kubernetes.io/component": "triton", "gone": None}}}
    assert delete["method"] == "DELETE" and delete["path"] == "/api/v1/namespaces/inferplane/pods/warm-a"


async def test_pods_refused_by_rbac_are_forbidden():
    with FakeApiServer({}, forbid={"pods"}) as api:
        with pytest.raises(ScaleForbidden, match="pods in inferplane: the API server refused \\(403"):
            await _executor(api).list_pods("a=b")


def test_namespace_from_argument_settings_or_service_account_file(tmp_path):
    class S:
        kubernetes_namespace = "from-settings"

    sa = tmp_path / "namespace"
    assert _namespace("given", S(), sa) == "given"
    assert _namespace(None, S(), sa) == "from-settings"
    sa.write_text("from-pod\n")
    assert _namespace(None, None, sa) == "from-pod"
    sa.unlink()
    with pytest.raises(InvalidRequest, match="no Kubernetes namespace"):
        _namespace(None, None, sa)


def test_describe_names_namespace_api_server_and_patch_type():
    configuration = client.Configuration()
    configuration.host = "https://10.0.0.1:443"
    d = KubernetesExecutor("team-a", configuration=configuration).describe()
    assert d == {
        "executor": "kubernetes",
        "namespace": "team-a",
        "api_server": "https://10.0.0.1:443",
        "subresource": "apps/v1 deployments/scale",
        "patch": "application/merge-patch+json",
        "field_manager": "inferplane-control-plane",
    }
