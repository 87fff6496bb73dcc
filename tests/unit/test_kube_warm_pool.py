"""A model group's warm pool on Kubernetes (server.control.scaling.kube_warm_pool) through the group executor,
against the local API-server stand-in of test_kubernetes_executor (pods listed by label selector, label
merge patches, deletes, the scale subresource). No real API server or ReplicaSet runs here: that the warm
Deployment's ReplicaSet releases a relabelled pod and starts a replacement is Kubernetes' documented
behaviour, checked here only as far as the relabelled pod leaving the warm selector."""

from __future__ import annotations

import json

import pytest

from server.control.scaling.executors import KubernetesGroupExecutor, ModelGroups
from server.control.scaling.kube_warm_pool import ADOPTION, KubeWarmPool, adopted_selector, pod_of, warm_selector
from server.errors import BackendUnavailable
from tests.unit.test_kubernetes_executor import SCALE_PATH, FakeApiServer, _executor, pod

GROUPS = ModelGroups({
    "general": {"service": "triton-general", "grpc_port": 8001, "models": ["*"]},
    "trees": {"service": "triton-trees", "grpc_port": 9001, "models": ["fraud"]},
})  # fmt: skip
WARM = {"app.kubernetes.io/name": "inferplane", "app.kubernetes.io/component": "triton-warm", "inferplane.io/model-group": "general",
        "pod-template-hash": "5d8f"}  # fmt: skip
ADOPTED = {**WARM, **ADOPTION}


class Converge:
    """Records each (group, target) and the pod's labels at that moment; ``fail``: targets whose loads fail."""

    def __init__(self, api: FakeApiServer, fail: set[str] = frozenset()):
        self.api, self.fail = api, fail
        self.calls: list[tuple[str, str, str]] = []

    async def __call__(self, group: str, target: str) -> None:
        (name,) = [n for n, p in self.api.pods.items() if f"{p['status']['podIP']}:" in target]
        self.calls.append((group, target, self.api.pods[name]["metadata"]["labels"]["app.kubernetes.io/component"]))
        if target in self.fail:
            raise BackendUnavailable(f"triton {target}: load fraud failed")


def _patches(api: FakeApiServer, path: str) -> list[dict]:
    return [json.loads(r["body"]) for r in api.requests if r["method"] == "PATCH" and r["path"] == path]


def test_pod_of_counts_only_running_ready_pods_with_an_address_not_terminating():
    assert pod_of(pod("a", WARM, "10.0.0.1")).ready
    assert not pod_of(pod("b", WARM, "10.0.0.1", ready=False)).ready
    assert not pod_of(pod("c", WARM, "")).ready
    assert not pod_of(pod("d", WARM, "10.0.0.1", phase="Pending")).ready
    terminating = pod_of(pod("e", WARM, "10.0.0.1", deleting=True))
    assert not terminating.ready and not terminating.alive
    assert pod_of(pod("f", WARM, "10.0.0.1", ready=False)).alive  # running, not ready: still a replica
    assert pod_of({}) == pod_of({"metadata": None, "status": None})  # nothing to read: not ready, not alive


def test_the_selectors_name_the_warm_and_the_adopted_pods_of_one_group():
    assert warm_selector("general") == "app.kubernetes.io/component=triton-warm,inferplane.io/model-group=general"
    assert adopted_selector("general") == "app.kubernetes.io/component=triton,inferplane.io/model-group=general,inferplane.io/adopted=true"


async def test_a_scale_up_loads_a_ready_warm_pod_then_relabels_it_into_the_group():
    pods = [pod("w-a", WARM, "10.0.0.5"), pod("w-b", WARM, "10.0.0.6", ready=False)]
    with FakeApiServer({"triton-general": 1}, pods=pods) as api:
        converge = Converge(api)
        executor = KubernetesGroupExecutor(_executor(api), GROUPS, KubeWarmPool(_executor(api), converge))
        assert await executor.read("any") == 1
        await executor.set_replicas("any", 2)
        # loaded while still warm (no Service selects it yet), on the group's gRPC port; the unready one untouched
        assert converge.calls == [("general", "10.0.0.5:8001", "triton-warm")]
        assert api.pods["w-a"]["metadata"]["labels"] == ADOPTED
        assert api.pods["w-b"]["metadata"]["labels"] == WARM
        assert _patches(api, "/api/v1/namespaces/inferplane/pods/w-a") == [{"metadata": {"labels": ADOPTION}}]
        assert _patches(api, SCALE_PATH.format(ns="inferplane", name="triton-general")) == []  # no pod started
        assert api.deployments["triton-general"] == 1
        assert executor.replicas("any") == 2 and await executor.read("any") == 2  # the Deployment's one plus the adopted one
        assert executor.describe()["warm_pools"] == {"general": {"warm_ready": [], "adopted": ["w-a"], "taken": 1, "failed": 0}}


