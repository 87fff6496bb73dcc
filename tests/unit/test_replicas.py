"""The replica set's logic with scripted members (the real-Triton behaviour is in
tests/integration/test_fleet.py): power-of-two least-outstanding choice, the retry rule, outlier
ejection, draining, held requests, health and rejoin, discovery, merged statistics."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from server.dataplane.replicas import DOWN, UP, DnsSource, Member, ReplicaPolicy, ReplicaSet, merge_statistics
from server.dataplane.backend_errors import ConnectionLost, NotSent
from server.dataplane.wire import request_model
from server.errors import BackendError, DeadlineExceeded, InvalidRequest, ModelNotFound, ModelNotReady
from server.protogen.inference import grpc_service_pb2 as pb
from tests.backend_fake import FakeBackend

MODEL = "fraud"


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def fake(name: str, models=(MODEL,)) -> FakeBackend:
    """A member's client: answers with its own name (a stream: its name and the request) unless told to fail or hold."""
    return FakeBackend(name, models, answer=lambda raw: name.encode(), stream_answer=lambda raw: name.encode() + b":" + raw, instances=2)


def request(model=MODEL) -> bytes:
    return pb.ModelInferRequest(model_name=model, id="r").SerializeToString()


def make(*names, policy=ReplicaPolicy(wait_for_member_s=0.5, eject_s=2.0), clock=None):
    clients = [fake(n) for n in names]
    members = [Member(n, c) for n, c in zip(names, clients)]
    for m, c in zip(members, clients):
        m.models = set(c.loaded)
    rs = ReplicaSet(members, policy=policy, clock=clock or Clock(), rng=random.Random(7), client_factory=fake)
    return rs, clients


def run(coro):
    return asyncio.run(coro)


# ---- choice ------------------------------------------------------------------------------------------


def test_least_outstanding_with_two_choices_avoids_the_busy_member():
    async def main():
        rs, (a, b) = make("a", "b")
        a.hold = asyncio.Event()
        busy = []
        while rs.member("a").outstanding == 0:  # until one call is stuck at a
            busy.append(asyncio.create_task(rs.infer_raw(request())))
            await asyncio.sleep(0)
        answers = [await rs.infer_raw(request()) for _ in range(20)]
        a.hold.set()
        await asyncio.gather(*busy)
        return answers, rs

    answers, rs = run(main())
    # with a's calls stuck, b has fewer outstanding every time: every new request goes to b
    assert set(answers) == {b"b"}


def test_traffic_spreads_over_members_when_they_are_equal():
    async def main():
        rs, clients = make("a", "b", "c")
        for _ in range(300):
            await rs.infer_raw(request())
        return [c.calls for c in clients]

    calls = run(main())
    assert all(c > 50 for c in calls), calls


def test_requests_go_only_to_members_hosting_the_model():
    async def main():
        rs, (a, b) = make("a", "b")
        rs.member("b").models = {"other"}
        return {await rs.infer_raw(request()) for _ in range(20)}

    assert run(main()) == {b"a"}


def test_the_model_is_read_from_the_request_when_not_given():
    raw = pb.ModelInferRequest(id="x", model_version="2", model_name="fraud_xgboost").SerializeToString()
    assert request_model(raw) == "fraud_xgboost"
    # fields in any order (another client may put id first): field 3, then field 1
    swapped = b"\x1a\x01x" + b"\x0a\x05fraud"
    assert request_model(swapped) == "fraud"
    assert request_model(b"") == "" and request_model(b"\xff") == ""


# ---- retry ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("error, retried", [
    (NotSent("failed to connect to all addresses; Connection refused"), True),
    (NotSent("Request for unknown model: 'fraud' is not ready"), True),
    (ModelNotFound("Request for unknown model: 'fraud' is not found"), True),
    (ConnectionLost("Stream removed (recvmsg:Connection reset by peer (104))"), True),
    (BackendError("the model raised"), False),
    (InvalidRequest("bad input"), False),
    (DeadlineExceeded("deadline"), False),
])  # fmt: skip
def test_the_retry_rule(error, retried):
    async def main():
        rs, (a, b) = make("a", "b")
        first = rs._choose(MODEL)
        first.client.fail.append(error)
        other = b if first.client is a else a
        try:
            answer = await rs.infer_raw(request())
        except Exception as err:  # not retried: the caller gets the member's error
            return None, err, other.calls, rs
        return answer, None, other.calls, rs

    answer, err, other_calls, rs = run(main())
    if retried:
        assert answer is not None and other_calls == 1 and rs.retries == 1
    else:
        assert err is error and other_calls == 0 and rs.retries == 0


