"""Traffic policy (pure): weighted and sticky splits, canary verdicts and steps; the router's bookkeeping."""

from __future__ import annotations

import asyncio
import random

import pytest

from server.errors import ModelNotFound
from server.protogen.inference import grpc_service_pb2 as pb
from server.tenancy.identity import CallContext
from server.dataplane.traffic_policy import (
    ADVANCE,
    FAIL,
    HOLD,
    PASS,
    PROMOTE,
    ROLLBACK,
    WAIT,
    Arm,
    CanaryPlan,
    CanaryThresholds,
    SmoothWeighted,
    Verdict,
    WindowStats,
    canary_action,
    canary_arms,
    canary_verdict,
    check_arms,
    percentile,
    sticky_arm,
    unit_hash,
)
from server.dataplane.routing import Router, Shadow, SlidingWindow, Split, header

KEYS = [f"user-{i}" for i in range(20_000)]


def _shares(assigned: list[str], names) -> dict[str, float]:
    return {n: assigned.count(n) / len(assigned) for n in names}


# ---- weighted split -------------------------------------------------------------------------


@pytest.mark.parametrize("weights", [(95, 5), (75, 25), (50, 30, 20)])
def test_sticky_split_matches_the_weights_within_statistical_tolerance(weights):
    arms = [Arm(f"arm{i}", str(i + 1), w) for i, w in enumerate(weights)]
    assigned = [sticky_arm(k, arms, "exp").name for k in KEYS]
    total = sum(weights)
    for arm, share in _shares(assigned, [a.name for a in arms]).items():
        p = weights[int(arm[3:])] / total
        sigma = (p * (1 - p) / len(KEYS)) ** 0.5
        assert abs(share - p) < 4 * sigma + 1e-9, (arm, share, p)


def test_smooth_round_robin_is_exact_and_spreads_the_minority_arm():
    rr = SmoothWeighted(canary_arms("1", "2", 10))
    picks = [rr.next().name for _ in range(1000)]
    assert picks.count("canary") == 100
    assert all(not (a == b == "canary") for a, b in zip(picks, picks[1:]))  # never two in a row at 10%
    three = SmoothWeighted([Arm("a", "1", 5), Arm("b", "2", 3), Arm("c", "3", 2)])
    assert _shares([three.next().name for _ in range(1000)], "abc") == {"a": 0.5, "b": 0.3, "c": 0.2}


def test_zero_weight_arms_get_nothing():
    arms = canary_arms("1", "2", 0)
    assert {sticky_arm(k, arms).name for k in KEYS[:2000]} == {"stable"}
    rr = SmoothWeighted(canary_arms("1", "2", 100))
    assert {rr.next().name for _ in range(50)} == {"canary"}


def test_unit_hash_is_stable_and_uniform():
    assert unit_hash("k", "s") == unit_hash("k", "s") and unit_hash("k", "s") != unit_hash("k", "t")
    values = [unit_hash(k, "s") for k in KEYS]
    assert 0 < min(values) and max(values) < 1
    assert abs(sum(values) / len(values) - 0.5) < 0.01


# ---- stickiness -------------------------------------------------------------------------------


def test_a_key_keeps_its_arm_and_weight_changes_move_as_few_keys_as_possible():
    before = {k: sticky_arm(k, canary_arms("1", "2", 5), "c").name for k in KEYS}
    assert before == {k: sticky_arm(k, canary_arms("1", "2", 5), "c").name for k in KEYS}  # sticky
    for low, high in ((5, 25), (25, 50), (50, 100)):
        old = {k: sticky_arm(k, canary_arms("1", "2", low), "c").name for k in KEYS}
        new = {k: sticky_arm(k, canary_arms("1", "2", high), "c").name for k in KEYS}
        assert not [k for k in KEYS if old[k] == "canary" and new[k] == "stable"]  # nobody leaves the canary
        moved = sum(old[k] != new[k] for k in KEYS) / len(KEYS)
        assert abs(moved - (high - low) / 100) < 0.015, (low, high, moved)  # only the keys that must move


