"""The Triton reconciler: a level-triggered controller loop, desired placements against what each
Triton has loaded, acted on through Triton's model-control API.

Desired: the placements in the database (``server.control.scaling.placement_store``: model version ->
a Triton, or ``*`` for every Triton). Observed: each Triton's repository index (which versions of
which model are READY). Every round, for every Triton the ``source`` names now (a fixed list, or a
headless Service's addresses: ``server.dataplane.replicas.DnsSource``):

* a model whose desired versions differ from its ready ones is loaded with a config naming exactly
  those versions (load-with-config: the placement's own config, else the repository's
  ``config.pbtxt``, with ``version_policy { specific { versions: [...] } }``) — Triton loads the new
  versions before it drops the old ones, so the model keeps serving through the change;
* a removed placement stays loaded for ``drain_s`` after its removal where it is loaded (requests
  routed to it before the switch finish) — never loaded afresh: a Triton that returns during the drain
  gets the placed versions only — then the model is loaded without it, or unloaded when it was the
  last one;
* a model the placements never named is left alone (``prune=True``: unloaded; for a Triton the
  reconciler owns outright);
* ``owns(model)`` limits the reconciler to some models: on a cluster one reconciler per model
  group (``for_groups``: the group's headless Service, the models the group serves), so a ``*``
  placement never loads a GPU group's model on the CPU group's pods.

One Triton's actions run concurrently, at most ``load_concurrency`` at a time (``INFERPLANE_LOAD_CONCURRENCY``;
unset: ``LOAD_CONCURRENCY``, half this host's cores, 1 on 2 cores, up to Triton's ``--model-load-thread-count``
threads, server.runtime.supervisor), so a late Triton's set loads in the time of its slowest model, not of their
sum. On a cluster the leader's cores say nothing of the Tritons' (the manifests set it to their 4 load threads).

Nothing is remembered between rounds but the Triton clients: a Triton that joins late, restarts
with nothing loaded, or was unreachable during a change converges on the next round by itself.
Every Triton reads the same repository (a shared folder here; ``s3://``/``gs://`` on a cluster,
which Triton reads natively), so a load needs no copy. The planning is pure (``plan_triton``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import fsspec
from google.protobuf import json_format, text_format

from server.control.scaling.executors import ModelGroups
from server.control.scaling.placement_store import Placement
from server.dataplane.replicas import DnsSource
from server.dataplane.triton_client import TritonClient
from server.errors import BackendUnavailable, InferplaneError
from server.protogen.inference import model_config_pb2
from server.runtime.supervisor import LOAD_CONCURRENCY

log = logging.getLogger(__name__)

READY = "READY"
LOAD, UNLOAD = "load", "unload"


@dataclass(frozen=True)
class Action:
    kind: str  # load | unload
    model: str
    versions: tuple[int, ...] = ()  # a load: the versions the model serves afterwards
    config: str | None = None  # the placement's own config (JSON), if it has one

    def __str__(self) -> str:
        return f"{self.kind} {self.model}" + (f" versions {list(self.versions)}" if self.kind == LOAD else "")


# ---- pure: desired and observed to actions ---------------------------------------------------------


def desired_on(
    placements: Iterable[Placement], triton: str, now: float, drain_s: float
) -> tuple[dict[str, set[int]], dict[str, str | None], set[str], dict[str, set[int]]]:
    """For one Triton: model -> versions to keep loaded (placed, or removed less than ``drain_s``
    ago), model -> its placement config (the newest live one's), every model placements name, and
    model -> the versions among the first that are draining (removed, kept only where loaded)."""
    versions: dict[str, set[int]] = {}
    draining: dict[str, set[int]] = {}
    live: dict[str, set[int]] = {}
    configs: dict[str, tuple[int, str | None]] = {}
    named: set[str] = set()
    for p in placements:
        if not p.applies_to(triton):
            continue
        named.add(p.model)
        if p.removed_at is not None and now - p.removed_at >= drain_s:
            continue
        versions.setdefault(p.model, set()).add(p.version)
        (live if p.removed_at is None else draining).setdefault(p.model, set()).add(p.version)
        if p.removed_at is None and p.generation >= configs.get(p.model, (-1, None))[0]:
            configs[p.model] = (p.generation, p.config)
    for model, removed in draining.items():
        removed -= live.get(model, set())  # also placed (on this Triton by name, say): not draining
    return versions, {m: c for m, (_, c) in configs.items()}, named, draining


def observed_versions(index: Iterable) -> tuple[dict[str, set[int]], set[str]]:
    """From a repository index: model -> READY versions, and the models busy (LOADING/UNLOADING)."""
    ready: dict[str, set[int]] = {}
    busy: set[str] = set()
    for entry in index:
        if entry.state == READY and entry.version.isdigit():
            ready.setdefault(entry.name, set()).add(int(entry.version))
        elif entry.state in ("LOADING", "UNLOADING"):
            busy.add(entry.name)
    return ready, busy


def plan_triton(
    desired: dict[str, set[int]], configs: dict[str, str | None], named: set[str], ready: dict[str, set[int]], busy: set[str] = frozenset(),
    *, prune: bool = False, draining: dict[str, set[int]] | None = None,
) -> list[Action]:  # fmt: skip
    """What one Triton must do to match ``desired`` (sorted, loads first); a ``draining`` version
    stays only where it is ready."""
    draining = draining or {}
    kept = {m: {v for v in vs if v not in draining.get(m, ()) or v in ready.get(m, ())} for m, vs in desired.items()}
    desired = {m: vs for m, vs in kept.items() if vs}
    actions = []
    for model in sorted(desired):
        if model not in busy and ready.get(model, set()) != desired[model]:
            actions.append(Action(LOAD, model, tuple(sorted(desired[model])), configs.get(model)))
    for model in sorted(ready):
        if model not in desired and model not in busy and (model in named or prune):
            actions.append(Action(UNLOAD, model))
    return actions


def load_config(base: model_config_pb2.ModelConfig, versions: Iterable[int]) -> str:
    """``base`` serving exactly ``versions``, as the JSON Triton's load-with-config takes."""
    config = model_config_pb2.ModelConfig()
    config.CopyFrom(base)
    config.ClearField("version_policy")
    config.version_policy.specific.versions.extend(sorted(versions))
    return json_format.MessageToJson(config)


# ---- the loop ------------------------------------------------------------------------------------


class StaticSource:
    """A fixed set of Triton gRPC targets (``--triton-url a:8001,b:8001``); ``add``/``discard`` change it."""

    def __init__(self, targets: Iterable[str] = ()):
        self._targets = set(targets)

    def add(self, target: str) -> None:
        self._targets.add(target)

    def discard(self, target: str) -> None:
        self._targets.discard(target)

    async def targets(self) -> set[str]:
        return set(self._targets)


@dataclass
class TritonState:
    """What the last round saw on one Triton (for status pages and tests)."""

    ready: dict[str, set[int]] = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)
    error: str | None = None
    seen_at: float | None = None