def test_a_lost_connection_is_not_retried_when_the_policy_says_so():
    async def main():
        rs, (a, b) = make("a", "b", policy=ReplicaPolicy(retry_lost=False))
        first = rs._choose(MODEL)
        first.client.fail.append(ConnectionLost("Socket closed"))
        with pytest.raises(ConnectionLost):
            await rs.infer_raw(request())

    run(main())


@pytest.mark.parametrize("error, lost", [
    (ConnectionLost("Stream removed (recvmsg:Connection reset by peer (104))"), 1),  # died under the call
    (NotSent("failed to connect to all addresses; Connection refused"), 0),  # died before it: nothing was sent
])  # fmt: skip
def test_a_call_the_only_members_death_failed_waits_for_what_replaces_it(error, lost):
    """The lone member's process died under the call, or before it reached it (its port refused the
    connection); a standby takes its place (a new client on the same member): the call is sent again
    there, not failed, and not to the dead connection."""

    async def main():
        rs, (a,) = make("a")
        a.fail.append(error)
        call = asyncio.ensure_future(rs.infer_raw(request(), timeout=30.0))
        while a.calls == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        assert not call.done() and a.calls == 1  # held: not sent to the dead connection again
        standby = fake("standby")
        rs.replace_client("a", standby)
        rs.revive("a")
        assert await asyncio.wait_for(call, 5) == b"standby"
        assert rs.retries == 1 and rs.retried_lost == lost and a.calls == 1 and standby.calls == 1

    run(main())


def test_a_lost_call_on_the_only_member_still_up_on_its_connection_is_sent_to_it_again():
    async def main():
        clock = Clock()
        rs, (a,) = make("a", clock=clock)
        a.fail.append(ConnectionLost("Socket closed"))
        call = asyncio.ensure_future(rs.infer_raw(request(), timeout=30.0))
        while a.calls == 0:
            await asyncio.sleep(0.01)
        clock.t += 3.1  # past three health intervals: it was not dead
        assert await asyncio.wait_for(call, 5) == b"a" and a.calls == 2

    run(main())


def test_a_lost_call_on_the_only_member_fails_at_its_deadline_when_nothing_replaces_it():
    async def main():
        clock = Clock()
        rs, (a,) = make("a", clock=clock)
        lost = ConnectionLost("Connection reset by peer")
        a.fail.append(lost)
        rs.mark_down("a")
        rs.member("a").state, rs.member("a").models = UP, {MODEL}  # the call was sent while it was up
        call = asyncio.ensure_future(rs.infer_raw(request(), timeout=2.0))
        while a.calls == 0:
            await asyncio.sleep(0.01)
        rs.mark_down("a")  # its process is gone, nothing takes its place
        clock.t += 2.5
        with pytest.raises(ConnectionLost) as raised:
            await asyncio.wait_for(call, 5)
        assert raised.value is lost and a.calls == 1

    run(main())


def test_a_retry_never_goes_past_the_deadline():
    async def main():
        clock = Clock()
        rs, (a, b) = make("a", "b", clock=clock)
        first = rs._choose(MODEL)

        async def slow_fail(request, timeout=None, *, model=""):
            clock.t += 5.0  # the failure came after the whole deadline
            raise NotSent("failed to connect to all addresses")

        first.client.infer_raw = slow_fail
        with pytest.raises(NotSent):
            await rs.infer_raw(request(), timeout=1.0)

    run(main())


# ---- ejection ---------------------------------------------------------------------------------------------


def test_a_connection_failure_ejects_the_member_until_its_time_is_up():
    async def main():
        clock = Clock()
        rs, (a, b) = make("a", "b", clock=clock)
        a.fail.append(ConnectionLost("Connection reset by peer"))
        rs._rng = random.Random(0)
        while a.calls == 0:  # until a request lands on a (and is retried on b)
            await rs.infer_raw(request())
        assert clock.t < rs.member("a").ejected_until
        before = a.calls
        answers = {await rs.infer_raw(request()) for _ in range(30)}
        assert answers == {b"b"} and a.calls == before
        clock.t += 2.1
        for _ in range(30):
            await rs.infer_raw(request())
        assert a.calls > before  # back in rotation
        # a second ejection lasts twice as long
        a.fail.append(NotSent("failed to connect to all addresses"))
        while rs.member("a").ejections < 2:
            await rs.infer_raw(request())
        assert rs.member("a").ejected_until - clock.t == pytest.approx(4.0)

    run(main())