def test_changing_one_arm_only_moves_keys_to_or_from_that_arm():
    old_arms = [Arm("a", "1", 40), Arm("b", "2", 30), Arm("c", "3", 30)]
    new_arms = [Arm("a", "1", 40), Arm("b", "2", 30), Arm("c", "3", 60)]
    old = {k: sticky_arm(k, old_arms, "x").name for k in KEYS}
    new = {k: sticky_arm(k, new_arms, "x").name for k in KEYS}
    moves = {(old[k], new[k]) for k in KEYS if old[k] != new[k]}
    assert moves <= {("a", "c"), ("b", "c")}


def test_experiments_with_different_salts_assign_independently():
    arms = [Arm("a", "1", 50), Arm("b", "2", 50)]
    first = [sticky_arm(k, arms, "exp-1").name for k in KEYS]
    second = [sticky_arm(k, arms, "exp-2").name for k in KEYS]
    both_a = sum(x == y == "a" for x, y in zip(first, second)) / len(KEYS)
    assert abs(both_a - 0.25) < 0.02


def test_arms_are_checked():
    with pytest.raises(ValueError):
        check_arms([])
    with pytest.raises(ValueError):
        check_arms([Arm("a", "1", 1), Arm("a", "2", 1)])
    with pytest.raises(ValueError):
        check_arms([Arm("a", "1", -1)])
    with pytest.raises(ValueError):
        check_arms([Arm("a", "1", 0)])


# ---- canary verdicts and steps ----------------------------------------------------------------

T = CanaryThresholds(min_samples=50, max_error_rate=0.05, max_error_increase=0.02, max_p99_s=0.5, max_p99_ratio=2.0, p99_slack_s=0.005)
STABLE = WindowStats(1000, 5, 0.020)


def test_no_verdict_before_the_minimum_sample_count():
    v = canary_verdict(WindowStats(49, 49, 9.0), STABLE, T)
    assert v.decision == WAIT and "49 of 50" in v.reasons[0]


@pytest.mark.parametrize(
    "canary, decision, phrase",
    [
        (WindowStats(100, 1, 0.021), PASS, ""),
        (WindowStats(100, 6, 0.021), FAIL, "> 5.00%"),  # absolute error rate
        (WindowStats(100, 4, 0.021), FAIL, "exceeds stable's"),  # 4% vs stable 0.5%: +3.5 points
        (WindowStats(100, 0, 0.600), FAIL, "p99 600.0 ms > 500.0 ms"),  # absolute p99
        (WindowStats(100, 0, 0.045), FAIL, "2x stable's"),  # relative p99
    ],
)
def test_canary_verdicts(canary, decision, phrase):
    v = canary_verdict(canary, STABLE, T)
    assert v.decision == decision, v.describe()
    assert phrase in " ".join(v.reasons)
    assert v.numbers["canary_requests"] == canary.requests and v.numbers["stable_p99_ms"] == pytest.approx(20.0)


def test_relative_limits_wait_for_enough_stable_samples_and_ignore_sub_slack_noise():
    assert canary_verdict(WindowStats(100, 4, 0.021), WindowStats(10, 0, 0.001), T).decision == PASS
    fast = WindowStats(1000, 0, 0.0004)
    assert canary_verdict(WindowStats(100, 0, 0.0012), fast, T).decision == PASS  # 3x, but 0.8 ms: noise


def test_canary_steps_with_an_injected_clock():
    plan = CanaryPlan((5, 25, 100), interval_s=60)
    ok = canary_verdict(WindowStats(100, 0, 0.02), STABLE, T)
    bad = canary_verdict(WindowStats(100, 50, 0.02), STABLE, T)
    waiting = canary_verdict(WindowStats(3, 0, 0.02), STABLE, T)
    assert canary_action(plan, 0, step_started=1000.0, now=1059.0, verdict=ok) == HOLD
    assert canary_action(plan, 0, 1000.0, 1060.0, ok) == ADVANCE
    assert canary_action(plan, 2, 1000.0, 1060.0, ok) == PROMOTE
    assert canary_action(plan, 0, 1000.0, 1000.5, bad) == ROLLBACK  # a breach never waits for the interval
    assert canary_action(plan, 0, 1000.0, 9999.0, waiting) == HOLD  # no evidence, no promotion