class TritonReconciler:
    def __init__(
        self, store, source, *, repository: str | Path, drain_s: float = 30.0, prune: bool = False,
        client_factory: Callable[[str], object] | None = None, clock: Callable[[], float] = time.time,
        load_timeout_s: float = 300.0, owns: Callable[[str], bool] = lambda model: True,
        load_concurrency: int = LOAD_CONCURRENCY, group: str = "",
    ):  # fmt: skip
        self.group = group  # the model group it converges ("" outside a cluster's groups)
        self.load_concurrency = max(1, load_concurrency)
        self.store = store  # server.control.scaling.placement_store.PlacementStore
        self.source = source  # anything with ``async targets() -> set[str]``: StaticSource, DnsSource
        self.repository = str(repository)
        self.drain_s = drain_s
        self.prune = prune
        self.load_timeout_s = load_timeout_s
        self.owns = owns
        self._client_factory = client_factory or _client
        self._clock = clock
        self._clients: dict[str, object] = {}
        self._round = asyncio.Lock()
        self.state: dict[str, TritonState] = {}

    def _client(self, target: str):
        client = self._clients.get(target)
        if client is None:
            client = self._clients[target] = self._client_factory(target)
        return client

    def repository_config(self, model: str) -> model_config_pb2.ModelConfig:
        """``REPOSITORY/MODEL/config.pbtxt``, read where Triton reads it (a folder or an fsspec URL)."""
        url = f"{self.repository.rstrip('/')}/{model}/config.pbtxt"
        with fsspec.open(url, "r", encoding="utf-8") as f:
            return text_format.Parse(f.read(), model_config_pb2.ModelConfig())

    def _config_for(self, action: Action) -> str:
        if action.config:
            base = json_format.Parse(action.config, model_config_pb2.ModelConfig())
        else:
            base = self.repository_config(action.model)
        return load_config(base, action.versions)

    async def reconcile_once(self) -> dict[str, list[Action]]:
        """One round over every Triton the source names now; returns the actions applied per Triton.
        Rounds never overlap: the loop's and one asked for now (a scale-up: the remote executor's) take turns."""
        async with self._round:
            return await self._round_once()

    async def converge(self, target: str) -> list[Action]:
        """One round on one Triton the source does not name yet (a warm pod a scale-up takes into the group:
        server.control.scaling.kube_warm_pool): what the group's Tritons have is loaded there. Raises
        ``BackendUnavailable`` when it is unreachable or an action fails, so the pod is not taken half-loaded."""
        async with self._round:
            actions = await self._reconcile(target, await asyncio.to_thread(self.store.all), self._clock())
        error = self.state[target].error
        if error is not None:
            raise BackendUnavailable(f"triton {target}: {error}")
        return actions

    async def _round_once(self) -> dict[str, list[Action]]:
        placements = await asyncio.to_thread(self.store.all)
        targets = sorted(await self.source.targets())
        for gone in set(self._clients) - set(targets):
            client = self._clients.pop(gone)
            self.state.pop(gone, None)
            await client.close()
        now = self._clock()
        results = await asyncio.gather(*(self._reconcile(t, placements, now) for t in targets))
        return dict(zip(targets, results))

    async def _reconcile(self, target: str, placements: list[Placement], now: float) -> list[Action]:
        state = self.state.setdefault(target, TritonState())
        client = self._client(target)
        desired, configs, named, draining = desired_on((p for p in placements if self.owns(p.model)), target, now, self.drain_s)
        try:
            ready, busy = observed_versions(await client.repository_index())
        except InferplaneError as err:  # down or restarting: the next round tries again
            state.error = f"unreachable: {err.message}"
            log.debug("triton %s: %s", target, state.error)
            return []
        state.ready, state.seen_at, state.error = ready, now, None
        gate = asyncio.Semaphore(self.load_concurrency)
        actions = plan_triton(desired, configs, named, ready, busy, prune=self.prune, draining=draining)
        done = await asyncio.gather(*(self._apply(target, client, action, gate) for action in actions))
        applied = [action for action, ok in zip(actions, done) if ok]
        state.applied = [str(a) for a in applied]
        return applied

    async def _apply(self, target: str, client: TritonClient, action: Action, gate: asyncio.Semaphore) -> bool:
        """One load or unload on one Triton (one action per model, so concurrent ones never race)."""
        async with gate:
            try:
                if action.kind == LOAD:
                    config = await asyncio.to_thread(self._config_for, action)
                    await client.load_model(action.model, timeout=self.load_timeout_s, config=config)
                else:
                    await client.unload_model(action.model)
            except (InferplaneError, OSError, json_format.ParseError, text_format.ParseError) as err:
                self.state[target].error = f"{action}: {getattr(err, 'message', err)}"
                log.warning("triton %s: %s failed: %s", target, action, self.state[target].error)
                return False
        log.info("triton %s: %s", target, action)
        return True

    async def run(self, stop_event: asyncio.Event, interval_s: float = 2.0) -> None:
        """Reconcile every ``interval_s`` until ``stop_event`` is set (a failed round is logged, not fatal)."""
        while not stop_event.is_set():
            try:
                await self.reconcile_once()
            except Exception:  # keep the loop alive: the next round starts from scratch
                log.exception("triton reconcile round failed")
            try:
                await asyncio.wait_for(stop_event.wait(), interval_s)
            except asyncio.TimeoutError:
                pass

    async def close(self) -> None:
        clients, self._clients = self._clients, {}
        for client in clients.values():
            await client.close()