def test_consecutive_backend_failures_eject_and_one_success_resets():
    async def main():
        rs, (a,) = make("a")
        for _ in range(2):
            a.fail.append(BackendError("Stub process is not healthy"))
        for _ in range(2):
            with pytest.raises(BackendError):
                await rs.infer_raw(request())
        assert await rs.infer_raw(request()) == b"a"
        assert rs.member("a").failures == 0
        for _ in range(3):
            a.fail.append(BackendError("x"))
            with pytest.raises(BackendError):
                await rs.infer_raw(request())
        assert rs.member("a").ejections == 1
        assert await rs.infer_raw(request()) == b"a"  # alone and ejected, it still serves: better it than nobody

    run(main())


def test_a_latency_outlier_is_ejected():
    async def main():
        rs, clients = make("a", "b", "c")
        for m, latency in zip(rs.members(), (0.010, 0.011, 0.200)):
            m.latency[MODEL], m.samples[MODEL] = latency, 50
        rs._latency_outliers()
        return [m.ejections for m in rs.members()]

    assert run(main()) == [0, 0, 1]


# ---- draining, holding, membership ----------------------------------------------------------------------------


def test_drain_waits_for_in_flight_requests_and_sends_no_new_ones():
    async def main():
        rs, (a, b) = make("a", "b")
        a.hold = asyncio.Event()
        rs._rng = random.Random(1)
        stuck = []
        while rs.member("a").outstanding == 0:
            stuck.append(asyncio.create_task(rs.infer_raw(request())))
            await asyncio.sleep(0)
        drained = asyncio.create_task(rs.drain("a", MODEL))
        await asyncio.sleep(0.05)
        assert not drained.done()  # a's request is still in flight
        before = a.calls
        answers = {await rs.infer_raw(request()) for _ in range(20)}
        assert answers == {b"b"} and a.calls == before
        a.hold.set()
        assert await drained is True
        results = await asyncio.gather(*stuck)
        assert b"a" in results  # the in-flight one finished, nothing was lost
        await rs.unload_from("a", MODEL, drain=False)
        assert MODEL not in a.loaded and MODEL not in rs.member("a").models

    run(main())


def test_a_request_is_held_until_a_member_serves_its_model():
    async def main():
        rs, (a,) = make("a", clock=time.monotonic)
        rs.member("a").models = set()
        missing = []
        rs.on_missing = missing.append
        waiting = asyncio.create_task(rs.infer_raw(request()))
        await asyncio.sleep(0.05)
        assert not waiting.done() and rs.waiting[MODEL] == 1 and missing == [MODEL]
        await rs.load_on("a", MODEL)
        assert await waiting == b"a"
        assert rs.waiting[MODEL] == 0

    run(main())


def test_a_held_request_fails_with_a_retry_hint_past_its_budget():
    async def main():
        rs, (a,) = make("a", clock=time.monotonic)
        rs.member("a").models = set()
        rs.wait_budget = lambda model: 0.1
        with pytest.raises(ModelNotReady) as caught:
            await rs.infer_raw(request())
        assert caught.value.retry_after_s >= 1.0
        with pytest.raises(DeadlineExceeded):  # a deadline shorter than the budget is the caller's
            rs.wait_budget = lambda model: 5.0
            await rs.infer_raw(request(), timeout=0.05)

    run(main())


def test_down_members_rejoin_with_their_models_loaded_again():
    async def main():
        rs, (a, b) = make("a", "b", policy=ReplicaPolicy(down_after_probes=2))
        await rs.load_on("a", "extra")
        a.live = False
        await rs.check_health()
        assert rs.member("a").state == UP  # one failed probe is not enough
        await rs.check_health()
        assert rs.member("a").state == DOWN and not rs.member("a").models
        assert {await rs.infer_raw(request()) for _ in range(10)} == {b"b"}
        a.live, a.loaded = True, {}  # restarted empty
        assert await rs.rejoin("a")
        assert {"extra"} <= set(a.loads) and rs.member("a").models >= {"extra"}

    run(main())