@pytest.mark.parametrize("steps, interval", [((), 60), ((0,), 60), ((50, 25), 60), ((5, 101), 60), ((5,), 0)])
def test_bad_plans_are_refused(steps, interval):
    with pytest.raises(ValueError):
        CanaryPlan(steps, interval)


def test_percentile():
    assert percentile([], 99) == 0.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(range(101)), 99) == 99.0


# ---- live state -------------------------------------------------------------------------------


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_sliding_window_forgets_old_requests():
    clock = Clock()
    w = SlidingWindow(10.0, buckets=10, clock=clock)
    for _ in range(20):
        w.add(0.010, False)
    clock.now += 5
    for _ in range(10):
        w.add(0.100, True)
    s = w.stats()
    assert (s.requests, s.errors) == (30, 10) and s.p99_s == pytest.approx(0.1)
    clock.now += 6  # the first 20 are older than the window now
    s = w.stats()
    assert (s.requests, s.errors) == (10, 10)
    clock.now += 20
    assert w.stats().requests == 0


def _ctx(**headers) -> CallContext:
    return CallContext(headers=tuple(headers.items()))


def test_router_without_a_split_is_the_route_lookup():
    routes = {"m": "3"}
    router = Router(routes)
    assert router.choose("m", None) == ("3", "")
    assert router.choose("other", None) == ("", "")
    routes["m"] = "4"  # the deployer's switch is seen at once
    assert router.choose("m", _ctx()) == ("4", "")


def test_router_split_sticky_by_header_and_per_arm_metrics():
    clock = Clock()
    router = Router({"m": "1"}, clock)
    router.splits["m"] = Split("ab", [Arm("a", "1", 50), Arm("b", "2", 50)], key_header="x-user-id", salt="e", clock=clock)
    first = router.choose("m", _ctx(**{"x-user-id": "alice"}))
    assert all(router.choose("m", _ctx(**{"x-user-id": "alice"})) == first for _ in range(20))
    assert {router.choose("m", _ctx())[1] for _ in range(4)} == {"a", "b"}  # no key: round robin
    request = pb.ModelInferRequest(model_name="m", id="req-1")
    router.observe("m", "a", "OK", 0.010, request, b"", b"", None)
    router.observe("m", "a", "INTERNAL", 0.020, pb.ModelInferRequest(), b"", None, _ctx(**{"x-request-id": "req-2"}))
    router.observe("m", "a", "INVALID_ARGUMENT", 0.001, pb.ModelInferRequest(), b"", None, None)  # the caller's fault: not counted
    window = router.splits["m"].window("a")
    assert (window.requests, window.errors) == (2, 1)
    assert router.feedback("m", "req-1", 1.0) == "a" and router.feedback("m", "req-2", 0.0) == "a"
    assert router.splits["m"].totals["a"].outcomes == [1.0, 0.0]
    with pytest.raises(ModelNotFound):
        router.feedback("m", "req-1", 1.0)  # one outcome per request
    with pytest.raises(ModelNotFound):
        router.feedback("other", "req-1", 1.0)


def test_reweighting_keeps_metrics_and_stickiness():
    split = Split("canary", canary_arms("1", "2", 5), key_header="x-user-id", salt="c")
    split.windows["canary"].add(0.01, True)
    wider = split.reweighted({"stable": 75, "canary": 25})
    assert wider.window("canary").errors == 1 and [a.weight for a in wider.arms] == [75, 25]
    on_canary = [k for k in KEYS[:2000] if split.pick(_ctx(**{"x-user-id": k})).name == "canary"]
    assert all(wider.pick(_ctx(**{"x-user-id": k})).name == "canary" for k in on_canary)


