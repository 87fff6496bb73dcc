"""Spot capacity (issue 29) with scripted members: the pure policy (which replicas each traffic class
may use), the replica set applying it by the task's traffic class, a reclaim notice (Triton's
"Server exiting") draining a member until it rejoins, the batch worker keeping a row pending when no
replica could take it, and the model-groups file's capacity. The drill on real Tritons with a batch
job running is tests/integration/test_spot_capacity.py."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import grpc

import pytest

from server.control.batches.batches import BatchWorker, Row
from server.control.scaling.executors import ModelGroups
from server.dataplane import capacity_policy as cp
from server.dataplane.capacity_policy import TRAFFIC
from server.dataplane.replicas import DRAINING, UP, Member, ReplicaPolicy, ReplicaSet
from server.dataplane.backend_errors import NotSent
from server.dataplane.backend import DOWN as NOT_LIVE, EXITING, LIVE
from server.dataplane.triton_client import translate
from server.errors import BackendUnavailable, InvalidRequest, ModelNotReady
from tests.backend_fake import FakeBackend
from tests.unit.test_replicas import MODEL, request


def _m(name, capacity):
    return SimpleNamespace(name=name, capacity=capacity)


OD, SP = _m("od", cp.ON_DEMAND), _m("sp", cp.SPOT)


# ---- the policy ----------------------------------------------------------------------------------


def test_realtime_never_uses_spot_unless_the_endpoint_opts_in():
    assert cp.eligible([OD, SP], cp.REALTIME, spot_hosts=1) == [OD]
    assert cp.eligible([SP], cp.REALTIME, spot_hosts=1) == []  # held for an on-demand replica, not sent to spot
    assert cp.eligible([OD, SP], cp.REALTIME, spot_ok=True, spot_hosts=1) == [OD, SP]


def test_batch_prefers_spot_and_takes_on_demand_when_the_spot_pool_is_empty():
    assert cp.eligible([OD, SP], cp.BATCH, spot_hosts=1) == [SP]
    assert cp.eligible([OD], cp.BATCH, spot_hosts=1) == [OD]  # the spot replica is reclaimed: on demand takes the work
    assert cp.eligible([OD], cp.BATCH) == [OD]


def test_shadow_prefers_spot_and_pauses_while_the_spot_replicas_are_away():
    assert cp.eligible([OD, SP], cp.SHADOW, spot_hosts=1) == [SP]
    with pytest.raises(cp.ShadowPaused):
        cp.eligible([OD], cp.SHADOW, spot_hosts=1)
    assert cp.eligible([OD], cp.SHADOW, spot_hosts=0) == [OD]  # no spot capacity for the model at all: as before


def test_capacity_names_and_the_opt_in_parameter():
    assert cp.parse_capacity("on-demand") == cp.ON_DEMAND and cp.parse_capacity(" SPOT ") == cp.SPOT and cp.parse_capacity("") == cp.ON_DEMAND
    with pytest.raises(ValueError):
        cp.parse_capacity("preemptible")
    assert cp.spot_opt_in({cp.SPOT_PARAMETER: "true"}) and not cp.spot_opt_in({}) and not cp.spot_opt_in({cp.SPOT_PARAMETER: "no"})


# ---- the replica set ---------------------------------------------------------------------------------


class ExitingTriton(FakeBackend):
    """A member whose ServerLive can answer "exiting" (Triton after SIGTERM)."""

    def __init__(self, name):
        super().__init__(name, (MODEL,), answer=lambda raw: name.encode())
        self.state = LIVE

    async def liveness(self, timeout=1.0):
        return self.state


def spot_set():
    od, sp = ExitingTriton("od"), ExitingTriton("sp")
    members = [Member("od", od), Member("sp", sp, capacity=cp.SPOT)]
    for m, c in zip(members, (od, sp)):
        m.models, m.wanted = set(c.loaded), set(c.loaded)  # loaded through the set (placement): reloaded when it rejoins
    rs = ReplicaSet(members, policy=ReplicaPolicy(wait_for_member_s=0.3), rng=random.Random(7))
    return rs, od, sp


async def _as(traffic, coro):
    TRAFFIC.set(traffic)  # this task's class (a task of its own: the caller's stays real-time)
    return await coro


def _served(rs, traffic, n=20):
    return {asyncio.run(_as(traffic, rs.infer_raw(request()))) for _ in range(n)}


def test_the_replica_set_sends_each_traffic_class_where_the_policy_says():
    rs, od, sp = spot_set()
    assert _served(rs, cp.REALTIME) == {b"od"}
    assert _served(rs, cp.BATCH) == {b"sp"}
    assert _served(rs, cp.SHADOW) == {b"sp"}
    rs.spot_ok = lambda model: model == MODEL  # the endpoint opted in: its real-time traffic may use spot
    assert _served(rs, cp.REALTIME, 40) == {b"od", b"sp"}


def test_a_reclaim_notice_drains_the_spot_member_batch_moves_on_demand_shadow_pauses_until_it_rejoins():
    async def main():
        rs, od, sp = spot_set()
        sp.state = EXITING  # SIGTERM: the notice period runs
        await rs.check_health()
        member = rs.member("sp")
        assert member.state == DRAINING and member.reclaimed == 1
        assert {await _as(cp.BATCH, rs.infer_raw(request())) for _ in range(10)} == {b"od"}
        assert {await rs.infer_raw(request()) for _ in range(10)} == {b"od"}
        with pytest.raises(cp.ShadowPaused):
            await asyncio.create_task(_as(cp.SHADOW, rs.infer_raw(request())))
        await rs.check_health()
        assert member.reclaimed == 1  # one notice, counted once
        rs.mark_down("sp")  # then SIGKILL: its supervisor saw the process die
        sp.state, sp.loaded = LIVE, {}  # the replacement, empty
        assert await rs.rejoin("sp")
        assert member.state == UP and MODEL in member.models and MODEL in sp.loads
        assert {await _as(cp.BATCH, rs.infer_raw(request())) for _ in range(10)} == {b"sp"}

    asyncio.run(main())


def test_an_exiting_member_that_comes_back_without_dying_rejoins_through_a_reload():
    async def main():
        rs, od, sp = spot_set()
        sp.state = EXITING
        await rs.check_health()
        sp.state = NOT_LIVE
        await rs.check_health()
        assert rs.member("sp").state == DRAINING  # not up while it is away
        sp.state, sp.loaded = LIVE, {}  # a new process on the same address (a static --triton-url)
        await rs.check_health()
        await asyncio.sleep(0)
        assert await rs.rejoin("sp") and rs.member("sp").state == UP and MODEL in sp.loads

    asyncio.run(main())


def test_realtime_is_held_rather_than_sent_to_spot_when_no_on_demand_replica_serves():
    async def main():
        rs, od, sp = spot_set()
        rs.mark_down("od")
        with pytest.raises(ModelNotReady):
            await rs.infer_raw(request(), timeout=5)
        assert sp.calls == 0

    asyncio.run(main())


def test_a_set_without_spot_members_is_unchanged_for_every_class():
    rs, od, sp = spot_set()
    rs.member("sp").capacity = cp.ON_DEMAND
    for traffic in (cp.REALTIME, cp.BATCH, cp.SHADOW):
        assert _served(rs, traffic, 40) == {b"od", b"sp"}, traffic
    assert rs.member("od").snapshot(0.0)["capacity"] == cp.ON_DEMAND


# ---- the batch worker and the groups file ---------------------------------------------------------


@pytest.mark.parametrize("err", [BackendUnavailable("no replica"), ModelNotReady("no replica serves it yet")])
def test_a_batch_row_no_replica_could_take_stays_pending(err):
    async def run_row(endpoint, body, tenant):
        raise err

    worker = BatchWorker(store=None, run_row=run_row)
    job = SimpleNamespace(id="b1", endpoint="/v1/x", tenant="t")
    assert asyncio.run(worker._one(job, Row(0, "r0", "{}"))) is None  # not committed: tried again


def test_a_model_group_can_be_spot_and_its_models_stay_the_on_demand_groups():
    groups = ModelGroups({
        "general": {"service": "triton-general", "models": ["*"]},
        "tabular": {"service": "triton-tabular", "models": ["fraud"]},
        "tabular-spot": {"service": "triton-tabular-spot", "models": ["fraud"], "capacity": "spot"},
    })  # fmt: skip
    assert groups.groups["tabular-spot"]["capacity"] == cp.SPOT and groups.groups["general"]["capacity"] == cp.ON_DEMAND
    assert groups.group_of("fraud") == "tabular"
    both = ModelGroups({
        "general": {"service": "triton-general", "models": ["*"]},
        "general-spot": {"service": "triton-general-spot", "models": ["*"], "capacity": "spot"},
    })  # fmt: skip
    assert both.group_of("anything") == "general"  # a spot pool next to the general one serves the same models
    with pytest.raises(InvalidRequest, match="only one model group.*spot"):
        ModelGroups({"a": {"service": "a", "models": ["*"], "capacity": "spot"}, "b": {"service": "b", "models": ["*"], "capacity": "spot"}})
    with pytest.raises(InvalidRequest, match="capacity"):
        ModelGroups({"g": {"service": "s", "models": ["*"], "capacity": "cheap"}})


# ---- shadow copies through the replica set -----------------------------------------------------------


def test_shadow_copies_go_to_spot_and_pause_while_it_is_reclaimed():
    from server.dataplane.routing import Shadow

    async def main():
        rs, od, sp = spot_set()
        shadow = Shadow(version="2")
        shadow.start(rs.infer_raw, workers=1)
        try:
            shadow.offer(request(), b"", 0.001)
            assert await _until(lambda: sp.calls == 1)
            assert od.calls == 0
            sp.state = EXITING  # the reclaim notice
            await rs.check_health()
            for _ in range(3):
                shadow.offer(request(), b"", 0.001)
            assert await _until(lambda: shadow.stats.paused == 3)
            assert od.calls == 0 and sp.calls == 1  # paused: neither the spot nor an on-demand replica got them
            assert shadow.stats.as_dict()["paused"] == 3
        finally:
            await shadow.stop()

    asyncio.run(main())


async def _until(predicate, timeout=5.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() > end:
            return False
        await asyncio.sleep(0.01)
    return True


def test_a_request_triton_refuses_while_stopping_goes_to_another_member_and_drains_the_exiting_one():
    async def main():
        rs, od, sp = spot_set()
        # what Triton answers a new request after SIGTERM, before the next probe sees it exiting
        sp.fail = [NotSent("Triton is exiting: Server is stopping, scheduler for model has stopped accepting new inference requests")]
        answer = await asyncio.create_task(_as(cp.BATCH, rs.infer_raw(request())))
        assert answer == b"od" and sp.calls == 1  # re-sent on demand: the row is not failed
        assert rs.member("sp").state == DRAINING and rs.member("sp").reclaimed == 1

    asyncio.run(main())


@pytest.mark.parametrize("code", ["UNAVAILABLE", "INTERNAL"])
def test_tritons_answers_while_stopping_read_as_not_sent(code):
    message = "[request id: <id_unknown>] Server is stopping, scheduler for model has stopped accepting new inference requests"
    err = grpc.aio.AioRpcError(getattr(grpc.StatusCode, code), grpc.aio.Metadata(), grpc.aio.Metadata(), details=message)
    assert isinstance(translate(err), NotSent)
