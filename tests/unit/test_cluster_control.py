"""``inferplane control run``'s loop: stored configs (a real SQLite registry), fleet-wide load from a
local server playing Prometheus's HTTP API (``/api/v1/query``, its documented vector answer), the
policy, and the Kubernetes executor's scale-subresource requests to a local API server, checked
field by field; a model group's Deployment gets the largest count any of its endpoints asks for."""

from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from server.control.registry.artifacts import ArtifactStore
from server.control.scaling.cluster import SIGNAL_QUERIES, ClusterAutoscaler, PrometheusSource
from server.control.scaling.executors import KubernetesGroupExecutor, ModelGroups
from server.control.registry.registry import Registry
from server.control.scaling.scaling_store import ScalingStore
from server.errors import BackendUnavailable, InvalidRequest
from tests.unit.test_kubernetes_executor import SCALE_PATH, FakeApiServer, _executor

GROUPS = {
    "general": {"service": "triton-general", "grpc_port": 8001, "models": ["*"]},
    "trees": {"service": "triton-trees", "grpc_port": 8001, "models": ["fraud", "churn"]},
}


class FakePrometheus:
    """Answers instant queries from a table (query -> value); records each query string."""

    def __init__(self, values: dict[str, float]):
        self.values = values
        self.queries: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                path, _, query = self.path.partition("?")
                q = urllib.parse.parse_qs(query).get("query", [""])[0]
                server.queries.append(q)
                if path != "/api/v1/query":
                    body, status = {"status": "error", "errorType": "bad_data", "error": "unknown path"}, 404
                elif q in server.values:
                    body = {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [1700000000.0, str(server.values[q])]}]}}
                    status = 200
                else:  # no series: an empty vector
                    body, status = {"status": "success", "data": {"resultType": "vector", "result": []}}, 200
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture
def registry(tmp_path):
    r = Registry(f"sqlite:///{tmp_path}/registry.db", ArtifactStore(tmp_path / "artifacts"))
    yield r
    r.close()


def q(signal: str, model: str) -> str:
    return SIGNAL_QUERIES[signal].format(m=model)


async def test_the_loop_scales_the_group_deployment_to_the_largest_ask(registry):
    store = ScalingStore(registry)
    store.put("fraud", {"min_replicas": 1, "max_replicas": 6, "target": 10, "scale_down_window_s": 0, "down_cooldown_s": 0}, "ci")
    store.put("churn", {"min_replicas": 1, "max_replicas": 6, "target": 10}, "ci")
    load = {q("inflight", "fraud"): 42.0, q("qps", "fraud"): 400.0, q("inflight", "churn"): 12.0, q("qps", "churn"): 90.0}
    clock = Clock()
    with FakeApiServer({"triton-trees": 1, "triton-general": 1}) as api, FakePrometheus(load) as prom:
        executor = KubernetesGroupExecutor(_executor(api), ModelGroups(GROUPS))
        source = PrometheusSource(prom.url)
        loop = ClusterAutoscaler(store, executor, source, clock=clock, wall=clock, lead_s=60)
        try:
            changes = await loop.tick()
            assert {(c["from"], c["to"]) for c in changes} == {(1, 5), (1, 2)}  # ceil(42/10), ceil(12/10)
            assert api.deployments == {"triton-trees": 5, "triton-general": 1}
            # the Prometheus queries, exactly
            assert set(prom.queries) == {q("inflight", "fraud"), q("qps", "fraud"), q("inflight", "churn"), q("qps", "churn")}
            # the scale subresource: read each endpoint's group once at start, then one merge patch of the max
            gets = [r for r in api.requests if r["method"] == "GET"]
            patches = [r for r in api.requests if r["method"] == "PATCH"]
            assert {r["path"] for r in gets} == {SCALE_PATH.format(ns="inferplane", name="triton-trees")}
            # endpoints in name order: churn asks 2 (a patch), then fraud 5 (the group's max: a patch)
            assert [json.loads(p["body"]) for p in patches] == [{"spec": {"replicas": 2}}, {"spec": {"replicas": 5}}]
            for p in patches:
                assert p["path"] == SCALE_PATH.format(ns="inferplane", name="triton-trees")
                assert p["headers"]["content-type"] == "application/merge-patch+json"
                assert "fieldManager=inferplane-control-plane" in p["query"]
                assert p["headers"]["authorization"] == "Bearer test-token"
            # the load goes away: fraud comes down (window 0, no cooldown) to churn's 2, never below
            load[q("inflight", "fraud")] = 0.0
            load[q("qps", "fraud")] = 0.0
            for _ in range(6):
                clock.t += 5
                await loop.tick()
            assert api.deployments["triton-trees"] == 2
            assert json.loads(api.requests[-1]["body"]) == {"spec": {"replicas": 2}}
        finally:
            await source.close()