def test_header_lookup_reads_grpc_metadata_and_http_headers():
    from multidict import CIMultiDict

    assert header(_ctx(**{"x-user-id": "u"}), "x-user-id") == "u"
    assert header(CallContext(headers=CIMultiDict({"X-User-Id": "v"})), "x-user-id") == "v"
    assert header(None, "x-user-id") is None and header(CallContext(), "x-user-id") is None


def test_shadow_samples_evenly_and_drops_when_full():
    async def run():
        shadow = Shadow("2", percent=25, queue_size=3)
        for _ in range(20):
            shadow.offer(b"req", b"ans", 0.001)
        return shadow.stats

    stats = asyncio.run(run())
    assert stats.sent == 3 and stats.dropped == 2  # 5 of 20 sampled, the queue holds 3


def test_shadow_compares_answers_and_counts_failures():
    import numpy as np

    def answer(values) -> bytes:
        r = pb.ModelInferResponse(model_name="m")
        r.outputs.add(name="y", datatype="FP32", shape=[len(values), 1])
        r.raw_output_contents.append(np.asarray(values, dtype=np.float32).tobytes())
        return r.SerializeToString()

    async def run():
        replies = iter([answer([1.0, 2.0]), answer([1.0, 2.5]), RuntimeError("down")])

        async def send(raw, timeout):
            reply = next(replies)
            if isinstance(reply, Exception):
                raise reply
            return reply

        shadow = Shadow("2")
        shadow.start(send, workers=1)
        for _ in range(3):
            shadow.offer(pb.ModelInferRequest(model_name="m").SerializeToString(), answer([1.0, 2.0]), 0.001)
        for _ in range(100):
            if shadow.stats.compared + shadow.stats.errors == 3:
                break
            await asyncio.sleep(0.01)
        await shadow.stop()
        return shadow.stats.as_dict()

    report = asyncio.run(run())
    assert report["compared"] == 2 and report["errors"] == 1 and "down" in report["last_error"]
    assert report["agreement"] == 0.5 and report["mean_abs_diff"] == pytest.approx(0.125)


def test_random_weights_are_always_valid_splits():
    rng = random.Random(7)
    for _ in range(200):
        arms = [Arm(f"a{i}", str(i), rng.choice([0, 1, 5, 50])) for i in range(rng.randint(1, 4))]
        if sum(a.weight for a in arms) == 0:
            continue
        chosen = sticky_arm(str(rng.random()), arms)
        assert chosen.weight > 0


# ---- the controller's state machine, with the deployer and Triton faked ----------------------


class _Registry:
    def __init__(self, url: str):
        from server import migrations
        from server.db import make_engine

        self.engine = make_engine(url)
        migrations.upgrade(self.engine)
        self.audits: list[tuple] = []

    def audit(self, actor, action, target, outcome, detail=""):
        self.audits.append((actor, action, target, outcome, detail))


class _Deployer:
    def __init__(self, dp):
        self.dp = dp
        self.deployed: list[str] = []
        self.expiring: list[str] = []
        self.staged: list[tuple] = []
        self.held: list[str] = []

    async def deploy(self, ref, options=None, actor=""):
        name, version = ref.split(":")
        self.dp.routes[name] = version
        self.deployed.append(ref)

    async def stage(self, name, version):  # the real one loads and warms the version (test_traffic_controller)
        self.staged.append((name, version))
        return self.dp.routes[name]

    def hold(self, name):
        self.held.append(name)

    def schedule_expiry(self, name):
        self.expiring.append(name)


class _DataPlane:
    def __init__(self, clock):
        from types import SimpleNamespace

        self.routes = {"m": "1"}
        self.router = Router(self.routes, clock)
        self.models = {"m": SimpleNamespace(versions=frozenset({"1", "2"}))}
        self.backend_infer = None

    # the DataPlane surface the controller uses
    def ready_versions(self, name):
        return self.models[name].versions if name in self.models else frozenset()

    def live_version(self, name):
        return self.routes.get(name)

    async def refresh(self, name):
        return self.models.get(name)