async def test_a_scale_up_past_the_ready_warm_pods_scales_the_deployment_for_the_rest():
    pods = [pod("w-a", WARM, "10.0.0.5"), pod("w-b", WARM, "10.0.0.6"), pod("w-c", WARM, "10.0.0.7", deleting=True)]
    with FakeApiServer({"triton-general": 1}, pods=pods) as api:
        executor = KubernetesGroupExecutor(_executor(api), GROUPS, KubeWarmPool(_executor(api), Converge(api)))
        await executor.read("any")
        await executor.set_replicas("any", 5)
        assert {n for n, p in api.pods.items() if p["metadata"]["labels"] == ADOPTED} == {"w-a", "w-b"}
        assert api.pods["w-c"]["metadata"]["labels"] == WARM  # terminating: not taken
        assert api.deployments["triton-general"] == 3  # 1 + 2 more pods started; 2 taken warm
        assert _patches(api, SCALE_PATH.format(ns="inferplane", name="triton-general")) == [{"spec": {"replicas": 3}}]


async def test_a_warm_pod_whose_loads_fail_stays_in_the_pool_and_the_deployment_starts_one():
    with FakeApiServer({"triton-trees": 0}, pods=[pod("w-t", {**WARM, "inferplane.io/model-group": "trees"}, "10.0.0.8")]) as api:
        converge = Converge(api, fail={"10.0.0.8:9001"})
        pool = KubeWarmPool(_executor(api), converge)
        executor = KubernetesGroupExecutor(_executor(api), GROUPS, pool)
        await executor.set_replicas("fraud", 1)
        assert converge.calls == [("trees", "10.0.0.8:9001", "triton-warm")]
        assert api.pods["w-t"]["metadata"]["labels"]["app.kubernetes.io/component"] == "triton-warm"  # not taken half-loaded
        assert api.deployments["triton-trees"] == 1
        assert pool.describe()["trees"]["failed"] == 1 and pool.describe()["trees"]["taken"] == 0


async def test_a_scale_down_deletes_adopted_pods_first_then_lowers_the_deployment():
    pods = [pod("a-1", ADOPTED, "10.0.0.5"), pod("a-2", ADOPTED, "10.0.0.6", ready=False), pod("a-3", ADOPTED, "10.0.0.7", phase="Failed")]
    with FakeApiServer({"triton-general": 2}, pods=pods) as api:
        executor = KubernetesGroupExecutor(_executor(api), GROUPS, KubeWarmPool(_executor(api), Converge(api)))
        assert await executor.read("any") == 4  # a failed adopted pod is no replica
        await executor.set_replicas("any", 3)
        assert set(api.pods) == {"a-1", "a-3"}  # the unready one went first
        assert executor.describe()["warm_pools"]["general"]["adopted"] == ["a-1"]
        assert api.deployments["triton-general"] == 2 and _patches(api, SCALE_PATH.format(ns="inferplane", name="triton-general")) == []
        await executor.set_replicas("any", 1)
        assert set(api.pods) == {"a-3"}  # every adopted pod gone before the Deployment comes down
        assert api.deployments["triton-general"] == 1
        await executor.set_replicas("any", 0)
        assert api.deployments["triton-general"] == 0


async def test_without_the_pods_grant_the_group_scales_by_its_deployment_alone():
    with FakeApiServer({"triton-general": 1}, forbid={"pods"}) as api:
        executor = KubernetesGroupExecutor(_executor(api), GROUPS, KubeWarmPool(_executor(api), Converge(api)))
        assert await executor.read("any") == 1
        await executor.set_replicas("any", 3)
        assert api.deployments["triton-general"] == 3


@pytest.mark.parametrize("group", ["general", "trees"])
async def test_a_pool_of_another_group_is_never_taken(group):
    other = "trees" if group == "general" else "general"
    with FakeApiServer({GROUPS.groups[group]["service"]: 0}, pods=[pod("w-x", {**WARM, "inferplane.io/model-group": other}, "10.0.0.9")]) as api:
        converge = Converge(api)
        executor = KubernetesGroupExecutor(_executor(api), GROUPS, KubeWarmPool(_executor(api), converge))
        await executor.set_replicas("fraud" if group == "trees" else "any", 1)
        assert converge.calls == [] and api.pods["w-x"]["metadata"]["labels"]["app.kubernetes.io/component"] == "triton-warm"
        assert api.deployments[GROUPS.groups[group]["service"]] == 1