async def test_scale_to_zero_patches_zero_and_load_brings_one_back(registry):
    store = ScalingStore(registry)
    store.put("fraud", {"min_replicas": 1, "max_replicas": 3, "target": 5, "scale_to_zero_after_s": 30, "scale_down_window_s": 5, "down_cooldown_s": 0}, "ci")
    load = {}
    clock = Clock()
    with FakeApiServer({"triton-trees": 1}) as api, FakePrometheus(load) as prom:
        loop = ClusterAutoscaler(store, KubernetesGroupExecutor(_executor(api), ModelGroups(GROUPS)), PrometheusSource(prom.url), clock=clock, wall=clock)
        try:
            for _ in range(8):  # no series at all: no load
                await loop.tick()
                clock.t += 5
            assert api.deployments["triton-trees"] == 0
            assert json.loads(api.requests[-1]["body"]) == {"spec": {"replicas": 0}}
            load[q("inflight", "fraud")] = 3.0  # the frontends hold a request for the group
            await loop.tick()
            assert api.deployments["triton-trees"] == 1
        finally:
            await loop.source.close()


async def test_prometheus_errors_are_unavailable():
    with FakePrometheus({}) as prom:
        source = PrometheusSource(prom.url + "/wrong")
        try:
            with pytest.raises(BackendUnavailable):
                await source._query("up")
        finally:
            await source.close()


def test_model_groups_file_is_validated(tmp_path):
    groups = ModelGroups(GROUPS)
    assert groups.group_of("fraud") == "trees" and groups.group_of("anything") == "general"
    with pytest.raises(InvalidRequest, match="service"):
        ModelGroups({"g": {"models": ["*"]}})
    with pytest.raises(InvalidRequest, match="only one model group"):
        ModelGroups({"a": {"service": "a", "models": ["*"]}, "b": {"service": "b", "models": ["*"]}})
    bad = tmp_path / "groups.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidRequest, match="cannot read"):
        ModelGroups.load(bad)


def test_control_run_once_reads_the_stored_configs_and_patches_the_group(registry, tmp_path):
    """The command the control-plane Deployment runs, as a process: kubeconfig, model groups file,
    registry and Prometheus from the environment (the manifests' INFERPLANE_* settings)."""
    import os
    import subprocess
    import sys

    ScalingStore(registry).put("fraud", {"min_replicas": 1, "max_replicas": 8, "target": 4}, "ci")
    groups = tmp_path / "model-groups.json"
    groups.write_text(json.dumps(GROUPS))
    load = {q("inflight", "fraud"): 17.0, q("qps", "fraud"): 100.0}
    with FakeApiServer({"triton-trees": 1}) as api, FakePrometheus(load) as prom:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": api.url}}],
            "users": [{"name": "test", "user": {"token": "test-token"}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
        }))  # fmt: skip
        env = dict(os.environ, KUBECONFIG=str(kubeconfig), INFERPLANE_MODEL_GROUPS_FILE=str(groups),
                   INFERPLANE_DATABASE_URL=registry.url, INFERPLANE_ARTIFACT_STORE=str(tmp_path / "artifacts"),
                   INFERPLANE_KUBERNETES_NAMESPACE="inferplane", INFERPLANE_PROMETHEUS_URL=prom.url)  # fmt: skip
        out = subprocess.run([sys.executable, "-m", "server.cli.main", "control", "run", "--executor", "kubernetes", "--once"],
                             capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    change = json.loads(out.stdout.splitlines()[0])
    assert (change["from"], change["to"], change["action"]) == (1, 5, "up")  # ceil(17 / 4)
    assert api.deployments == {"triton-trees": 5}
    patch = next(r for r in api.requests if r["method"] == "PATCH")
    assert json.loads(patch["body"]) == {"spec": {"replicas": 5}} and patch["headers"]["authorization"] == "Bearer test-token"
    assert "fraud: 5 replica(s)" in out.stdout
    # the group's warm pool was looked for (none here: the scale subresource alone; kube_warm_pool's own tests take one)
    lists = [r for r in api.requests if r["method"] == "GET" and r["path"] == "/api/v1/namespaces/inferplane/pods"]
    assert {urllib.parse.parse_qs(r["query"])["labelSelector"][0] for r in lists} >= {"app.kubernetes.io/component=triton-warm,inferplane.io/model-group=trees"}


def test_control_run_refuses_another_executor():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "server.cli.main", "control", "run", "--executor", "local", "--once"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "only 'kubernetes'" in out.stderr
