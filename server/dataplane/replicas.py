"""A replica set: N Tritons behind the surface the data plane uses from one ``TritonClient``.

``ReplicaSet`` offers ``infer_raw``, ``stream_raw``, ``unary_raw``, ``model_config``,
``repository_index``, ``load_model``, ``unload_model``, ``server_live``, ``server_ready``,
``close`` and ``target``, over members that are each a ``TritonClient`` (a local child
``tritonserver``, a remote URL, a pod behind a headless Service) or anything with its surface.
Coalescing and the fair queue sit above it in the pipeline, so they stay per model across
replicas; this is the one hop that picks the replica.

**Choice.** Among the members serving the model (up, not ejected, the model ready there and not
being drained from there): least outstanding requests with power-of-two choices (two members at
random, the one with fewer requests in flight; on a tie the random one — slow members are the
latency ejection's business), except that an idle member (nothing outstanding) is always taken
over a busy one: with as few admission slots as replicas (a model of one instance and no batching),
plain two-choice sends a request to a busy replica while another idles half the time at four
replicas, which ``python -m loadtest.autoscale`` measured as capacity lost. When every such member is
ejected, the ejected ones are used rather than none (a panic threshold of zero). An LLM generation
(``stream_raw(..., affinity=key)``, the key a hash of the prompt's first characters) is placed by
``batching.route_policy`` instead, under the set's ``llm_routing`` or the endpoint's own
(``routing_of``): ``prefix_aware`` (rendezvous hashing of the key over the members, bounded by
each member's streams of the model and its engine's KV utilisation, which the generation reports
from each final ``info`` through :meth:`ReplicaStream.report_kv`), ``round_robin``, or
``least_outstanding`` (the choice above). ``snapshot()`` shows each member's last KV utilisation
and why its LLM streams went there (``routed``: affinity, spill, fallback, turn).

**Health.** Every ``health_interval_s`` each member is probed (``ServerLive``) and its ready models
read (``RepositoryIndex``); a member that does not answer is down until it does, then it
*rejoins*: the models it should host (``wanted``) are loaded on it again before it takes traffic.
**Outlier ejection**: ``eject_failures`` consecutive backend failures, a connection-level failure
(refused, reset), or a latency EWMA above ``latency_outlier_factor`` x the median of the other
members serving the model eject a member for ``eject_s`` (doubling on repeats, up to 30 s); never
more than ``max_ejected_fraction`` of the members for latency.

**Retry.** A request that failed with UNAVAILABLE *before Triton started it* goes once to another
member within its deadline. ``server.dataplane.triton_client`` tells the cases apart from grpc's
own status details: ``NotSent`` — no connection could be made (grpc fails such a call without
writing it: "failed to connect to all addresses", "Connection refused") or Triton refused it up
front (the model is not there or not ready on that member; a ``NOT_FOUND`` "Request for unknown
model" from a member the set thought hosted it counts the same); ``ConnectionLost`` — the
connection broke under a written call ("Socket closed", "Connection reset", GOAWAY), so Triton may
have started it. A unary ModelInfer lost that way is retried too (``retry_lost``, on by default):
the connection, and with a killed process its work, is gone, and the models served here are pure
functions of their inputs, so the only cost is computing the answer twice if the member somehow
survived; with no other member serving the model it is held for what replaces the lost one (a
standby taking its place, its restart), as a new request would be, and so is a call whose only
member refused its connection (the process died before the call reached it). Streams are retried only before
their first message reached a member. Every other error
(Triton's own answer, a deadline) is the caller's answer.

**Draining.** ``drain(member, model)`` stops new requests for the model going there and returns
once the ones in flight there finished; ``remove_member`` drains the whole member first. A
scale-down therefore loses nothing.

**Held requests.** With no member serving the model (a replica restarting, a group scaled to zero)
a request waits for one, up to the endpoint's budget (``wait_budget(model)``) and its own deadline,
then fails ``MODEL_NOT_READY`` with a retry hint; ``on_missing(model)`` is told (the autoscaler wakes
a scaled-to-zero endpoint).

**Capacity.** ``model_config(name)`` answers for the set: the instance count is the sum over the
members serving the model, so the pipeline's admission slots and the coalescer's in-flight calls
grow with the replicas (``on_change`` tells the wiring when to read the signature again).

Members come from ``add_member`` (local replicas, a static URL list) and from discovery sources
(``DnsSource``: a headless Service's name re-resolved every few seconds through an injectable
resolver). The set-level circuit breaker of the pipeline stays keyed by ``target`` (the set as a
whole); per-member health is this module's.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import random
import socket
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from batching import route_policy
from server.dataplane import capacity_policy, stage_timing
from server.dataplane.backend import DOWN as DOWN_STATE, EXITING, LIVE, Backend, BackendStream, typed_call
from server.dataplane.backend_errors import EXITING_MARKERS, ConnectionLost, NotSent, refused_connection
from server.dataplane.batch_codec import CODEC
from server.dataplane.capacity_policy import TRAFFIC
from server.dataplane.locality_policy import local_first
from server.dataplane.wire import request_model
from server.errors import BackendError, BackendUnavailable, DeadlineExceeded, InferplaneError, ModelNotFound, ModelNotReady
from server.periodic import stop_tasks
from server.protogen.inference import grpc_service_pb2 as pb

# the member that answered this task's last call (its target), for traces; "" before any
SERVED_BY: contextvars.ContextVar[str] = contextvars.ContextVar("inferplane_served_by", default="")

log = logging.getLogger(__name__)

UP, DOWN, DRAINING = "up", "down", "draining"
_UNKNOWN_MODEL = "Request for unknown model"
_BEST_STATE = {"READY": 3, "LOADING": 2, "UNLOADING": 1}


@dataclass(frozen=True)
class ReplicaPolicy:
    health_interval_s: float = 1.0
    health_timeout_s: float = 1.0
    down_after_probes: int = 2  # consecutive failed probes before a member is down
    eject_failures: int = 3
    eject_s: float = 2.0
    max_eject_s: float = 30.0
    latency_outlier_factor: float = 3.0
    latency_floor_s: float = 0.05  # a member is never a latency outlier below this EWMA
    latency_min_samples: int = 20
    max_ejected_fraction: float = 0.5
    wait_for_member_s: float = 10.0  # default hold for a model no member serves (per endpoint: wait_budget)
    retry_lost: bool = True
    drain_timeout_s: float = 30.0
    discovery_interval_s: float = 5.0
    ewma_alpha: float = 0.1
    # LLM generations (streams opened with an ``affinity`` key): batching.route_policy's policy,
    # unless the endpoint names its own (``routing_of``)
    llm_routing: str = route_policy.PREFIX_AWARE
    route_bounds: route_policy.RouteBounds = route_policy.RouteBounds()
    kv_stale_s: float = 10.0  # a member's last reported KV utilisation counts this long
    zone: str = ""  # the frontend's zone: its requests prefer members there (server.dataplane.locality_policy)
    zone_spill_outstanding: int = 8  # ... while one of them has fewer in flight than this


class Member:
    """One Triton of the set and what the set knows about it."""

    def __init__(
        self, member_id: str, client: Backend, *, group: str = "", source: str = "", local: bool = False, zone: str = "",
        capacity: str = capacity_policy.ON_DEMAND,
    ):  # fmt: skip
        self.id = member_id
        self.client = client
        self.group = group
        self.zone = zone  # its failure domain (--zone; topology.kubernetes.io/zone on Kubernetes); '' unknown
        self.capacity = capacity_policy.parse_capacity(capacity)  # on_demand | spot (preemptible: server.dataplane.capacity_policy)
        self.reclaimed = 0  # reclaim notices it drained for (its Triton said it is exiting)
        self.exiting = False  # draining for one now
        self.source = source  # the discovery source that found it ('' for members added by hand)
        self.local = local
        self.state = UP
        self.models: set[str] = set()  # ready there (its repository index, and loads through the set)
        self.draining_models: set[str] = set()
        self.wanted: set[str] = set()  # loaded there through the set: loaded again when it rejoins
        self.outstanding = 0
        self.by_model: dict[str, int] = {}
        self.failures = 0  # consecutive backend failures
        self.failed_probes = 0
        self.ejected_until = 0.0
        self.ejections = 0
        self.latency: dict[str, float] = {}  # EWMA seconds per model
        self.samples: dict[str, int] = {}
        self.served = 0
        self.errors = 0
        self.last_success = -1e18  # on the set's clock
        self.rejoining: asyncio.Task | None = None
        self.probing = False
        self.changes = 0  # loads and unloads through the set: a probe that overlapped one is stale
        self.kv: dict[str, tuple[float, float]] = {}  # model -> (KV utilisation its engine last reported, when)
        self.routed: dict[str, int] = {}  # LLM streams sent here, by why (route_policy: affinity, spill, ...)
        self.backends: frozenset[str] = frozenset({"python"})  # Triton backends it has (observed: server.control.registry.backend_configs)
        self.gpus = 0  # GPUs it sees

    @property
    def target(self) -> str:
        return self.client.target

    def serves(self, model: str, now: float, ejected_ok: bool = False) -> bool:
        return (
            self.state == UP
            and model in self.models
            and model not in self.draining_models
            and (ejected_ok or now >= self.ejected_until)
        )

    def snapshot(self, now: float) -> dict:
        return {
            "id": self.id, "target": self.target, "group": self.group, "zone": self.zone, "capacity": self.capacity, "local": self.local,
            "state": self.state, "reclaimed": self.reclaimed,
            "ejected_for_s": max(0.0, self.ejected_until - now), "ejections": self.ejections,
            "models": sorted(self.models), "draining": sorted(self.draining_models), "wanted": sorted(self.wanted),
            "outstanding": self.outstanding, "served": self.served, "errors": self.errors,
            "latency_ms": {m: round(v * 1000, 3) for m, v in sorted(self.latency.items())},
            "kv_utilization": {m: v for m, (v, _at) in sorted(self.kv.items())}, "routed": dict(sorted(self.routed.items())),
            "backends": sorted(self.backends), "gpus": self.gpus,
        }  # fmt: skip


class ReplicaSet:
    def __init__(
        self,
        members: Iterable[Member] = (),
        *,
        name: str = "replica-set",
        policy: ReplicaPolicy = ReplicaPolicy(),
        client_factory: Callable[[str], Backend] | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        codec=None,
    ):
        self.name = name
        self.codec = codec  # the members' batch codec when they are not reached over gRPC (batch_codec)
        self.policy = policy
        self._clock = clock
        self._rng = rng or random.Random()
        self._client_factory = client_factory
        self._members: dict[str, Member] = {}
        self._list: list[Member] = []
        self.placement: dict[str, list[str]] = {}  # model -> member ids that should host it (unset: every member)
        self.everywhere: set[str] = set()  # models loaded on every member (joining members get them too)
        self.placer: Callable[[str], list[str] | None] | None = None  # picks members for a model with no placement
        self.wait_budget: Callable[[str], float | None] = lambda model: None
        self.routing_of: Callable[[str], str | None] = lambda model: None  # an endpoint's own LLM routing policy
        self.spot_ok: Callable[[str], bool] = lambda model: False  # the endpoint lets real-time traffic use spot replicas
        self._turns: dict[str, int] = {}  # round robin's position, by model
        self.on_missing: Callable[[str], None] | None = None
        self.on_change: Callable[[set[str]], None] | None = None
        self.waiting: dict[str, int] = {}  # requests held for a member, by model
        self.retries = 0
        self.retried_lost = 0
        self._changed = asyncio.Event()
        self._sources: list[DnsSource] = []
        self._tasks: list[asyncio.Task] = []
        for member in members:
            self._add(member)

    # ---- membership ---------------------------------------------------------------------------

    @property
    def target(self) -> str:
        return self.name

    def members(self) -> list[Member]:
        return list(self._list)

    def member(self, member_id: str) -> Member:
        try:
            return self._members[member_id]
        except KeyError:
            raise ModelNotFound(f"no replica '{member_id}' in {self.name}") from None

    def _add(self, member: Member) -> None:
        if member.id in self._members:
            raise ValueError(f"replica '{member.id}' is already a member of {self.name}")
        self._members[member.id] = member
        self._list = list(self._members.values())
        self._notify(set(member.models))

    async def add_member(self, member: Member, *, probe: bool = True) -> Member:
        """Join a member; with ``probe`` its ready models are read first (and the set's
        everywhere-models loaded on it) so it takes traffic only for what it has."""
        if probe:
            member.state = DOWN
            self._add(member)
            await self._probe(member)
        else:
            self._add(member)
        return member

    async def remove_member(self, member_id: str, *, drain: bool = True, close: bool = True) -> None:
        member = self._members.get(member_id)
        if member is None:
            return
        if drain:
            member.state = DRAINING
            await self._drained(member, None)
        self._members.pop(member_id, None)
        self._list = list(self._members.values())
        for ids in self.placement.values():
            if member_id in ids:
                ids.remove(member_id)
        self._notify(set(member.models))
        if close:
            with contextlib.suppress(Exception):
                await member.client.close()

    def mark_down(self, member_id: str) -> None:
        """The member's process died (its supervisor says so): no traffic until it rejoins."""
        member = self._members.get(member_id)
        if member is not None and member.state != DOWN:
            member.state, member.exiting = DOWN, False
            models, member.models = member.models, set()
            self._notify(models)

    def reclaim(self, member_id: str) -> None:
        """The member's Triton is exiting (SIGTERM with a notice period before the SIGKILL: a spot
        reclaim, a pod terminating): it takes nothing new from now on — what it has in flight it
        finishes (Triton does), and a request it can no longer answer goes to another member
        (``NotSent``/``ConnectionLost`` retries). It serves again once it rejoins (restarted)."""
        member = self._members.get(member_id)
        if member is None or member.exiting or member.state != UP:
            return
        member.state, member.exiting = DRAINING, True
        member.reclaimed += 1
        log.warning("replica %s (%s, %s) is exiting: drained for its reclaim notice", member.id, member.target, member.capacity)
        self._notify(set(member.models))

    def revive(self, member_id: str) -> None:
        """Back in the rotation at once, empty: the caller loads its models itself (a lone
        replica's restart, where the data plane reloads every model)."""
        member = self.member(member_id)
        member.state, member.failures, member.failed_probes, member.ejected_until = UP, 0, 0, 0.0
        self._notify(set())

    def replace_client(self, member_id: str, client) -> None:
        """The member is reached on a new channel: it came back on another address (a restarted local Triton on
        new ports, a standby in its place), or its restarted process on the same one (Fleet.reconnect)."""
        member = self.member(member_id)
        old, member.client = member.client, client
        asyncio.get_running_loop().create_task(_close_later(old))

    def add_source(self, source: "DnsSource") -> None:
        self._sources.append(source)

    def serving(self, model: str) -> list[Member]:
        now = self._clock()
        return [m for m in self._list if m.serves(model, now)]

    def hosting_count(self, model: str) -> int:
        return sum(1 for m in self._list if m.state == UP and model in m.models and model not in m.draining_models)

    # ---- lifecycle ----------------------------------------------------------------------------

    def connect(self) -> None:
        """Nothing to connect: each member's client is connected when it joins (``Backend`` parity)."""

    def start(self) -> None:
        """The health checks (and discovery, when there are sources); needs a running loop."""
        if not self._tasks:
            self._tasks.append(asyncio.create_task(self._health_forever(), name=f"{self.name}-health"))
            if self._sources:
                self._tasks.append(asyncio.create_task(self._discover_forever(), name=f"{self.name}-discovery"))

    async def close(self) -> None:
        await stop_tasks(self._tasks)
        self._tasks = []
        for member in list(self._list):
            if member.rejoining is not None:
                member.rejoining.cancel()
            await _close_quietly(member.client)

    # ---- choice -------------------------------------------------------------------------------

    def _choose(self, model: str, exclude: Member | None = None, affinity: str | None = None) -> Member | None:
        """``affinity``: an LLM generation's prefix key (None for every other request)."""
        now = self._clock()
        candidates = self._eligible(model, [m for m in self._list if m is not exclude and m.serves(model, now)])
        if not candidates:  # everyone serving it is ejected: better them than nobody
            candidates = self._eligible(model, [m for m in self._list if m is not exclude and m.serves(model, now, ejected_ok=True)])
            if not candidates:
                return None
        candidates = local_first(candidates, self.policy.zone, self.policy.zone_spill_outstanding)
        if len(candidates) == 1:
            return candidates[0]
        if affinity is not None:
            chosen = self._route(model, candidates, affinity, now)
            if chosen is not None:
                return chosen
        idle = [m for m in candidates if not m.outstanding]
        if idle and len(idle) < len(candidates):  # never a busy replica while one is idle
            return idle[0] if len(idle) == 1 else self._rng.choice(idle)
        a, b = self._rng.sample(candidates, 2)
        if a.outstanding != b.outstanding:
            return a if a.outstanding < b.outstanding else b
        return a  # a tie: the random pick (ordering ties by latency starves whoever measured slower once)

    def _eligible(self, model: str, candidates: list[Member]) -> list[Member]:
        """The candidates this task's traffic class may use (``server.dataplane.capacity_policy``)."""
        spot_hosts = sum(1 for m in self._list if m.capacity == capacity_policy.SPOT and (model in m.wanted or model in m.models))
        if not spot_hosts:  # no spot capacity for the model: every class goes anywhere
            return candidates
        spot_ok = False
        with contextlib.suppress(Exception):
            spot_ok = bool(self.spot_ok(model))
        return capacity_policy.eligible(candidates, TRAFFIC.get(), spot_ok=spot_ok, spot_hosts=spot_hosts)

    def routing(self, model: str) -> str:
        """The LLM routing policy for ``model``: the endpoint's own, else the set's."""
        own = None
        with contextlib.suppress(Exception):
            own = self.routing_of(model)
        if own:
            with contextlib.suppress(ValueError):
                return route_policy.parse_policy(own)
        return self.policy.llm_routing

    def _route(self, model: str, candidates: list[Member], affinity: str, now: float) -> Member | None:
        """An LLM stream's member by ``batching.route_policy`` (None: the set's own choice)."""
        policy = self.routing(model)
        if policy == route_policy.LEAST_OUTSTANDING or (policy == route_policy.PREFIX_AWARE and not affinity):
            return None
        loads = []
        for m in candidates:
            kv, at = m.kv.get(model, (None, 0.0))
            loads.append(route_policy.Load(m.id, m.by_model.get(model, 0), kv if kv is not None and now - at <= self.policy.kv_stale_s else None))
        if policy == route_policy.ROUND_ROBIN:
            turn = self._turns.get(model, 0)
            self._turns[model] = turn + 1
            i, why = route_policy.choose_round_robin(turn, loads)
        else:
            i, why = route_policy.choose_prefix_aware(affinity, loads, self.policy.route_bounds)
        member = candidates[i]
        member.routed[why] = member.routed.get(why, 0) + 1
        return member

    def report_kv(self, member: Member, model: str, utilisation: float) -> None:
        """What ``member``'s engine for ``model`` last said of its KV cache (0..1)."""
        with contextlib.suppress(TypeError, ValueError):
            member.kv[model] = (min(1.0, max(0.0, float(utilisation))), self._clock())

    async def _member_for(self, model: str, deadline: float | None, exclude: Member | None = None, affinity: str | None = None) -> Member:
        member = self._choose(model, exclude, affinity)
        if member is not None:
            return member
        return await self._wait_for_member(model, deadline, exclude, affinity)

    async def wait_for(self, model: str, timeout: float | None = None) -> Member:
        """A member serving ``model``, once there is one (held like a request, within its budget)."""
        return await self._member_for(model, None if timeout is None else self._clock() + timeout)

    async def _wait_for_member(self, model: str, deadline: float | None, exclude: Member | None, affinity: str | None = None) -> Member:
        """Hold the request until a member serves ``model`` (a restart, a wake, a scale-up)."""
        budget = self.wait_budget(model)
        budget = self.policy.wait_for_member_s if budget is None else budget
        start = self._clock()
        until = start + budget
        if deadline is not None and deadline < until:
            until = deadline
        if self.on_missing is not None:
            with contextlib.suppress(Exception):
                self.on_missing(model)
        self.waiting[model] = self.waiting.get(model, 0) + 1
        try:
            while True:
                member = self._choose(model, exclude, affinity)
                if member is not None:
                    return member
                left = until - self._clock()
                if left <= 0:
                    if deadline is not None and deadline <= start + budget:
                        raise DeadlineExceeded(f"no replica served model '{model}' before the request's deadline")
                    raise ModelNotReady(
                        f"no replica serves model '{model}' yet (waited {self._clock() - start:.1f}s)", retry_after_s=max(1.0, budget / 4)
                    )
                event = self._changed
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(event.wait(), min(left, 0.25))
        finally:
            self.waiting[model] -= 1

    def _notify(self, models: set[str]) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        if models and self.on_change is not None:
            with contextlib.suppress(Exception):
                self.on_change(set(models))

    # ---- the data plane's surface -------------------------------------------------------------

    # ---- what the data plane's coalescer calls (batching/coalescer.py) ----------------------

    def batch_codec(self):
        """How a merged batch travels to the members: the members' own codec (one in-process Triton:
        the callers' buffers), else one serialized ModelInferRequest."""
        if self.codec is not None:
            return self.codec
        return CODEC

    async def send_batch(self, payload, timeout: float | None, request: pb.ModelInferRequest | None = None):
        """A lone request's bytes or a merged batch (``request``: the first member, parsed) to one member."""
        return await self.infer_raw(payload, timeout, model=request.model_name if request is not None else "", parsed=request)

    async def infer_raw(self, request: bytes, timeout: float | None = None, *, model: str = "", parsed=None) -> bytes:
        """``parsed``: given by :meth:`send_batch`, the member's own ``send_batch`` takes the call."""
        model = model or request_model(request)
        deadline = None if timeout is None else self._clock() + timeout
        member = self._choose(model) or await self._wait_for_member(model, deadline, None)
        stage_timing.replica_chosen()
        client = member.client
        try:
            return await self._send(member, request, _left(deadline, self._clock()) if deadline is not None else None, model, parsed)
        except InferplaneError as err:
            if not self._retryable(err):
                raise
            failed = err
        refused: set[str] = set()
        while True:
            other = await self._another(model, member, client, failed, deadline)
            if other.id in refused:  # every member it could go to refused it
                raise failed
            client = other.client
            try:
                return await self._send(other, request, None if deadline is None else _left(deadline, self._clock()), model, parsed)
            except InferplaneError as again:
                # refused up front there too (the model left it as well: a scale-down, an unload): the
                # refusal took the model off that member, so the call goes on to another one
                if not _refused(again):
                    raise
                refused |= {member.id, other.id}
                member, failed = other, again

    async def _another(self, model: str, member: Member, client, err: InferplaneError, deadline: float | None) -> Member:
        """The member a call goes to that ``err`` failed on ``member``'s connection ``client`` (before Triton
        started it, or lost); raises ``err`` when there is none."""
        left = None if deadline is None else deadline - self._clock()
        if left is not None and left <= 0:
            raise err
        other = self._choose(model, exclude=member)
        if other is None and (isinstance(err, ConnectionLost) or refused_connection(err.message)):
            # the only replica's process died under the call, or before it (its port refused the
            # connection, so nothing was sent): hold it for what replaces it (a standby taking
            # its place, its restart), as a request arriving now is held
            other = await self._wait_for_replacement(model, deadline, member, client, err)
        elif other is None:
            if not _refused(err):
                raise err
            # the only replica said it does not serve the model (any more): hold the request for
            # one that does (a wake, a rejoin), as for a model no replica serves
            other = await self._wait_for_member(model, deadline, None)
        self.retries += 1
        if isinstance(err, ConnectionLost):
            self.retried_lost += 1
        log.info("retrying a request for %s on replica %s after %s failed: %s", model, other.id, member.id, err.message)
        return other

    async def _wait_for_replacement(self, model: str, deadline: float | None, lost: Member, client, err: InferplaneError) -> Member:
        """A member for a call ``lost``'s connection (``client``) dropped, when no other serves the
        model: another member, or ``lost`` once it is not that connection any more (its client
        replaced: a standby took its place; or it was down since: restarted). Held like a request
        for a model no member serves (its wait budget, the deadline). A member that stays up on the
        same connection past a few health intervals was not dead: the call goes to it again."""
        budget = self.wait_budget(model)
        until = self._clock() + (self.policy.wait_for_member_s if budget is None else budget)
        if deadline is not None and deadline < until:
            until = deadline
        same_until = self._clock() + max(1.0, 3 * self.policy.health_interval_s)
        was_down = False
        while True:
            was_down = was_down or lost.state != UP
            member = self._choose(model)
            if member is not None and (member is not lost or member.client is not client or was_down or self._clock() >= same_until):
                return member
            left = until - self._clock()
            if left <= 0:
                raise err
            event = self._changed
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), min(left, 0.25))

    def _retryable(self, err: InferplaneError) -> bool:
        if isinstance(err, NotSent):
            return True
        if isinstance(err, ConnectionLost):
            return self.policy.retry_lost
        return isinstance(err, ModelNotFound) and err.message.startswith(_UNKNOWN_MODEL)

    async def _send(self, member: Member, request, timeout: float | None, model: str, parsed=None) -> bytes:
        member.outstanding += 1
        member.by_model[model] = member.by_model.get(model, 0) + 1
        SERVED_BY.set(member.target)
        started = time.perf_counter()
        client = member.client
        try:
            if parsed is not None:
                answer = await client.send_batch(request, timeout, parsed)
            else:
                answer = await client.infer_raw(request, timeout, model=model)
        except InferplaneError as err:
            if member.client is client:  # a failure on a client it has replaced since (a standby took over) says nothing of it now
                self._failed(member, model, err)
            raise
        else:
            self._succeeded(member, model, time.perf_counter() - started)
            return answer
        finally:
            member.outstanding -= 1
            member.by_model[model] -= 1

    def _succeeded(self, member: Member, model: str, seconds: float) -> None:
        member.failures = 0
        member.served += 1
        member.last_success = self._clock()
        old = member.latency.get(model)
        a = self.policy.ewma_alpha
        member.latency[model] = seconds if old is None else (1 - a) * old + a * seconds
        member.samples[model] = member.samples.get(model, 0) + 1

    def _failed(self, member: Member, model: str, err: InferplaneError) -> None:
        member.errors += 1
        if any(marker in err.message.lower() for marker in EXITING_MARKERS):  # SIGTERM: drained now, not at the next probe
            self.reclaim(member.id)
            return
        if _refused(err):
            if model in member.models:  # Triton says it does not serve it (any more): stop sending it there
                member.models.discard(model)
                self._notify({model})
            return
        if isinstance(err, (NotSent, ConnectionLost)):
            member.failures += 1
            self._eject(member, f"connection failure: {err.message}")
            return
        if isinstance(err, (BackendUnavailable, BackendError)) and not isinstance(err, ModelNotReady):
            member.failures += 1
            if member.failures >= self.policy.eject_failures:
                self._eject(member, f"{member.failures} consecutive failures ({err.message})")

    def _eject(self, member: Member, why: str) -> None:
        now = self._clock()
        if now < member.ejected_until:
            return
        member.ejections += 1
        span = min(self.policy.max_eject_s, self.policy.eject_s * (2 ** min(member.ejections - 1, 8)))
        member.ejected_until = now + span
        log.warning("replica %s (%s) ejected for %.1fs: %s", member.id, member.target, span, why)

    def stream_raw(
        self, timeout: float | None = None, metadata: tuple | None = None, *, model: str = "", affinity: str | None = None
    ) -> "ReplicaStream":
        """``metadata``: e.g. a traced generation's traceparent, sent on the member's stream.
        ``affinity``: an LLM generation's prefix key (``batching.route_policy.prefix_key``; "" when
        it has none): the member is chosen by the LLM routing policy (:meth:`routing`)."""
        return ReplicaStream(self, timeout, model, metadata, affinity)

    async def unary_raw(self, method: str, request: bytes, timeout: float | None = 30.0) -> bytes:
        if method == "ModelStatistics":
            return await self._statistics(request, timeout)
        if method == "RepositoryIndex":
            ask = pb.RepositoryIndexRequest.FromString(request)
            return pb.RepositoryIndexResponse(models=await self.repository_index(ask.ready)).SerializeToString()
        if method in ("ModelMetadata", "ModelConfig", "ModelReady"):
            name = request_model(request)
            members = self._hosts_first(name)
        else:
            members = [m for m in self._list if m.state == UP] or list(self._list)
        return await self._first_answer(members, lambda m: m.client.unary_raw(method, request, timeout=timeout))

    async def _first_answer(self, members: list[Member], call):
        if not members:
            raise BackendUnavailable(f"{self.name} has no replica that is up", retry_after_s=1.0)
        error = None
        for member in members:
            try:
                return await call(member)
            except InferplaneError as err:
                error = err
                if not (isinstance(err, (BackendUnavailable, ModelNotFound))):
                    raise
        raise error

    def _hosts_first(self, name: str) -> list[Member]:
        now = self._clock()
        hosting = [m for m in self._list if m.serves(name, now, ejected_ok=True)]
        wanting = [m for m in self._list if m not in hosting and name in m.wanted and m.state == UP]
        rest = [m for m in self._list if m not in hosting and m not in wanting and m.state == UP]
        return hosting + wanting + rest

    async def _statistics(self, request: bytes, timeout: float | None) -> bytes:
        """Triton's statistics summed over the members (each member's own are its Triton's)."""
        ask = pb.ModelStatisticsRequest.FromString(request)
        members = [m for m in self._list if m.state == UP]
        if ask.name:
            members = [m for m in members if ask.name in m.models] or members
        answers, error = [], None
        for member in members:
            try:
                answers.append(pb.ModelStatisticsResponse.FromString(await member.client.unary_raw("ModelStatistics", request, timeout=timeout)))
            except InferplaneError as err:
                error = err
        if not answers:
            raise error or BackendUnavailable(f"{self.name} has no replica that is up", retry_after_s=1.0)
        return merge_statistics(answers).SerializeToString()

    async def model_config(self, name: str, version: str = ""):
        """The model's config as the set serves it: instance counts summed over its replicas."""
        members = self._hosts_first(name)
        config = await self._first_answer(members, lambda m: m.client.model_config(name, version))
        copies = self.hosting_count(name)
        if copies > 1:
            config = type(config).FromString(config.SerializeToString())
            if not config.instance_group:
                config.instance_group.add(count=copies)
            else:
                for group in config.instance_group:
                    group.count = max(1, group.count) * copies
        return config

    async def model_metadata(self, name: str, version: str = "") -> pb.ModelMetadataResponse:
        return await typed_call(self.unary_raw, "ModelMetadata", pb.ModelMetadataRequest(name=name, version=version), pb.ModelMetadataResponse)

    async def model_statistics(self, name: str = "", version: str = "") -> pb.ModelStatisticsResponse:
        """Triton's statistics summed over the members."""
        ask = pb.ModelStatisticsRequest(name=name, version=version)
        return await typed_call(self.unary_raw, "ModelStatistics", ask, pb.ModelStatisticsResponse, 5.0)

    async def repository_index(self, ready_only: bool = False) -> list:
        members = [m for m in self._list if m.state == UP]
        if not members:
            raise BackendUnavailable(f"{self.name} has no replica that is up", retry_after_s=1.0)
        merged: dict[tuple[str, str], object] = {}
        error = None
        answered = 0
        for member in members:
            try:
                entries = await member.client.repository_index(ready_only)
            except InferplaneError as err:
                error = err
                continue
            answered += 1
            for entry in entries:
                key = (entry.name, entry.version)
                best = merged.get(key)
                if best is None or _BEST_STATE.get(entry.state, 0) > _BEST_STATE.get(best.state, 0):
                    merged[key] = entry
        if not answered:
            raise error
        return [merged[k] for k in sorted(merged)]

    async def load_model(self, name: str, timeout: float = 300.0, *, config: str | None = None) -> None:
        """Load ``name`` on the members placed for it (every member without a placement); members
        that are down get it when they rejoin."""
        ids = self.placement.get(name)
        if ids is None and self.placer is not None:
            ids = self.placer(name)
            if ids is not None:
                self.placement[name] = list(ids)
        if ids is None:
            self.everywhere.add(name)
            targets = list(self._list)
        else:
            targets = [self._members[i] for i in ids if i in self._members]
        for member in targets:
            member.wanted.add(name)
        live = [m for m in targets if m.state != DOWN]
        if not live:
            raise BackendUnavailable(f"no replica of {self.name} is up to load model '{name}'", retry_after_s=1.0)
        results = await asyncio.gather(*(self.load_on(m.id, name, timeout, config=config) for m in live), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise failures[0]

    async def load_on(self, member_id: str, name: str, timeout: float = 300.0, *, config: str | None = None) -> None:
        """Load ``name`` on one member; it takes requests for the model once Triton says ready."""
        member = self.member(member_id)
        member.wanted.add(name)
        member.changes += 1
        if config is None:
            await member.client.load_model(name, timeout)
        else:
            await member.client.load_model(name, timeout, config=config)
        member.draining_models.discard(name)
        member.changes += 1
        if name not in member.models:
            member.models.add(name)
        self._notify({name})

    async def unload_model(self, name: str, timeout: float = 60.0) -> None:
        """Drain ``name`` from every member that has it, then unload it there."""
        self.placement.pop(name, None)
        self.everywhere.discard(name)
        members = [m for m in self._list if name in m.models or name in m.wanted]
        if not members:
            members = [m for m in self._list if m.state == UP]
        results = await asyncio.gather(*(self.unload_from(m.id, name, timeout) for m in members), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures and len(failures) == len(results):
            raise failures[0]

    async def unload_from(self, member_id: str, name: str, timeout: float = 60.0, *, drain: bool = True) -> None:
        member = self.member(member_id)
        member.wanted.discard(name)
        ids = self.placement.get(name)
        if ids is not None and member_id in ids:
            ids.remove(member_id)
        if drain:
            await self.drain(member_id, name)
        try:
            if member.state != DOWN:
                await member.client.unload_model(name, timeout)
        finally:
            member.changes += 1
            member.models.discard(name)
            member.draining_models.discard(name)
            self._notify({name})

    async def drain(self, member_id: str, model: str | None = None, timeout: float | None = None) -> bool:
        """No new requests (for ``model``, or at all) to the member; True once its in-flight ones
        finished (False: ``timeout`` passed first)."""
        member = self.member(member_id)
        if model is None:
            member.state = DRAINING
        else:
            member.draining_models.add(model)
        self._notify({model} if model else set(member.models))
        return await self._drained(member, model, timeout)

    async def _drained(self, member: Member, model: str | None, timeout: float | None = None) -> bool:
        until = self._clock() + (self.policy.drain_timeout_s if timeout is None else timeout)
        while (member.by_model.get(model, 0) if model else member.outstanding) > 0:
            if self._clock() >= until:
                log.warning("replica %s: drain of %s timed out with requests in flight", member.id, model or "everything")
                return False
            await asyncio.sleep(0.01)
        return True

    async def server_live(self, timeout: float = 1.0) -> bool:
        for member in self._list:
            if member.state != DOWN and await member.client.server_live(timeout):
                return True
        return False

    async def liveness(self, timeout: float = 1.0) -> str:
        return LIVE if await self.server_live(timeout) else DOWN_STATE

    async def server_ready(self, timeout: float = 1.0) -> bool:
        for member in self._list:
            if member.state != DOWN and await member.client.server_ready(timeout):
                return True
        return False

    # ---- health ---------------------------------------------------------------------------

    async def _health_forever(self) -> None:
        while True:
            await asyncio.sleep(self.policy.health_interval_s)
            try:
                await self.check_health()
            except Exception:  # the health loop must outlive anything one round does
                log.exception("replica health round failed")

    async def check_health(self) -> None:
        """One round: probe every member, then look for latency outliers."""
        await asyncio.gather(*(self._probe(m) for m in list(self._list) if m.rejoining is None))
        self._latency_outliers()

    async def rejoin(self, member_id: str) -> bool:
        """Probe a member now (its process restarted) and wait until it rejoined; True when it is up."""
        member = self.member(member_id)
        while member.probing:  # a health round's probe in flight (perhaps on the connection before the restart): after it
            await asyncio.sleep(0.01)
        if member.rejoining is None:
            await self._probe(member)
        if member.rejoining is not None:
            await asyncio.shield(member.rejoining)
        return member.state == UP

    async def _probe(self, member: Member) -> None:
        if member.probing:
            return
        member.probing = True
        try:
            await self._probe_once(member)
        finally:
            member.probing = False

    async def _probe_once(self, member: Member) -> None:
        client = member.client
        found = await client.liveness(self.policy.health_timeout_s)
        if found == EXITING:  # SIGTERM (a spot reclaim's notice, a pod terminating): drain it now
            self.reclaim(member.id)
            return
        live = found == LIVE
        if live and member.exiting:  # it came back without its process dying (or the probe missed the death): rejoin
            member.exiting = False
            member.state, member.models = DOWN, set()
        if not live:
            member.failed_probes += 1
            # a probe that times out on a busy replica that just answered requests says nothing; a
            # local replica's death is its supervisor's to report (it sees the process exit)
            answering = self._clock() - member.last_success < 3 * self.policy.health_interval_s
            if member.state == UP and member.failed_probes >= self.policy.down_after_probes and not member.local and not answering:
                log.warning("replica %s (%s) is down", member.id, member.target)
                self.mark_down(member.id)
            return
        member.failed_probes = 0
        state, changes = member.state, member.changes
        try:
            entries = await client.repository_index(True)
        except InferplaneError:
            return
        if member.state != state or member.changes != changes:  # marked down, or a load/unload meanwhile: stale
            return
        ready = {e.name for e in entries if e.state == "READY"}
        if member.state == DOWN:
            if member.rejoining is not None:
                return
            member.models = ready
            missing = (member.wanted | self.everywhere) - ready
            if missing:
                member.rejoining = asyncio.get_running_loop().create_task(self._rejoin(member, missing))
                return
            member.state = UP
            log.info("replica %s (%s) rejoined", member.id, member.target)
            self._notify(ready)
            return
        if ready != member.models:
            changed = ready ^ member.models
            member.models = ready
            self._notify(changed)

    async def _rejoin(self, member: Member, missing: set[str]) -> None:
        """A member back from the dead: load what it should host (all at once: Triton loads them in
        parallel, so the restart costs the slowest model's load, not their sum), then take traffic again."""
        try:
            names = sorted(missing)
            results = await asyncio.gather(*(member.client.load_model(name) for name in names), return_exceptions=True)
            gone = False  # a reload the process did not answer: it died again (a restart killed as it came up)
            for name, result in zip(names, results):
                if isinstance(result, InferplaneError):
                    log.error("replica %s: reloading %s failed: %s", member.id, name, result.message)
                    gone = gone or isinstance(result, BackendUnavailable)
                elif isinstance(result, BaseException):
                    raise result
                else:
                    member.models.add(name)
            if gone:  # still down: the next probe tries again (up, a zone's check would count it as back)
                return
            if member.id in self._members and member.state == DOWN:
                member.state = UP
                member.failures = 0
                member.ejected_until = 0.0
                log.info("replica %s (%s) rejoined with %s", member.id, member.target, sorted(member.models))
                self._notify(set(member.models))
        finally:
            member.rejoining = None

    def _latency_outliers(self) -> None:
        now = self._clock()
        limit = max(1, int(len(self._list) * self.policy.max_ejected_fraction))
        ejected = sum(1 for m in self._list if now < m.ejected_until)
        models = {model for m in self._list for model in m.models}
        for model in sorted(models):
            peers = [m for m in self._list if m.serves(model, now) and m.samples.get(model, 0) >= self.policy.latency_min_samples]
            if len(peers) < 2:
                continue
            for member in peers:
                others = [p.latency[model] for p in peers if p is not member]
                median = statistics.median(others)
                mine = member.latency[model]
                if mine > self.policy.latency_floor_s and mine > self.policy.latency_outlier_factor * median and ejected < limit:
                    self._eject(member, f"latency {mine * 1000:.1f} ms for {model} vs {median * 1000:.1f} ms elsewhere")
                    member.latency[model] = median  # start over when it returns
                    member.samples[model] = 0
                    ejected += 1

    # ---- discovery ----------------------------------------------------------------------------

    async def _discover_forever(self) -> None:
        while True:
            for source in self._sources:
                try:
                    await self.discover(source)
                except Exception:  # DNS hiccups must not stop discovery
                    log.exception("replica discovery through %s failed", source.name)
            await asyncio.sleep(self.policy.discovery_interval_s)

    async def discover(self, source: "DnsSource") -> tuple[list[str], list[str]]:
        """One resolution of ``source``: members for new addresses join, vanished ones are drained
        and leave. Returns (joined, left) targets."""
        targets = await source.targets()
        have = {m.target: m for m in self._list if m.source == source.name}
        joined, left = [], []
        for target in sorted(targets - set(have)):
            if self._client_factory is None:
                raise RuntimeError("discovery needs a client_factory")
            client = self._client_factory(target)
            zone = source.zones.get(target, "")
            await self.add_member(Member(f"{source.name}/{target}", client, group=source.group, source=source.name, capacity=source.capacity, zone=zone))
            joined.append(target)
        for target in targets & set(have):  # an address reused by a pod of another zone
            have[target].zone = source.zones.get(target, have[target].zone)
        for target in sorted(set(have) - targets):
            await self.remove_member(have[target].id)
            left.append(target)
        if joined or left:
            log.info("replicas of %s: +%s -%s", source.name, joined, left)
        return joined, left

    # ---- what the control plane reads ------------------------------------------------------------

    def snapshot(self) -> dict:
        now = self._clock()
        return {
            "name": self.name,
            "members": [m.snapshot(now) for m in self._list],
            "placement": {k: list(v) for k, v in sorted(self.placement.items())},
            "waiting": {k: v for k, v in self.waiting.items() if v},
            "retries": self.retries,
            "retried_lost": self.retried_lost,
        }


class ReplicaStream:
    """A ModelStreamInfer call on one member, chosen when the first message is written (its model
    names the member); outstanding there until the stream ends. Before that first message reached a
    member, an unreachable one is swapped for another."""

    def __init__(self, replicas: ReplicaSet, timeout: float | None, model: str, metadata: tuple | None = None, affinity: str | None = None):
        self._set = replicas
        self._affinity = affinity
        self._timeout = timeout
        self._metadata = metadata
        self._model = model
        self._stream: BackendStream | None = None
        self._member: Member | None = None
        self._bound = asyncio.Event()
        self._cancelled = False
        self._released = False

    async def _bind(self, raw: bytes) -> None:
        model = self._model or request_model(raw)
        rs = self._set
        deadline = None if self._timeout is None else rs._clock() + self._timeout
        exclude = None
        for attempt in range(2):
            member = await rs._member_for(model, deadline, exclude, self._affinity)
            left = _left(deadline, rs._clock()) if deadline is not None else None
            stream = member.client.stream_raw(timeout=left, metadata=self._metadata, model=model)
            try:
                await stream.write(raw)
            except NotSent as err:
                rs._failed(member, model, err)
                stream.cancel()
                if attempt:
                    raise
                exclude = member
                continue
            member.outstanding += 1
            member.by_model[model] = member.by_model.get(model, 0) + 1
            self._member, self._stream, self._model = member, stream, model
            return

    async def write(self, raw: bytes) -> None:
        if self._stream is None:
            try:
                await self._bind(raw)
            finally:
                self._bound.set()
            return
        await self._stream.write(raw)

    async def done_writing(self) -> None:
        if self._stream is None:
            self._bound.set()
            return
        await self._stream.done_writing()

    @property
    def member(self) -> Member | None:
        """The member the stream went to (None before its first message)."""
        return self._member

    def report_kv(self, utilisation: float) -> None:
        """The engine's KV utilisation from a response of this stream (its final ``info``)."""
        if self._member is not None:
            self._set.report_kv(self._member, self._model, utilisation)

    def cancel(self) -> bool:
        self._cancelled = True
        self._bound.set()
        result = self._stream.cancel() if self._stream is not None else True
        self._release()
        return result

    def _release(self) -> None:
        if self._member is not None and not self._released:
            self._released = True
            self._member.outstanding -= 1
            self._member.by_model[self._model] -= 1

    async def __aiter__(self):
        await self._bound.wait()
        if self._stream is None:
            return
        try:
            async for raw in self._stream:
                yield raw
        finally:
            self._release()


# ---- discovery sources ------------------------------------------------------------------------------


def resolve_dns(name: str) -> list[str]:
    """Every address ``name`` resolves to (a headless Service answers one per ready pod)."""
    infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


@dataclass
class DnsSource:
    """A DNS name whose addresses are the members (a Kubernetes headless Service), re-resolved on
    every discovery round through ``resolver`` (injectable: tests answer with what they like). DNS names
    no zones (``zones`` stays empty); ``server.runtime.kube_api.EndpointSliceSource`` is the same
    interface with each member's zone, from the Service's EndpointSlices."""

    name: str  # e.g. triton-general (the Service) or triton-general.inferplane.svc.cluster.local
    port: int = 8001
    group: str = ""
    resolver: Callable[[str], list[str]] = field(default=resolve_dns)
    capacity: str = capacity_policy.ON_DEMAND  # its pods' capacity (a spot node pool's group: "spot")
    zones: dict[str, str] = field(default_factory=dict)  # target -> zone: none known from DNS

    async def targets(self) -> set[str]:
        try:
            addresses = await asyncio.to_thread(self.resolver, self.name)
        except OSError as err:  # NXDOMAIN while the group has no ready pod: no members
            log.debug("resolving %s: %s", self.name, err)
            addresses = []
        return {f"[{a}]:{self.port}" if ":" in a else f"{a}:{self.port}" for a in addresses}


# ---- helpers -----------------------------------------------------------------------------------------


def merge_statistics(answers: list) -> pb.ModelStatisticsResponse:
    """Sum per-model statistics of several Tritons (counts and nanoseconds add; last_inference is the latest)."""
    merged: dict[tuple[str, str], pb.ModelStatistics] = {}
    for answer in answers:
        for stats in answer.model_stats:
            key = (stats.name, stats.version)
            into = merged.get(key)
            if into is None:
                merged[key] = type(stats).FromString(stats.SerializeToString())
                continue
            into.last_inference = max(into.last_inference, stats.last_inference)
            into.inference_count += stats.inference_count
            into.execution_count += stats.execution_count
            for f in into.inference_stats.DESCRIPTOR.fields:
                a, b = getattr(into.inference_stats, f.name), getattr(stats.inference_stats, f.name)
                a.count += b.count
                a.ns += b.ns
            batches = {b.batch_size: b for b in into.batch_stats}
            for b in stats.batch_stats:
                target = batches.get(b.batch_size)
                if target is None:
                    into.batch_stats.add().CopyFrom(b)
                    continue
                for name in ("compute_input", "compute_infer", "compute_output"):
                    getattr(target, name).count += getattr(b, name).count
                    getattr(target, name).ns += getattr(b, name).ns
    return pb.ModelStatisticsResponse(model_stats=[merged[k] for k in sorted(merged)])


def _refused(err: InferplaneError) -> bool:
    """Triton itself said the model is not there or not ready (it did not start the request)."""
    return (isinstance(err, NotSent) and not refused_connection(err.message)) or (
        isinstance(err, ModelNotFound) and err.message.startswith(_UNKNOWN_MODEL)
    )


def _left(deadline: float, now: float) -> float:
    return max(0.0, deadline - now)


async def _close_later(client, delay_s: float = 5.0) -> None:
    """Close a replaced client once what was in flight on it has failed on its own (a dead Triton's
    connection resets: the request is retried elsewhere); closing at once would cancel it instead."""
    await asyncio.sleep(delay_s)
    await _close_quietly(client)


async def _close_quietly(client) -> None:
    with contextlib.suppress(Exception):
        await client.close()