def _controller(tmp_path, clock, registry=None):
    from server.control.rollout.traffic import TrafficController

    dp = _DataPlane(clock)
    registry = registry or _Registry(f"sqlite:///{tmp_path}/t.db")
    controller = TrafficController(dp, registry, _Deployer(dp), clock=clock)
    return controller, dp, registry


def _traffic(dp, clock, n, canary_error=False):
    for _ in range(n):
        version, arm = dp.router.choose("m", None)
        code = "INTERNAL" if canary_error and arm == "canary" else "OK"
        dp.router.observe("m", arm, code, 0.002, None, None, None, None)
        clock.now += 0.001


LIMITS = {"min_samples": 10, "max_error_rate": 0.05}


def test_controller_walks_passing_steps_then_promotes(tmp_path):
    async def run():
        clock = Clock()
        controller, dp, registry = _controller(tmp_path, clock)
        await controller.set_canary("m", 2, steps=[10, 50], interval_s=30, window_s=60, thresholds=LIMITS, actor="alice")
        _traffic(dp, clock, 200)
        await controller.analyze()
        assert controller.policies[("m", "split")].state["step"] == 0  # passing, but the step is not over
        clock.now += 30
        await controller.analyze()
        assert [a.weight for a in dp.router.splits["m"].arms] == [50, 50]
        _traffic(dp, clock, 100)
        clock.now += 30
        await controller.analyze()
        return controller, dp, registry

    controller, dp, registry = asyncio.run(run())
    assert controller.deployer.deployed == ["m:2"] and dp.routes["m"] == "2" and "m" not in dp.router.splits
    assert [a[1] for a in registry.audits] == ["canary.start", "canary.step", "canary.promote"]
    assert registry.audits[-1][0] == "traffic-controller" and "pass" in registry.audits[-1][4]
    assert [r["status"] for r in controller.store.history("m")] == ["promoted"]


def test_controller_rolls_a_breaching_canary_back_at_once_and_audits_the_figures(tmp_path):
    async def run():
        clock = Clock()
        controller, dp, registry = _controller(tmp_path, clock)
        await controller.set_canary("m", 2, percent=10, interval_s=600, thresholds=LIMITS)
        _traffic(dp, clock, 60, canary_error=True)  # 6 canary samples: no verdict yet
        await controller.analyze()
        assert "m" in dp.router.splits and controller.verdicts["m"].decision == "wait"
        _traffic(dp, clock, 60, canary_error=True)
        await controller.analyze()
        return controller, dp, registry

    controller, dp, registry = asyncio.run(run())
    assert "m" not in dp.router.splits and dp.routes["m"] == "1" and controller.deployer.deployed == []
    actor, action, target, outcome, detail = registry.audits[-1]
    assert (actor, action, target, outcome) == ("traffic-controller", "canary.rollback", "m:2", "rolled_back")
    assert "canary_requests=12 canary_errors=12" in detail and "stable_errors=0" in detail
    assert controller.deployer.expiring == ["m"]  # the canary is unloaded after the grace period
    assert controller.get_policy("m")["status"] == "rolled_back"


def test_active_policies_are_installed_again_after_a_restart(tmp_path):
    async def first():
        clock = Clock()
        controller, dp, registry = _controller(tmp_path, clock)
        await controller.set_canary("m", 2, steps=[10, 50], interval_s=1, thresholds=LIMITS, key_header="x-user-id")
        _traffic(dp, clock, 200)
        clock.now += 2
        await controller.analyze()  # now at 50%
        return registry

    registry = asyncio.run(first())

    async def second():
        clock = Clock()
        controller, dp, _ = _controller(tmp_path, clock, registry)
        await controller.start()
        try:
            return controller.get_policy("m"), dp.router.choose("m", _ctx(**{"x-user-id": "u1"}))
        finally:
            await controller.stop()

    policy, choice = asyncio.run(second())
    assert (policy["kind"], policy["status"], policy["step"], policy["key_header"]) == ("canary", "active", 1, "x-user-id")
    assert [a["weight"] for a in policy["arms"]] == [50, 50] and choice[1] in {"stable", "canary"}