def for_groups(groups, store, *, repository: str | Path, **kwargs) -> list[TritonReconciler]:
    """One reconciler per model group (``server.control.scaling.executors.ModelGroups``): its Tritons are the
    addresses of the group's headless Service, its models those the group serves (``*``: every model
    no other group names)."""
    return [
        TritonReconciler(store, DnsSource(spec["service"], spec["grpc_port"], group=name), repository=repository,
                         owns=lambda model, name=name: groups.serves(name, model), group=name, **kwargs)  # fmt: skip
        for name, spec in groups.groups.items()
    ]


def converger(reconcilers: Iterable[TritonReconciler]) -> Callable[[str, str], Awaitable[list[Action]]]:
    """``converge(group, target)`` over the groups' reconcilers (``for_groups``): a warm pool's loader."""
    by_group = {r.group: r for r in reconcilers}

    async def converge(group: str, target: str) -> list[Action]:
        return await by_group[group].converge(target)

    return converge


def from_settings(settings, store, **kwargs) -> list[TritonReconciler]:
    """The reconcilers of a control plane: one per model group (``model_groups_file``), else one over
    ``triton_url``'s Tritons; none without remote Tritons (the embedded Triton is the deployer's own).
    Set ``Deployer.placements`` to the same store, so what the deployer loads is what is placed."""
    kwargs = {**settings_kwargs(settings), **kwargs}
    if settings.model_groups_file:
        return for_groups(ModelGroups.load(settings.model_groups_file), store, **kwargs)
    if settings.triton_urls:
        return [TritonReconciler(store, StaticSource(settings.triton_urls), **kwargs)]
    return []


def settings_kwargs(settings) -> dict:
    """What a ``TritonReconciler`` takes from the settings: the repository, the drain and the load concurrency."""
    return {
        "repository": settings.model_repository_url or settings.model_repository, "drain_s": settings.reconcile_drain_s,
        "load_concurrency": settings.load_concurrency or LOAD_CONCURRENCY,
    }  # fmt: skip


def _client(target: str) -> TritonClient:
    c = TritonClient(target)
    c.connect()
    return c