def test_a_member_whose_reloads_its_process_did_not_answer_stays_down():
    """Its restart answered the probe and died under the reloads (a zone's Tritons killed as they come up):
    it is not up — a zone's down check must still count it — and a later probe tries again."""

    async def main():
        rs, (a, b) = make("a", "b", policy=ReplicaPolicy(down_after_probes=1))
        await rs.load_on("a", "extra")
        rs.mark_down("a")
        a.loaded = {}  # restarted empty; it dies again as the reloads arrive
        real_load = a.load_model

        async def dying(name, timeout=300.0, *, config=None):
            raise ConnectionLost("Stream removed (Socket closed)")

        a.load_model = dying
        assert not await rs.rejoin("a")
        assert rs.member("a").state == DOWN
        a.load_model = real_load  # the next restart lives
        assert await rs.rejoin("a")
        assert rs.member("a").state == UP and "extra" in rs.member("a").models

    run(main())


def test_a_rejoin_during_a_health_probe_on_the_dead_connection_probes_the_new_one_after_it():
    """A local Triton restarted: the fleet gives the member a new channel and asks it to rejoin while
    a health round's probe still waits on the old one (it fails: the dead process). The rejoin probes
    again after that probe, on the new channel, and the member is up with its models loaded again —
    not left down until a later health round."""

    async def main():
        rs, (a, b) = make("a", "b")
        await rs.load_on("a", "extra")
        rs.mark_down("a")
        gate = asyncio.Event()

        async def stuck(timeout: float = 1.0) -> bool:  # a connect attempt to the dead port
            await gate.wait()
            return False

        a.server_live = stuck
        health = asyncio.ensure_future(rs.check_health())
        await asyncio.sleep(0.01)
        assert rs.member("a").probing
        restarted = fake("a2", models=())
        rs.replace_client("a", restarted)
        rejoin = asyncio.ensure_future(rs.rejoin("a"))
        await asyncio.sleep(0.05)
        assert not rejoin.done()  # waits for the probe in flight
        gate.set()
        await health
        assert await rejoin
        assert rs.member("a").state == UP and {"extra"} <= set(restarted.loads) and "extra" in rs.member("a").models

    run(main())


def test_model_config_counts_instances_over_the_members_serving_it():
    async def main():
        rs, _ = make("a", "b", "c")
        three = await rs.model_config(MODEL)
        await rs.drain("c", MODEL)
        two = await rs.model_config(MODEL)
        return three.instance_group[0].count, two.instance_group[0].count

    assert run(main()) == (6, 4)


def test_load_model_follows_the_placement_and_defaults_to_every_member():
    async def main():
        rs, (a, b, c) = make("a", "b", "c")
        rs.placement["placed"] = ["b"]
        await rs.load_model("placed")
        await rs.load_model("everywhere")
        return a.loads, b.loads, c.loads

    assert run(main()) == (["everywhere"], ["placed", "everywhere"], ["everywhere"])


def test_statistics_are_summed_over_members():
    one, two = pb.ModelStatisticsResponse(), pb.ModelStatisticsResponse()
    for answer, n in ((one, 3), (two, 4)):
        s = answer.model_stats.add(name=MODEL, version="1", inference_count=n, last_inference=n)
        s.inference_stats.success.count = n
        s.inference_stats.queue.ns = n * 10
        s.batch_stats.add(batch_size=1).compute_infer.count = n
    merged = merge_statistics([one, two]).model_stats[0]
    assert (merged.inference_count, merged.last_inference, merged.inference_stats.success.count, merged.inference_stats.queue.ns) == (7, 4, 7, 70)
    assert merged.batch_stats[0].compute_infer.count == 7