def test_controller_refuses_what_makes_no_sense(tmp_path):
    from server.errors import Conflict, InvalidRequest

    async def run():
        controller, dp, _ = _controller(tmp_path, Clock())
        with pytest.raises(InvalidRequest):
            await controller.set_canary("m", 2, steps=[50, 10])
        with pytest.raises(Conflict):
            await controller.set_canary("m", 1, percent=5)  # already live
        await controller.set_canary("m", 2, percent=5)
        with pytest.raises(Conflict):
            await controller.set_experiment("m", [("a", 1, 1), ("b", 2, 1)])  # one split at a time
        with pytest.raises(Conflict):
            await controller.switch("m")  # no blue-green staged
        await controller.rollback("m")
        with pytest.raises(InvalidRequest):
            await controller.set_experiment("m", [("a", 1, 1)])
        with pytest.raises(ModelNotFound):
            await controller.feedback("m", "nope", 1.0)

    asyncio.run(run())


def test_cli_parsers():
    import typer

    from server.cli.options import parse_duration
    from server.cli.traffic import parse_arm, parse_ref

    assert [parse_duration(x) for x in ("60s", "60", "2m", "500ms", "1h")] == [60.0, 60.0, 120.0, 0.5, 3600.0]
    assert parse_ref("ranker:3") == ("ranker", 3) and parse_arm("treatment=2:25") == ("treatment", 2, 25.0)
    assert parse_arm("control=1") == ("control", 1, 1.0)
    for bad in (lambda: parse_duration("soon"), lambda: parse_ref("ranker"), lambda: parse_arm("x=y:1")):
        with pytest.raises(typer.BadParameter):
            bad()


def test_each_canary_step_lasts_its_whole_interval(tmp_path):
    """Steps [10, 50, 100] every 30 s: an advance restarts the step's clock, so 50 % holds for 30 s."""

    async def run():
        clock = Clock()
        controller, dp, registry = _controller(tmp_path, clock)
        await controller.set_canary("m", 2, steps=[10, 50, 100], interval_s=30, window_s=600, thresholds=LIMITS)
        _traffic(dp, clock, 200)
        clock.now += 30
        await controller.analyze()
        assert [a.weight for a in dp.router.splits["m"].arms] == [50, 50]
        weights = []
        for _ in range(5):  # 29.5 s more of passing traffic: still the 50 % step
            clock.now += 5.9
            _traffic(dp, clock, 10)
            await controller.analyze()
            weights.append([a.weight for a in dp.router.splits["m"].arms])
        assert weights == [[50, 50]] * 5 and controller.policies[("m", "split")].state["step"] == 1
        clock.now += 1
        await controller.analyze()
        assert [a.weight for a in dp.router.splits["m"].arms] == [0, 100]
        assert controller.deployer.deployed == []  # 100 % is a step too: promoted only after it
        clock.now += 30
        await controller.analyze()
        return controller, dp, registry

    controller, dp, registry = asyncio.run(run())
    assert controller.deployer.deployed == ["m:2"] and "m" not in dp.router.splits
    assert [a[1] for a in registry.audits] == ["canary.start", "canary.step", "canary.step", "canary.promote"]


# ---- the pure policy's exact answers (the mutation pass of traffic_policy.py) --------------------------



@pytest.mark.parametrize(
    ("arms", "message"),
    [
        ([], "a split needs at least one arm"),
        ([Arm("a", "1", 1), Arm("a", "2", 1)], "arm names must be distinct, got ['a', 'a']"),
        ([Arm("", "1", 1)], "every arm needs a name and a version"),
        ([Arm("a", "", 1)], "every arm needs a name and a version"),
        ([Arm("a", "1", -1)], "arm 'a': weight must be a finite number >= 0, got -1"),
        ([Arm("a", "1", float("inf"))], "arm 'a': weight must be a finite number >= 0, got inf"),
        ([Arm("a", "1", 0), Arm("b", "2", 0)], "the arms' weights sum to 0"),
    ],
)
def test_a_bad_split_is_refused_naming_the_problem(arms, message):
    with pytest.raises(ValueError) as err:
        check_arms(arms)
    assert str(err.value) == message
    check_arms([Arm("a", "1", 0), Arm("b", "2", 1)])


