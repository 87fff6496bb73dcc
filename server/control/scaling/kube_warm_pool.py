"""A model group's warm pool on Kubernetes (issue 29): idle Tritons a scale-up takes instead of starting a pod.

The pool is a Deployment of the group's own pod (``deploy/base/model-groups/general-warm``: same image,
resources, node selectors and zone spread, explicit model control, nothing loaded) whose pods are labelled
``app.kubernetes.io/component: triton-warm`` with the group's ``inferplane.io/model-group``: no Service, PDB
or Deployment of the group selects them. Taking one (``take``):

1. a ready warm pod (Running, Ready, an IP, not terminating) is loaded with what the group's Tritons
   serve — ``converge(group, "IP:PORT")``: one round of the group's own Triton reconciler on that address
   (server.control.service.reconciler), so exactly the placements the group's other pods have;
2. only then is it relabelled ``component: triton`` and ``inferplane.io/adopted: "true"`` (a merge patch of
   its labels): it joins the group's headless Service (frontends, the group's reconciler) already loaded,
   and it leaves the warm Deployment's selector, so that ReplicaSet releases it and starts a replacement —
   the refill is Kubernetes' own.

A pod whose loads fail (unreachable, a model that does not load) is left in the pool, and the scale-up
falls back to the group Deployment's scale subresource for that replica. An adopted pod belongs to no
controller: a scale-down deletes adopted pods first (``release``), before lowering the Deployment; a
rollout of the group's template does not replace them (they go at the next scale-down).

Only tested against an in-memory API server (tests/unit/test_kube_warm_pool.py): no real cluster here.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from server.errors import InferplaneError, ModelNotFound

log = logging.getLogger(__name__)

COMPONENT = "app.kubernetes.io/component"
GROUP = "inferplane.io/model-group"
ADOPTED = "inferplane.io/adopted"
WARM, SERVING = "triton-warm", "triton"
ADOPTION = {COMPONENT: SERVING, ADOPTED: "true"}  # the labels a taken pod gets: the group's Service selects it


@dataclass(frozen=True)
class Pod:
    name: str
    ip: str
    alive: bool  # Running and not terminating
    ready: bool  # alive, condition Ready, an IP


def pod_of(obj: dict) -> Pod:
    """A pod from the API's JSON (``metadata``, ``status``)."""
    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    ip = str(status.get("podIP") or "")
    alive = status.get("phase") == "Running" and not meta.get("deletionTimestamp")
    return Pod(str(meta.get("name") or ""), ip, alive, ready and alive and bool(ip))


def warm_selector(group: str) -> str:
    return f"{COMPONENT}={WARM},{GROUP}={group}"


def adopted_selector(group: str) -> str:
    return f"{COMPONENT}={SERVING},{GROUP}={group},{ADOPTED}=true"


class KubeWarmPool:
    def __init__(self, kubernetes, converge: Callable[[str, str], Awaitable[object]]):
        self.k8s = kubernetes  # server.control.scaling.kubernetes_executor.KubernetesExecutor: list_pods, label_pod, delete_pod
        self.converge = converge  # (group, "ip:port") -> loads what the group serves there; raises when a load fails
        self.seen: dict[str, dict[str, list[str]]] = {}  # group -> {"warm_ready": [...], "adopted": [...]} last listed
        self.taken: dict[str, int] = {}  # group -> warm pods taken into it here
        self.failed: dict[str, int] = {}  # group -> warm pods whose loads failed (left in the pool)

    async def _list(self, selector: str) -> list[Pod]:
        return [pod_of(o) for o in await self.k8s.list_pods(selector)]

    async def adopted(self, group: str) -> list[Pod]:
        """The group's adopted pods that run and are not terminating (a deleted or failed one no longer counts)."""
        alive = [p for p in await self._list(adopted_selector(group)) if p.alive]
        self.seen.setdefault(group, {})["adopted"] = sorted(p.name for p in alive)
        return alive

    async def ready(self, group: str) -> list[Pod]:
        pods = sorted((p for p in await self._list(warm_selector(group)) if p.ready), key=lambda p: p.name)
        self.seen.setdefault(group, {})["warm_ready"] = [p.name for p in pods]
        return pods

    async def take(self, group: str, n: int, port: int) -> int:
        """Take up to ``n`` ready warm pods into ``group`` (loaded first, then relabelled); returns how many."""
        taken: list[str] = []
        for pod in (await self.ready(group))[: max(0, n)]:
            try:
                await self.converge(group, f"{pod.ip}:{port}")
                await self.k8s.label_pod(pod.name, ADOPTION)
            except (InferplaneError, OSError) as err:
                self.failed[group] = self.failed.get(group, 0) + 1
                log.warning("warm pod %s not taken into group %s: %s", pod.name, group, getattr(err, "message", err))
                continue
            taken.append(pod.name)
            log.info("warm pod %s (%s) taken into group %s", pod.name, pod.ip, group)
        seen = self.seen[group]
        seen["warm_ready"] = [p for p in seen["warm_ready"] if p not in taken]
        seen["adopted"] = sorted({*seen.get("adopted", ()), *taken})
        self.taken[group] = self.taken.get(group, 0) + len(taken)
        return len(taken)

    async def release(self, group: str, pods: list[Pod], n: int) -> int:
        """Delete up to ``n`` of the group's adopted ``pods`` (not ready ones first); returns how many."""
        gone: list[str] = []
        for pod in sorted(pods, key=lambda p: (p.ready, p.name))[: max(0, n)]:
            try:
                await self.k8s.delete_pod(pod.name)
            except ModelNotFound:  # gone already
                pass
            except InferplaneError as err:
                log.warning("adopted pod %s of group %s not deleted: %s", pod.name, group, err.message)
                continue
            gone.append(pod.name)
        seen = self.seen.setdefault(group, {})
        seen["adopted"] = [p for p in seen.get("adopted", ()) if p not in gone]
        return len(gone)

    def describe(self) -> dict:
        return {
            group: {**{"warm_ready": [], "adopted": []}, **seen, "taken": self.taken.get(group, 0), "failed": self.failed.get(group, 0)}
            for group, seen in sorted(self.seen.items())
        }