def test_discovery_joins_new_addresses_and_drains_vanished_ones():
    answers = {"triton-general": ["10.0.0.1", "10.0.0.2"]}

    def resolver(name):
        if name not in answers:
            raise OSError("NXDOMAIN")
        return answers[name]

    async def main():
        rs = ReplicaSet(client_factory=fake)
        source = DnsSource("triton-general", 8001, group="general", resolver=resolver)
        rs.add_source(source)
        joined, left = await rs.discover(source)
        assert joined == ["10.0.0.1:8001", "10.0.0.2:8001"] and left == []
        assert {m.group for m in rs.members()} == {"general"}
        assert all(m.state == UP and MODEL in m.models for m in rs.members())  # probed: its ready models read
        answers["triton-general"] = ["10.0.0.2", "10.0.0.3"]
        gone = rs.member("triton-general/10.0.0.1:8001").client
        joined, left = await rs.discover(source)
        assert (joined, left) == (["10.0.0.3:8001"], ["10.0.0.1:8001"]) and gone.closed
        del answers["triton-general"]  # scaled to zero: the name answers nothing
        assert await rs.discover(source) == ([], ["10.0.0.2:8001", "10.0.0.3:8001"])
        assert rs.members() == []

    run(main())


def test_a_stream_is_bound_to_a_member_of_its_first_message_model():
    async def main():
        rs, (a, b) = make("a", "b")
        rs.member("a").models = {"other"}
        stream = rs.stream_raw()
        reader = asyncio.create_task(_collect(stream))
        await stream.write(request())
        await stream.done_writing()
        out = await reader
        assert out == [b"b:" + request()] and rs.member("b").outstanding == 0

    run(main())


def test_a_stream_whose_member_cannot_be_reached_goes_to_another():
    async def main():
        rs, (a, b) = make("a", "b")
        first = rs._choose(MODEL)
        first.client.fail.append(NotSent("failed to connect to all addresses"))
        stream = rs.stream_raw()
        await stream.write(request())
        await stream.done_writing()
        out = await _collect(stream)
        other = b if first.client is a else a
        assert out == [other.target.encode() + b":" + request()]

    run(main())


async def _collect(stream):
    return [raw async for raw in stream]


def test_a_refusal_from_the_only_replica_holds_the_request_until_one_serves_the_model():
    async def main():
        rs, (a,) = make("a", clock=time.monotonic)
        a.fail.append(ModelNotFound("Request for unknown model: 'fraud' has no available versions"))
        answer = asyncio.create_task(rs.infer_raw(request()))
        await asyncio.sleep(0.05)
        assert not answer.done() and MODEL not in rs.member("a").models  # held, not failed
        await rs.load_on("a", MODEL)
        assert await answer == b"a"

    run(main())


def test_a_probe_that_overlapped_an_unload_does_not_bring_the_model_back():
    async def main():
        rs, (a,) = make("a")
        started, release = asyncio.Event(), asyncio.Event()
        real = a.repository_index

        async def slow_index(ready_only=False):
            answer = await real(ready_only)  # read while the model is still ready
            started.set()
            await release.wait()
            return answer

        a.repository_index = slow_index
        probe = asyncio.create_task(rs.check_health())
        await started.wait()
        await rs.unload_from("a", MODEL, drain=False)
        release.set()
        await probe
        assert MODEL not in rs.member("a").models

    run(main())


def test_a_call_two_members_refuse_up_front_goes_on_to_the_third_and_they_lose_the_model():
    """A scale-down unloads the model from two of three Tritons while a frontend still routes there: each
    refuses the call before any work ("unknown model"), the call goes on to a member that serves it, and
    the refusing members stop counting for the model."""

    async def main():
        rs, (a, b, c) = make("a", "b", "c")
        for gone in (a, b):
            gone.fail.append(ModelNotFound(f"Request for unknown model: '{MODEL}' version 1 is not at ready state"))
        rs._choose = _in_order(rs, ["a", "b", "c"])
        assert await rs.infer_raw(request(), timeout=5.0) == b"c"
        assert (a.calls, b.calls, c.calls) == (1, 1, 1) and rs.retries == 2
        assert [m.id for m in rs.serving(MODEL)] == ["c"]

    run(main())


def test_a_call_refused_by_every_member_fails_once_each_was_tried():
    async def main():
        rs, members = make("a", "b")
        for m in members:
            m.fail += [ModelNotFound(f"Request for unknown model: '{MODEL}' is not found")] * 3
        rs._choose = _in_order(rs, ["a", "b", "a", "b"])
        with pytest.raises(ModelNotFound):
            await rs.infer_raw(request(), timeout=5.0)
        assert [m.calls for m in members] == [1, 1]

    run(main())


def _in_order(rs, ids):
    """The members chosen in this order (the set's own choice is random between two)."""
    order = iter(ids)
    return lambda model, exclude=None, affinity=None: rs.member(next(order))