def test_the_unit_hash_is_stable_and_inside_zero_one():
    assert unit_hash("k", "s") == 0.8324650035011413  # the same in every process and release: sticky keys stay put
    values = [unit_hash(str(i), "salt") for i in range(2000)]
    assert all(0 < v < 1 for v in values) and 0.45 < sum(values) / len(values) < 0.55
    assert unit_hash("k", "a") != unit_hash("k", "b")


def test_an_arm_without_weight_wins_no_key():
    arms = [Arm("a", "1", 0), Arm("b", "2", 1)]
    assert {sticky_arm(str(i), arms).name for i in range(200)} == {"b"}


def test_smooth_weighted_round_robin_spreads_the_minority_arms():
    rr = SmoothWeighted([Arm("a", "1", 5), Arm("b", "2", 1), Arm("c", "3", 1)])
    assert "".join(rr.next().name for _ in range(14)) == "aabacaa" * 2


def test_canary_percentages_are_clamped_to_zero_and_a_hundred():
    assert canary_arms("1", "2", 150) == [Arm("stable", "1", 0.0), Arm("canary", "2", 100.0)]
    assert canary_arms("1", "2", -5) == [Arm("stable", "1", 100.0), Arm("canary", "2", 0.0)]
    assert canary_arms("1", "2", "25") == [Arm("stable", "1", 75.0), Arm("canary", "2", 25.0)]


def test_percentiles_interpolate_linearly():
    assert percentile([3, 1, 2, 4], 50) == 2.5 and percentile([1], 99) == 1.0 and percentile([], 50) == 0.0
    assert percentile([1, 2, 3, 4, 5], 99) == pytest.approx(4.96) and percentile([10, 20], 25) == 12.5
    assert WindowStats(4, 1).error_rate == 0.25 and WindowStats().error_rate == 0.0


def test_a_failing_canary_lists_every_reason_with_its_figures():
    verdict = canary_verdict(WindowStats(100, 10, 1.5, 0.1), WindowStats(100, 1, 0.2, 0.1), CanaryThresholds(min_samples=10))
    assert verdict.describe() == (
        "fail: canary error rate 10.00% > 5.00%; canary error rate 10.00% exceeds stable's 1.00% by more than 2.00%; "
        "canary p99 1500.0 ms > 1000.0 ms; canary p99 1500.0 ms > 2x stable's 200.0 ms "
        "[canary_requests=100 canary_errors=10 canary_error_rate=0.1 canary_p99_ms=1500 "
        "stable_requests=100 stable_errors=1 stable_error_rate=0.01 stable_p99_ms=200]"
    )
    waiting = canary_verdict(WindowStats(5), WindowStats(), CanaryThresholds(min_samples=10))
    assert waiting.decision == "wait" and waiting.reasons == ("5 of 10 canary samples",)
    assert canary_verdict(WindowStats(10), WindowStats(), CanaryThresholds(min_samples=10)).describe().startswith("pass: within thresholds [")


def test_relative_limits_wait_for_enough_stable_samples_and_ignore_sub_slack_latency():
    t = CanaryThresholds(min_samples=10)
    assert canary_verdict(WindowStats(100, 4, 0.4), WindowStats(9, 0, 0.1), t).decision == "pass"  # stable too thin to compare
    assert canary_verdict(WindowStats(100, 4, 0.4), WindowStats(10, 0, 0.1), t).decision == "fail"  # 4% vs 0%, 4x p99
    assert canary_verdict(WindowStats(100, 0, 0.007), WindowStats(100, 0, 0.003), t).decision == "pass"  # 2.3x, but 4 ms
    assert canary_verdict(WindowStats(100, 0, 0.020), WindowStats(100, 0, 0.003), t).reasons == ("canary p99 20.0 ms > 2x stable's 3.0 ms",)
    assert canary_verdict(WindowStats(100, 5, 0.1), WindowStats(100, 5, 0.1), t).decision == "pass"  # 5% is the limit, not over it


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_samples": 0}, "min_samples must be >= 1"),
        ({"max_error_rate": -0.1}, "max_error_rate must be >= 0"),
        ({"max_error_increase": -1}, "max_error_increase must be >= 0"),
        ({"max_p99_s": -1}, "max_p99_s must be >= 0"),
        ({"max_p99_ratio": float("nan")}, "max_p99_ratio must be >= 0"),
        ({"p99_slack_s": -1}, "p99_slack_s must be >= 0"),
    ],
)
def test_thresholds_refuse_negative_limits(kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        CanaryThresholds(**kwargs)
    CanaryThresholds(min_samples=1, max_error_rate=0, max_error_increase=0, max_p99_s=0, max_p99_ratio=0, p99_slack_s=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": ()}, "a canary plan needs at least one step"),
        ({"steps": (0,)}, "canary steps are percentages in \\(0, 100\\], got 0"),
        ({"steps": (101,)}, "canary steps are percentages in \\(0, 100\\], got 101"),
        ({"steps": (50, 10)}, "canary steps must not decrease, got \\[50, 10\\]"),
        ({"interval_s": 0}, "the step interval must be > 0 seconds"),
    ],
)
def test_a_canary_plan_refuses_bad_steps(kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        CanaryPlan(**kwargs)
    assert CanaryPlan((10, 10, 100)).steps == (10, 10, 100) and CanaryPlan().steps == (5.0,) and CanaryPlan().interval_s == 60.0


def test_a_step_advances_once_its_interval_has_passed_and_the_last_one_promotes():
    plan = CanaryPlan((10, 50), 30.0)
    passing, failing, waiting = Verdict("pass"), Verdict("fail"), Verdict("wait")
    assert canary_action(plan, 0, 100.0, 129.9, passing) == "hold"
    assert canary_action(plan, 0, 100.0, 130.0, passing) == "advance"
    assert canary_action(plan, 1, 100.0, 130.0, passing) == "promote"
    assert canary_action(plan, 1, 100.0, 500.0, waiting) == "hold"
    assert canary_action(plan, 0, 100.0, 100.0, failing) == "rollback"


def test_sticky_assignment_is_the_same_in_every_release():
    """Moving a caller between arms mid-experiment spoils it: the assignment of these keys is pinned."""
    arms = [Arm("stable", "1", 50), Arm("canary", "2", 50)]
    assert "".join(sticky_arm(f"user-{i}", arms).name[0] for i in range(16)) == "scssscssscsscccc"


def test_verdict_limits_are_exceeded_only_past_them():
    t = CanaryThresholds(min_samples=10, max_error_rate=1.0, max_error_increase=0.25, max_p99_s=1.0, max_p99_ratio=2.0, p99_slack_s=0.375)
    assert canary_verdict(WindowStats(100, 50, 1.0), WindowStats(100, 25, 0.5), t).decision == "pass"  # +0.25 errors, p99 at 1 s, 2x
    assert canary_verdict(WindowStats(100, 0, 0.5), WindowStats(100, 0, 0.125), t).decision == "pass"  # 4x, but only the slack more
    waiting = canary_verdict(WindowStats(5), WindowStats(), t)
    assert waiting.numbers["canary_requests"] == 5.0 and waiting.numbers["stable_p99_ms"] == 0.0


def test_small_steps_and_a_single_arm_are_valid():
    assert CanaryPlan((0.5, 1, 100)).steps == (0.5, 1, 100)
    rr = SmoothWeighted([Arm("only", "1", 1)])
    assert [rr.next().name for _ in range(3)] == ["only"] * 3
