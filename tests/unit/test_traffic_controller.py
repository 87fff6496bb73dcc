"""The traffic controller beyond the canary: blue-green, A/B, shadow, staging, restart, status.

The policies table is a real SQLite database (migrated as the frontend migrates it); the deployer
and the data plane are recorders (the real ones need Triton: the integration suite runs them).
"""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from server.control.composition.composites import COMPOSITE_FORMAT
from server.control.rollout.deployer import Deployer
from server.errors import Conflict, InvalidRequest, ModelNotFound, BackendUnavailable
from server.dataplane.traffic_policy import sticky_arm

from tests.unit.test_traffic_policy import LIMITS, Clock, _ctx, _DataPlane, _Deployer, _Registry, _traffic


class _Expiry:
    def __init__(self):
        self.cancelled = False

    def cancel(self):
        self.cancelled = True


class _Recorder(Deployer):
    """The real deployer's staging (``Deployer.stage``: its lock, checks and grace-period hold) over
    recorders of what needs Triton: the backend choice, the config, the load and the warm-up."""

    def __init__(self, dp, registry, repository):
        super().__init__(registry, dp, repository)
        self.fake = _Deployer(dp)  # deploy() and the expiries, as the other controller tests see them
        self.deployed, self.expiring = self.fake.deployed, self.fake.expiring
        self.calls: list[tuple] = []
        self.fail_deploy: Exception | None = None
        self.composites = SimpleNamespace(stage=self._stage_composite)

    async def deploy(self, ref, options=None, actor=""):
        self.calls.append(("deploy", ref, actor))
        if self.fail_deploy is not None:
            raise self.fail_deploy
        await self.fake.deploy(ref, options, actor)

    def schedule_expiry(self, name):
        self.fake.schedule_expiry(name)

    def choice_for(self, record):
        self.calls.append(("choice_for", record.version))

    def config_for(self, name, live_record, serving, versions, choice=None):
        self.calls.append(("config_for", name, live_record.version, tuple(versions)))
        self.serving = serving
        return "config"

    async def _load(self, name, record, config, versions):
        self.calls.append(("load", name, record.version, config, tuple(versions)))

    async def _warm(self, name, record):
        self.calls.append(("warm", name, record.version))

    async def _stage_composite(self, name, record):
        self.calls.append(("composite", name, record.version))
        return "7"


SIG = {"inputs": [{"name": "x", "datatype": "FP32", "dims": [-1, 3]}], "outputs": [{"name": "y", "datatype": "FP32", "dims": [-1]}]}


class _Versions(_Registry):
    """The registry's lookups the staging uses, over the real policies table."""

    def __init__(self, url):
        super().__init__(url)
        self.records = {v: SimpleNamespace(version=v, format="onnx", signature=SIG, ref=f"m:{v}") for v in (1, 2, 3)}
        self.live: int | None = 1
        self.verified: list[tuple] = []
        self.serving: dict = {}  # the endpoint's stored serving options

    def get(self, name, version=None):
        self._known(name)
        return self.records[version]

    def verify_signed(self, name, version):
        self.verified.append((name, version))

    def endpoint(self, name, history=20):
        self._known(name)
        max(history, 1)  # the real registry's history limit: a count (None is a TypeError there too)
        return SimpleNamespace(live=self.live, serving=self.serving)

    @staticmethod
    def _known(name):
        if name != "m":  # one endpoint, as the real registry would answer for any other name
            raise ModelNotFound(f"model '{name}' not found")


def _make(tmp_path, clock=None, *, real_stage=False, registry=None):
    from server.control.rollout.traffic import TrafficController

    clock = clock or Clock()
    dp = _DataPlane(clock)
    registry = registry or _Versions(f"sqlite:///{tmp_path}/t.db")
    deployer = _Recorder(dp, registry, tmp_path / "repository")
    controller = TrafficController(dp, registry, deployer, clock=clock, shadow_workers=3)
    staged: list[tuple] = []
    if not real_stage:
        deployer.stage = deployer.fake.stage  # records what is staged, loads nothing
        staged = deployer.fake.staged
    return SimpleNamespace(c=controller, dp=dp, reg=registry, dep=deployer, staged=staged, clock=clock)


def _audits(reg):
    return [(a[1], a[2], a[3]) for a in reg.audits]


def _statuses(c, name="m"):
    return [(r["kind"], r["status"]) for r in reversed(c.store.history(name))]


# ---- blue-green ---------------------------------------------------------------------------------


def test_bluegreen_stages_green_without_moving_traffic_and_switch_moves_all_of_it(tmp_path):
    async def run():
        t = _make(tmp_path)
        policy = await t.c.set_bluegreen("m", 2, actor="alice")
        assert t.staged == [("m", 2)] and policy.spec == {"blue": "1", "green": "2"} and policy.state == {"staged": True}
        assert t.dp.router.choose("m", None) == ("1", "")  # staged: blue answers everything
        status = t.c.get_policy("m")
        assert (status["kind"], status["status"], status["green"], status["live"]) == ("bluegreen", "active", "2", "1")
        assert status["key_header"] == ""  # a blue-green pins no caller to an arm: no key header
        assert _audits(t.reg) == [("bluegreen.stage", "m:2", "ok")] and t.reg.audits[0][0] == "alice"
        assert "blue=1" in t.reg.audits[0][4]
        await t.c.switch("m", actor="bob")
        return t, policy

    t, policy = asyncio.run(run())
    assert t.dep.deployed == ["m:2"] and t.dep.calls == [("deploy", "m:2", "bob")] and t.dp.routes["m"] == "2"
    assert policy.status == "switched" and ("m", "split") not in t.c.policies
    assert _audits(t.reg)[-1] == ("bluegreen.promote", "m:2", "ok") and t.reg.audits[-1][0] == "bob"
    assert t.reg.audits[-1][4] == "manual"
    assert _statuses(t.c) == [("bluegreen", "switched")]
    assert t.c.get_policy("m")["status"] == "switched" and t.dep.expiring == ["m"]


def test_a_green_that_is_not_ready_is_not_switched_to(tmp_path):
    async def run():
        t = _make(tmp_path)
        await t.c.set_bluegreen("m", 2)
        t.dp.models["m"].versions = frozenset({"1"})  # Triton says green went away
        with pytest.raises(Conflict, match="green m:2 is not ready; blue keeps serving"):
            await t.c.switch("m")
        return t

    t = asyncio.run(run())
    assert t.dep.deployed == [] and t.dp.routes["m"] == "1" and t.c.policies[("m", "split")].status == "active"


def test_bluegreen_refuses_the_live_version_and_a_second_split(tmp_path):
    async def run():
        t = _make(tmp_path)
        with pytest.raises(Conflict, match="m:1 is already live"):
            await t.c.set_bluegreen("m", 1)
        t.dp.routes.pop("m")
        with pytest.raises(Conflict, match="endpoint 'm' has no live version on this frontend; deploy one first"):
            await t.c.set_bluegreen("m", 2)
        t.dp.routes["m"] = "1"
        await t.c.set_bluegreen("m", 2)
        with pytest.raises(Conflict, match="endpoint 'm' already has a bluegreen running; promote or roll it back first"):
            await t.c.set_bluegreen("m", 3)
        with pytest.raises(Conflict, match="endpoint 'x' has no canary or bluegreen running"):
            await t.c.promote("x")
        with pytest.raises(Conflict, match="endpoint 'x' has no traffic split running"):
            await t.c.rollback("x")
        return t

    t = asyncio.run(run())
    assert t.staged == [("m", 2)]


def test_rolling_a_bluegreen_back_ends_it_and_keeps_blue(tmp_path):
    async def run():
        t = _make(tmp_path)
        await t.c.set_bluegreen("m", 2)
        await t.c.rollback("m", actor="carol")
        return t

    t = asyncio.run(run())
    assert t.dp.routes["m"] == "1" and t.dep.deployed == []
    assert t.reg.audits[-1][:4] == ("carol", "bluegreen.rollback", "m:2", "ok") and t.reg.audits[-1][4] == "manual"
    assert _statuses(t.c) == [("bluegreen", "ended")] and t.c.get_policy("m")["status"] == "ended"


def test_a_failed_promotion_rolls_back_and_says_why(tmp_path):
    async def run():
        t = _make(tmp_path)
        await t.c.set_bluegreen("m", 2)
        t.dep.fail_deploy = BackendUnavailable("warm-up rows failed")
        with pytest.raises(BackendUnavailable):
            await t.c.switch("m", actor="dave")
        return t

    t = asyncio.run(run())
    actor, action, target, outcome, detail = t.reg.audits[-1]
    assert (actor, action, target, outcome) == ("dave", "bluegreen.rollback", "m:2", "rolled_back")
    assert detail == f"promotion failed: {BackendUnavailable('x').reason}: warm-up rows failed"
    assert _statuses(t.c) == [("bluegreen", "rolled_back")] and "m" not in t.dp.router.splits


def test_a_canary_promotion_sends_everything_to_the_canary_while_the_route_moves(tmp_path):
    seen = []

    async def run():
        t = _make(tmp_path)
        await t.c.set_canary("m", 2, percent=10, thresholds=LIMITS)

        async def deploy(ref, options=None, actor=""):
            seen.append(([a.weight for a in t.dp.router.splits["m"].arms], actor))
            t.dp.routes["m"] = "2"

        t.dep.deploy = deploy
        await t.c.promote("m")
        return t

    t = asyncio.run(run())
    assert seen == [([0.0, 100.0], "traffic-controller")]
    assert t.reg.audits[-1][:4] == ("traffic-controller", "canary.promote", "m:2", "ok") and t.reg.audits[-1][4] == "manual"
    assert _statuses(t.c) == [("canary", "promoted")] and t.c.ended["m"][1].kind == "canary"


# ---- canary: what the analysis does when the world moved -------------------------------------------


def test_a_canary_whose_endpoint_was_deployed_meanwhile_ends_as_superseded(tmp_path):
    async def run():
        t = _make(tmp_path)
        await t.c.set_canary("m", 2, percent=10, thresholds=LIMITS)
        t.dp.routes["m"] = "3"
        await t.c.analyze()
        return t

    t = asyncio.run(run())
    assert "m" not in t.dp.router.splits and ("m", "split") not in t.c.policies
    assert t.reg.audits[-1] == ("traffic-controller", "canary.end", "m:2", "superseded", "the endpoint now routes to 3")
    assert _statuses(t.c) == [("canary", "ended")] and t.dep.expiring == ["m"] and t.dep.deployed == []


def test_a_canary_whose_split_disappeared_ends_without_a_decision(tmp_path):
    async def run():
        t = _make(tmp_path)
        await t.c.set_canary("m", 2, percent=10, thresholds=LIMITS)
        t.dp.router.splits.pop("m")
        await t.c.analyze()
        return t

    t = asyncio.run(run())
    assert _statuses(t.c) == [("canary", "ended")] and _audits(t.reg) == [("canary.start", "m:2", "ok")]


def _after_a_passing_tick(tmp_path, decide):
    """A canary at 10 % with one passing analysis behind it, then ``decide(controller)``."""

    async def run():
        t = _make(tmp_path)
        await t.c.set_canary("m", 2, percent=10, interval_s=600, thresholds=LIMITS, actor="alice")
        _traffic(t.dp, t.clock, 200)
        await t.c.analyze()
        await decide(t.c)
        return t

    return asyncio.run(run())


def test_a_manual_canary_rollback_is_recorded_as_rolled_back_by_its_actor(tmp_path):
    t = _after_a_passing_tick(tmp_path, lambda c: c.rollback("m", actor="erin"))
    actor, action, target, outcome, detail = t.reg.audits[-1]
    assert (actor, action, target, outcome) == ("erin", "canary.rollback", "m:2", "rolled_back")
    assert detail.startswith("manual; ") and "canary_requests=20" in detail
    assert _statuses(t.c) == [("canary", "rolled_back")] and t.dp.routes["m"] == "1"


def test_set_canary_records_its_plan_and_folds_the_first_percent_into_the_steps(tmp_path):
    async def run():
        t = _make(tmp_path)
        policy = await t.c.set_canary("m", 2, percent=5, steps=[25, 100], interval_s=0, window_s=0, key_header="x-user", actor="al")
        return t, policy

    t, policy = asyncio.run(run())
    assert policy.spec["steps"] == [5.0, 25.0, 100.0] and policy.spec["interval_s"] == 60.0 and policy.spec["window_s"] == 60.0
    assert (policy.spec["stable"], policy.spec["canary"], policy.spec["key_header"]) == ("1", "2", "x-user")
    assert [a.weight for a in t.dp.router.splits["m"].arms] == [95.0, 5.0]
    assert t.dp.router.splits["m"].key_header == "x-user" and t.dp.router.splits["m"].salt == "canary:m:2"
    row = t.c.store.history("m")[0]
    assert (row["kind"], row["slot"], row["actor"], row["state"]) == ("canary", "split", "al", {"step": 0})
    assert t.reg.audits[-1][:4] == ("al", "canary.start", "m:2", "ok")
    assert t.reg.audits[-1][4].startswith("stable=1 steps=[5.0, 25.0, 100.0] interval_s=60 thresholds=")


@pytest.mark.parametrize("window", [-1.0])
def test_set_canary_refuses_a_negative_window_and_bad_thresholds(tmp_path, window):
    async def run():
        t = _make(tmp_path)
        with pytest.raises(InvalidRequest, match="window_s must be > 0"):
            await t.c.set_canary("m", 2, percent=5, window_s=window)
        with pytest.raises(InvalidRequest):
            await t.c.set_canary("m", 2, percent=5, thresholds={"max_error_rate": -1})
        with pytest.raises(InvalidRequest):
            await t.c.set_canary("m", 2, percent=5, thresholds={"no_such_limit": 1})
        return t

    t = asyncio.run(run())
    assert t.staged == [] and t.c.store.history("m") == []


# ---- A/B ------------------------------------------------------------------------------------------


def test_an_experiment_gives_each_user_the_arm_its_key_hashes_to_and_stages_only_new_versions(tmp_path):
    async def run():
        t = _make(tmp_path)
        policy = await t.c.set_experiment("m", [("control", 1, 50), ("treatment", 2, 50)], key_header="x-user-id", experiment="color", actor="ann")
        return t, policy

    t, policy = asyncio.run(run())
    assert t.staged == [("m", 2)]
    split = t.dp.router.splits["m"]
    assert (split.kind, split.key_header, split.salt) == ("ab", "x-user-id", "color")
    for user in (f"u{i}" for i in range(40)):
        expected = sticky_arm(user, split.arms, "color")
        assert t.dp.router.choose("m", _ctx(**{"x-user-id": user})) == (expected.version, expected.name)
    assert policy.spec == {
        "experiment": "color", "key_header": "x-user-id",
        "arms": [{"name": "control", "version": "1", "weight": 50.0}, {"name": "treatment", "version": "2", "weight": 50.0}],
    }  # fmt: skip
    assert t.reg.audits[-1] == ("ann", "ab.start", "m:color", "ok", "control=m:1@50, treatment=m:2@50; key header x-user-id")


def test_an_unnamed_experiment_is_named_after_its_endpoint(tmp_path):
    async def run():
        t = _make(tmp_path)
        t.dp.models["m"].versions = frozenset({"1", "2", "3"})
        await t.c.set_experiment("m", [("a", 2, 1), ("b", 3, 1)])
        return t

    t = asyncio.run(run())
    assert t.staged == [("m", 2), ("m", 3)] and t.dp.router.splits["m"].salt == "m"
    assert t.reg.audits[-1][2] == "m:m" and t.reg.audits[-1][4].endswith("; key header -")
    assert t.c.ab_report("m")["experiment"] == "m"


def test_the_report_of_a_split_that_is_no_named_experiment_is_named_by_its_kind(tmp_path):
    async def run():
        t = _make(tmp_path)
        await t.c.set_canary("m", 2, percent=10, thresholds=LIMITS)
        return t.c.ab_report("m")

    report = asyncio.run(run())
    assert report["experiment"] == "canary" and [a["name"] for a in report["arms"]] == ["stable", "canary"]


def test_experiments_refuse_bad_arms_before_staging(tmp_path):
    async def run():
        t = _make(tmp_path)
        with pytest.raises(InvalidRequest) as one_arm:
            await t.c.set_experiment("m", [("a", 1, 1)])
        assert one_arm.value.message == "an experiment needs two or more arms"
        with pytest.raises(InvalidRequest, match="arm names must be distinct"):
            await t.c.set_experiment("m", [("a", 1, 1), ("a", 2, 1)])
        t.dp.routes.pop("m")
        with pytest.raises(Conflict, match="no live version"):
            await t.c.set_experiment("m", [("a", 1, 1), ("b", 2, 1)])
        return t

    assert asyncio.run(run()).staged == []


def test_a_feedback_for_a_request_another_process_answered_waits_for_the_collectors_read(tmp_path, caplog):
    """The controller hands an unknown id to its arm-report collector's reads (server.control.rollout.arm_reports):
    the id a read brings in is taken with its arm; without a collector the unknown id is refused at once."""

    class Reports:  # the collector's one method the wait uses: a read that brings the other process's id in
        def __init__(self, router):
            self.router, self.reads = router, 0

        async def read_now(self):
            self.reads += 1
            self.router.splits["m"].request_arms["elsewhere"] = "treatment"

    async def run():
        t = _make(tmp_path)
        await t.c.set_experiment("m", [("control", 1, 1), ("treatment", 2, 1)], experiment="exp")
        with pytest.raises(ModelNotFound):  # no collector: nothing reports to this process
            await t.c.feedback("m", "elsewhere", 1.0)
        t.c.arm_reports = reports = Reports(t.dp.router)
        arm = await t.c.feedback("m", "elsewhere", 1.0)
        return arm, reports.reads, t.c.ab_report("m")

    with caplog.at_level(logging.WARNING, logger="server.control.rollout.arm_reports"):
        arm, reads, report = asyncio.run(run())
    assert not caplog.records  # without a collector the refusal tried no read (none failed)
    assert (arm, reads) == ("treatment", 1)
    assert {a["name"]: a["outcomes"] for a in report["arms"]} == {"control": 0, "treatment": 1}


def test_the_ab_report_counts_each_arm_and_compares_it_with_the_control(tmp_path):
    async def run():
        t = _make(tmp_path)
        await t.c.set_experiment("m", [("control", 1, 1), ("treatment", 2, 1)], experiment="exp")
        router = t.dp.router
        for i in range(40):
            version, arm = router.choose("m", None)
            error = arm == "treatment" and i % 4 == 1
            router.observe("m", arm, "INTERNAL" if error else "OK", 0.010 if arm == "control" else 0.030, SimpleNamespace(id=f"r{i}"), None, None, None)
        arms = {f"r{i}": await t.c.feedback("m", f"r{i}", 1.0 if i % 2 == 0 else 0.0) for i in range(40)}
        with pytest.raises(InvalidRequest) as no_id:
            await t.c.feedback("m", "", 1.0)
        assert no_id.value.message == "feedback needs the request id"
        return t, arms

    t, arms = asyncio.run(run())
    report = t.c.ab_report("m")
    assert report["name"] == "m" and report["experiment"] == "exp"
    control, treatment = report["arms"]
    assert (control["name"], control["version"], control["weight"], control["requests"], control["errors"]) == ("control", "1", 1.0, 20, 0)
    assert (treatment["name"], treatment["version"], treatment["requests"], treatment["errors"]) == ("treatment", "2", 20, 10)
    assert treatment["error_rate"] == 0.5 and control["error_rate"] == 0.0
    assert control["latency_mean_ms"] == pytest.approx(10.0) and treatment["latency_mean_ms"] == pytest.approx(30.0)
    assert control["latency_p50_ms"] == pytest.approx(10.0) and treatment["latency_p99_ms"] == pytest.approx(30.0)
    assert control["outcomes"] == 20 and control["outcome_mean"] == 1.0 and treatment["outcome_mean"] == 0.0
    assert sorted(set(arms.values())) == ["control", "treatment"]
    metrics = [(c["arm"], c["control"], c["metric"]) for c in report["comparisons"]]
    assert ("treatment", "control", "error_rate") in metrics and ("treatment", "control", "outcome") in metrics
    assert {c["arm"] for c in report["comparisons"]} == {"treatment"}
    z = next(c for c in report["comparisons"] if c["metric"] == "error_rate")
    assert z["significant"] is True
    lenient = next(c for c in t.c.ab_report("m", alpha=1e-300)["comparisons"] if c["metric"] == "error_rate")
    assert lenient["significant"] is False  # alpha reaches the tests


def test_an_ab_report_without_traffic_has_zero_rates_and_no_comparisons(tmp_path):
    async def run():
        t = _make(tmp_path)
        await t.c.set_experiment("m", [("a", 1, 1), ("b", 2, 3)])
        return t

    t = asyncio.run(run())
    report = t.c.ab_report("m")
    assert report["comparisons"] == []
    for arm in report["arms"]:
        assert (arm["requests"], arm["error_rate"], arm["latency_mean_ms"], arm["outcomes"], arm["outcome_mean"]) == (0, 0.0, 0.0, 0, 0.0)
    assert [a["weight"] for a in report["arms"]] == [1.0, 3.0]


@pytest.mark.parametrize("alpha", [0.0, 1.0, -0.1, 2.0])
def test_an_ab_report_refuses_an_alpha_outside_zero_one(tmp_path, alpha):
    t = _make(tmp_path)
    with pytest.raises(InvalidRequest, match=f"alpha must be in \\(0, 1\\), got {alpha}"):
        t.c.ab_report("m", alpha)


def test_an_ended_experiment_still_reports_and_an_unknown_one_is_not_found(tmp_path):
    async def run():
        t = _make(tmp_path)
        with pytest.raises(ModelNotFound, match="endpoint 'm' has no experiment to report on"):
            t.c.ab_report("m")
        await t.c.set_experiment("m", [("a", 1, 1), ("b", 2, 1)], experiment="e1")
        _, arm = t.dp.router.choose("m", None)
        t.dp.router.observe("m", arm, "OK", 0.001, None, None, None, None)
        await t.c.rollback("m", actor="fay")
        return t

    t = asyncio.run(run())
    assert "m" not in t.dp.router.splits
    report = t.c.ab_report("m")
    assert report["experiment"] == "e1" and sum(a["requests"] for a in report["arms"]) == 1
    assert t.reg.audits[-1][:4] == ("fay", "ab.end", "m:e1", "ok") and _statuses(t.c) == [("ab", "ended")]


# ---- shadow ----------------------------------------------------------------------------------------


def _sender(sent):
    async def send(raw, timeout):
        sent.append((raw, timeout))
        raise BackendUnavailable("shadow down")

    return send


async def _until(condition, timeout_s=30.0):
    """A wait (not a timing claim): give the shadow's workers the loop until ``condition`` holds."""
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_a_shadow_copies_its_share_to_the_staged_version_and_its_stop_keeps_the_report(tmp_path):
    sent: list = []

    async def run():
        t = _make(tmp_path)
        t.dp.backend_infer = _sender(sent)
        policy = await t.c.set_shadow("m", 2, 50, actor="gus")
        shadow = t.dp.router.shadows["m"]
        assert (shadow.version, shadow.percent, len(shadow.tasks)) == ("2", 50.0, 3)
        assert t.c.policies[("m", "shadow")] is policy and policy.spec == {"version": "2", "percent": 50.0}
        from server.protogen.inference import grpc_service_pb2 as pb

        raw = pb.ModelInferRequest(model_name="m").SerializeToString()
        for _ in range(4):
            t.dp.router.observe("m", "", "OK", 0.001, None, raw, b"answer", None)
        await _until(lambda: shadow.stats.errors == 2)
        status = t.c.get_policy("m")
        assert (status["shadow_version"], status["shadow_percent"]) == ("2", 50.0)
        await t.c.stop_shadow("m", actor="hal")
        return t, shadow, policy

    t, shadow, policy = asyncio.run(run())
    assert t.staged == [("m", 2)] and len(sent) == 2 and shadow.tasks == [] and "m" not in t.dp.router.shadows
    assert policy.status == "ended" and policy.state["report"]["sent"] == 2 and policy.state["report"]["errors"] == 2
    assert _statuses(t.c) == [("shadow", "ended")] and t.c.store.history("m")[0]["state"]["report"]["errors"] == 2
    assert t.reg.audits[0] == ("gus", "shadow.start", "m:2", "ok", "50% of requests copied")
    assert t.reg.audits[-1][:4] == ("hal", "shadow.stop", "m:2", "ok") and "'sent': 2" in t.reg.audits[-1][4]
    report = asyncio.run(t.c.shadow_report("m"))
    assert (report["name"], report["version"], report["percent"], report["sent"], report["errors"]) == ("m", "2", 50.0, 2, 2)
    assert report["last_error"] == "shadow down"
    assert t.dep.expiring == ["m"] and "shadow_version" not in t.c.get_policy("m")


def test_a_live_shadows_report_adds_what_other_workers_reported_for_that_shadow_only(tmp_path):
    """While a shadow runs, its report is this process's counts plus every frontend worker's rows of
    the same shadow key (shadow_reports): never a row of an earlier shadow of the endpoint, nor one
    of another endpoint."""
    from sqlalchemy import insert

    from server.control.rollout.shadow_reports import shadow_reports

    async def run():
        t = _make(tmp_path)
        t.dp.backend_infer = _sender([])
        policy = await t.c.set_shadow("m", 2, 50)
        key = t.dp.router.shadows["m"].key
        assert key == f"shadow:m:{policy.id}"
        row = {"sent": 5, "dropped": 0, "errors": 1, "paused": 0, "compared": 4, "agreed": 3, "abs_diff_count": 0}
        with t.reg.engine.begin() as conn:
            conn.execute(insert(shadow_reports), [
                {"reporter": "front-a", "endpoint": "m", "shadow": key, "stats": row, "at": 1.0},
                {"reporter": "front-b", "endpoint": "m", "shadow": key, "stats": {**row, "sent": 7}, "at": 1.0},
                {"reporter": "front-a", "endpoint": "m", "shadow": "shadow:m:0", "stats": {**row, "sent": 100}, "at": 1.0},
                {"reporter": "front-a", "endpoint": "n", "shadow": key, "stats": {**row, "sent": 1000}, "at": 1.0},
            ])  # fmt: skip
        report = await t.c.shadow_report("m")
        await t.c.stop()
        return report

    report = asyncio.run(run())
    assert (report["name"], report["version"], report["percent"]) == ("m", "2", 50.0)
    assert (report["sent"], report["errors"], report["compared"], report["agreement"]) == (12, 2, 8, 0.75)


def test_a_new_shadow_replaces_the_old_one(tmp_path):
    async def run():
        t = _make(tmp_path)
        t.dp.backend_infer = _sender([])
        t.dp.models["m"].versions = frozenset({"1", "2", "3"})
        first = await t.c.set_shadow("m", 2, 10)
        old = t.dp.router.shadows["m"]
        second = await t.c.set_shadow("m", 3, 20)
        assert old.tasks == [] and t.dp.router.shadows["m"].version == "3"
        await t.c.stop()
        return t, first, second

    t, first, second = asyncio.run(run())
    assert first.status == "replaced" and t.c.policies[("m", "shadow")] is second
    assert _statuses(t.c) == [("shadow", "replaced"), ("shadow", "active")]
    assert t.dp.router.shadows["m"].tasks == []  # stop() stops every shadow


def test_shadow_percent_zero_stops_it_and_other_percents_are_checked(tmp_path):
    async def run():
        t = _make(tmp_path)
        t.dp.backend_infer = _sender([])
        with pytest.raises(Conflict, match="endpoint 'm' has no shadow"):
            await t.c.set_shadow("m", 2, 0)
        for bad in (-5, 100.5):
            with pytest.raises(InvalidRequest, match=f"shadow percent must be in \\(0, 100\\], got {bad}"):
                await t.c.set_shadow("m", 2, bad)
        assert t.staged == []
        await t.c.set_shadow("m", 2, 100)
        assert await t.c.set_shadow("m", 2, 0, actor="ivy") is None
        return t

    t = asyncio.run(run())
    assert "m" not in t.dp.router.shadows and _statuses(t.c) == [("shadow", "ended")]
    assert t.reg.audits[-1][:3] == ("ivy", "shadow.stop", "m:2")
    with pytest.raises(ModelNotFound, match="endpoint 'x' has no shadow"):
        asyncio.run(t.c.shadow_report("x"))


def test_a_running_shadow_keeps_the_extra_versions_loaded_when_a_split_ends(tmp_path):
    async def run():
        t = _make(tmp_path)
        t.dp.backend_infer = _sender([])
        await t.c.set_shadow("m", 2, 10)
        await t.c.set_bluegreen("m", 2)
        expiry = _Expiry()
        t.dep._st("m").expiry = expiry
        await t.c.rollback("m")
        held = expiry.cancelled and t.dep._st("m").expiry is None and t.dep.expiring == []
        await t.c.stop_shadow("m")
        await t.c.stop()
        return t, held

    t, held = asyncio.run(run())
    assert held and t.dep.expiring == ["m"]


def test_an_endpoint_without_a_live_version_schedules_no_expiry(tmp_path):
    async def run():
        t = _make(tmp_path)
        t.dp.backend_infer = _sender([])
        await t.c.set_shadow("m", 2, 10)
        t.dp.routes.pop("m")
        await t.c.stop_shadow("m")
        return t

    assert asyncio.run(run()).dep.expiring == []


# ---- staging through the deployer ------------------------------------------------------------------


def test_staging_loads_both_versions_warms_the_new_one_and_moves_no_traffic(tmp_path):
    async def run():
        t = _make(tmp_path, real_stage=True)
        t.reg.serving = {"max_batch": 8, "instances": 2}  # the endpoint's serving options (its last deploy's)
        expiry = _Expiry()
        t.dep._st("m").expiry = expiry
        await t.c.set_bluegreen("m", 2)
        return t, expiry

    t, expiry = asyncio.run(run())
    assert t.dep.calls == [("choice_for", 2), ("config_for", "m", 1, (1, 2)), ("load", "m", 2, "config", (1, 2)), ("warm", "m", 2)]
    assert (t.dep.serving.max_batch_size, t.dep.serving.instances) == (8, 2)  # both versions' config keeps them
    assert t.reg.verified == [("m", 2)] and expiry.cancelled and t.dep._st("m").expiry is None
    assert t.dp.router.choose("m", None) == ("1", "") and t.c.policies[("m", "split")].spec["blue"] == "1"


def test_staging_a_version_already_loaded_only_warms_it(tmp_path):
    async def run():
        t = _make(tmp_path, real_stage=True)
        t.dep._st("m").loaded = {1, 2}
        await t.c.set_bluegreen("m", 2)
        return t

    assert asyncio.run(run()).dep.calls == [("choice_for", 2), ("warm", "m", 2)]


def test_staging_a_version_loaded_by_the_deployer_but_not_ready_in_triton_loads_it_again(tmp_path):
    async def run():
        t = _make(tmp_path, real_stage=True)
        t.dep._st("m").loaded = {1, 3}
        t.dp.models["m"].versions = frozenset({"1", "2", "3"})
        t.dp.models["m"].versions = frozenset({"1", "2", "3"})
        await t.c.set_bluegreen("m", 2)  # ready in Triton, but not one the deployer loaded
        return t

    t = asyncio.run(run())
    assert t.dep.calls == [("choice_for", 2), ("config_for", "m", 1, (1, 2, 3)), ("load", "m", 2, "config", (1, 2, 3)), ("warm", "m", 2)]


def test_staging_refuses_an_endpoint_that_is_not_live_here_or_a_different_signature(tmp_path):
    async def run():
        t = _make(tmp_path, real_stage=True)
        t.reg.live = 3  # the registry says 3 is live, this frontend routes to 1
        with pytest.raises(Conflict, match="endpoint 'm' has no live version on this frontend; deploy one first"):
            await t.c.set_bluegreen("m", 2)
        t.reg.live = None
        with pytest.raises(Conflict, match="no live version"):
            await t.c.set_bluegreen("m", 2)
        t.reg.live = 1
        t.reg.records[2].signature = {**SIG, "outputs": [{"name": "z", "datatype": "FP32", "dims": [-1]}]}
        with pytest.raises(Conflict, match="m:2 declares different input/output tensors than the live m:1"):
            await t.c.set_bluegreen("m", 2)
        return t

    t = asyncio.run(run())
    assert not [c for c in t.dep.calls if c[0] in ("load", "warm")] and t.c.store.history("m") == []


@pytest.mark.parametrize("finish", ["promote", "switch", "rollback"])
def test_staging_and_a_promote_or_switch_wait_for_what_is_in_progress_on_their_endpoint(tmp_path, finish):
    """A deploy of m holds the deployer's lock of m: a blue-green stage of m waits for it (nothing
    loads meanwhile), and a promote (or switch) of m waits for that stage, then acts on the policy it
    installed."""

    async def run():
        t = _make(tmp_path, real_stage=True)
        deploying = t.dep._lock("m")
        await deploying.acquire()
        change = asyncio.create_task(t.c.set_bluegreen("m", 2))
        await _settle_loop()
        promote = asyncio.create_task(getattr(t.c, finish)("m"))
        # not a timing claim: while the lock is held neither can finish, however long this waits
        done, _ = await asyncio.wait({change, promote}, timeout=0.5)
        assert not done and t.dep.calls == []
        deploying.release()
        policy = await change
        assert await promote is policy
        return t, policy

    t, policy = asyncio.run(run())
    assert t.dep.calls[:4] == [("choice_for", 2), ("config_for", "m", 1, (1, 2)), ("load", "m", 2, "config", (1, 2)), ("warm", "m", 2)]
    assert policy.kind == "bluegreen" and policy.status == ("ended" if finish == "rollback" else "switched")


def test_a_shadow_stop_waits_for_the_shadow_start_in_progress_on_its_endpoint(tmp_path):
    """A shadow start stages its version under the endpoint's lock: a stop arriving meanwhile waits for
    it, then stops the shadow it started (instead of answering that there is none)."""

    async def run():
        t = _make(tmp_path, real_stage=True)
        t.dp.backend_infer = _sender([])
        deploying = t.dep._lock("m")
        await deploying.acquire()
        start = asyncio.create_task(t.c.set_shadow("m", 2, 50))
        await _settle_loop()
        stop = asyncio.create_task(t.c.stop_shadow("m"))
        # not a timing claim: while the lock is held neither can finish, however long this waits
        done, _ = await asyncio.wait({start, stop}, timeout=0.5)
        assert not done
        deploying.release()
        await start
        await stop
        return t

    t = asyncio.run(run())
    assert _statuses(t.c) == [("shadow", "ended")] and "m" not in t.dp.router.shadows


async def _settle_loop():
    for _ in range(20):
        await asyncio.sleep(0)


def test_a_composite_version_stages_as_one_unit(tmp_path):
    async def run():
        t = _make(tmp_path, real_stage=True)
        t.reg.records[2].format = COMPOSITE_FORMAT
        t.dp.models["m"].versions = frozenset({"7", "2"})
        policy = await t.c.set_bluegreen("m", 2)
        return t, policy

    t, policy = asyncio.run(run())
    assert t.dep.calls == [("composite", "m", 2)] and policy.spec["blue"] == "7" and t.reg.verified == []


# ---- restart ----------------------------------------------------------------------------------------


def test_a_restart_installs_what_is_still_loaded_and_ends_the_rest(tmp_path):
    async def first():
        t = _make(tmp_path)
        t.dp.backend_infer = _sender([])
        await t.c.set_experiment("m", [("a", 1, 1), ("b", 2, 3)], key_header="x-user-id", experiment="e")
        await t.c.set_shadow("m", 2, 25)
        await t.c.stop()
        return t.reg

    registry = asyncio.run(first())

    async def second(loaded):
        sent: list = []
        t = _make(tmp_path, registry=registry)
        t.dp.models["m"].versions = frozenset(loaded)
        t.dp.backend_infer = _sender(sent)
        expiry = _Expiry()
        t.dep._st("m").expiry = expiry
        await t.c.start()
        try:
            return t, dict(t.dp.router.splits), dict(t.dp.router.shadows), [len(s.tasks) for s in t.dp.router.shadows.values()], expiry
        finally:
            await t.c.stop()

    t, splits, shadows, tasks, expiry = asyncio.run(second({"1", "2"}))
    assert splits["m"].kind == "ab" and [a.weight for a in splits["m"].arms] == [1.0, 3.0]
    assert (splits["m"].key_header, splits["m"].salt) == ("x-user-id", "e")
    assert shadows["m"].version == "2" and shadows["m"].percent == 25.0 and tasks == [3] and expiry.cancelled
    assert set(t.c.policies) == {("m", "split"), ("m", "shadow")} and t.c._task.cancelled()

    t, splits, shadows, _, _ = asyncio.run(second({"1"}))  # version 2 went away meanwhile
    assert splits == {} and shadows == {} and t.c.policies == {}
    assert _statuses(t.c) == [("ab", "ended"), ("shadow", "ended")]


def test_a_restored_canary_needs_its_stable_version_live(tmp_path):
    async def first():
        t = _make(tmp_path)
        await t.c.set_canary("m", 2, percent=10, thresholds=LIMITS)
        return t.reg

    registry = asyncio.run(first())

    async def second():
        t = _make(tmp_path, registry=registry)
        t.dp.routes["m"] = "2"
        await t.c.start()
        await t.c.stop()
        return t

    t = asyncio.run(second())
    assert t.c.policies == {} and "m" not in t.dp.router.splits and _statuses(t.c) == [("canary", "ended")]


def test_the_analysis_loop_ticks_and_survives_a_failing_tick_which_it_logs(tmp_path, caplog):
    async def run():
        t = _make(tmp_path)
        t.c.tick_s = 0.01
        calls = []

        async def analyze():
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("one bad tick")

        t.c.analyze = analyze
        await t.c.start()
        await _until(lambda: len(calls) >= 3)
        await t.c.stop()
        return calls

    with caplog.at_level("ERROR", logger="server.control.rollout.traffic"):
        assert len(asyncio.run(run())) >= 3
    assert [r.getMessage() for r in caplog.records] == ["traffic analysis failed"]


def test_analysis_skips_an_endpoint_whose_lock_is_held(tmp_path):
    async def run():
        t = _make(tmp_path)
        await t.c.set_canary("m", 2, steps=[10, 50], interval_s=1, thresholds=LIMITS)
        _traffic(t.dp, t.clock, 200)
        t.clock.now += 2
        async with t.c._lock("m"):
            await t.c.analyze()
            held = [a.weight for a in t.dp.router.splits["m"].arms]
        await t.c.analyze()
        return t, held

    t, held = asyncio.run(run())
    assert held == [90.0, 10.0] and [a.weight for a in t.dp.router.splits["m"].arms] == [50.0, 50.0]


# ---- status -----------------------------------------------------------------------------------------


def test_status_of_an_endpoint_without_policy_and_of_a_running_canary(tmp_path):
    async def run():
        t = _make(tmp_path)
        none = t.c.get_policy("m")
        await t.c.set_canary("m", 2, steps=[10, 50], interval_s=30, thresholds=LIMITS, key_header="k")
        _traffic(t.dp, t.clock, 200)
        await t.c.analyze()
        return t, none

    t, none = asyncio.run(run())
    assert none == {"name": "m", "live": "1", "kind": "none", "status": "", "arms": []}
    status = t.c.get_policy("m")
    assert (status["kind"], status["status"], status["step"], status["steps"], status["interval_s"], status["key_header"]) == (
        "canary", "active", 0, [10.0, 50.0], 30.0, "k",
    )  # fmt: skip
    stable, canary = status["arms"]
    assert (stable["name"], stable["version"], stable["weight"], stable["window_requests"]) == ("stable", "1", 90.0, 180)
    assert (canary["name"], canary["version"], canary["window_requests"], canary["window_errors"]) == ("canary", "2", 20, 0)
    assert canary["window_p99_ms"] == pytest.approx(2.0) and "pass" in status["verdict"]
    assert "green" not in status and "shadow_version" not in status
    assert t.c.get_policy("other") == {"name": "other", "live": "", "kind": "none", "status": "", "arms": []}


def test_the_policies_table_replaces_the_active_policy_of_a_slot(tmp_path):
    from server.control.rollout.traffic import TrafficStore

    store = TrafficStore(_Registry(f"sqlite:///{tmp_path}/s.db").engine)
    a = store.insert("m", "split", "canary", {"x": 1}, {"step": 0}, "")
    b = store.insert("m", "shadow", "shadow", {}, {}, "al")
    c = store.insert("m", "split", "ab", {}, {}, "bo")
    store.insert("n", "split", "ab", {}, {}, "cy")
    assert [r["id"] for r in store.active()] == [b, c, c + 1]
    rows = {r["id"]: r for r in store.history("m")}
    assert rows[a]["status"] == "replaced" and rows[a]["actor"] == "unknown" and rows[b]["status"] == "active"
    store.update(b, state={"report": 1})
    assert {r["id"]: r for r in store.history("m")}[b]["status"] == "active"
    store.update(b, status="ended")
    row = {r["id"]: r for r in store.history("m")}[b]
    assert (row["status"], row["state"]) == ("ended", {"report": 1})
    assert [r["id"] for r in store.history("m", limit=2)] == [c, b]


# ---- what the controller logs and records when nobody is watching ------------------------------------


def test_the_controllers_canary_step_is_audited_with_its_new_share_and_verdict(tmp_path):
    async def run():
        t = _make(tmp_path)
        await t.c.set_canary("m", 2, steps=[10, 50], interval_s=1, thresholds=LIMITS)
        _traffic(t.dp, t.clock, 200)
        t.clock.now += 2
        await t.c.analyze()
        return t

    t = asyncio.run(run())
    actor, action, target, outcome, detail = t.reg.audits[-1]
    assert (actor, action, target, outcome) == ("traffic-controller", "canary.step", "m:2", "ok")
    assert detail.startswith("now 50%; pass") and "stable_requests=180" in detail


def test_an_automatic_rollback_is_logged_as_a_warning_and_a_manual_one_is_not(tmp_path, caplog):
    async def run(manual):
        t = _make(tmp_path / ("manual" if manual else "auto"))
        await t.c.set_canary("m", 2, percent=10, interval_s=600, thresholds=LIMITS)
        _traffic(t.dp, t.clock, 200, canary_error=True)
        if manual:
            await t.c.rollback("m", actor="x")
        else:
            await t.c.analyze()
        return t

    (tmp_path / "manual").mkdir()
    (tmp_path / "auto").mkdir()
    with caplog.at_level("WARNING", logger="server.control.rollout.traffic"):
        asyncio.run(run(manual=True))
        assert not [r for r in caplog.records if "automatically" in r.getMessage()]
        t = asyncio.run(run(manual=False))
    messages = [r.getMessage() for r in caplog.records if "automatically" in r.getMessage()]
    assert len(messages) == 1 and messages[0].startswith("canary m:2 rolled back automatically: fail")
    assert t.reg.audits[-1][0] == "traffic-controller"


def test_an_audit_that_cannot_be_written_is_kept_in_the_log(tmp_path, caplog):
    async def run():
        t = _make(tmp_path)

        def audit(*args):
            raise RuntimeError("audit table away")

        t.reg.audit = audit
        await t.c.set_bluegreen("m", 2)
        return t

    with caplog.at_level("WARNING", logger="server.control.rollout.traffic"):
        t = asyncio.run(run())
    assert [r.getMessage() for r in caplog.records] == [
        "audit bluegreen.stage m:2 ok failed: audit table away (blue=1; green loaded and warm, no traffic)"
    ]
    assert t.c.policies[("m", "split")].kind == "bluegreen"  # the change itself stands


def test_a_policy_not_restored_is_logged_with_the_reason_and_the_analysis_task_is_named(tmp_path, caplog):
    async def first():
        t = _make(tmp_path)
        await t.c.set_canary("m", 2, percent=10, thresholds=LIMITS)
        return t.reg

    registry = asyncio.run(first())

    async def second(versions, live):
        t = _make(tmp_path, registry=registry)
        t.dp.models["m"].versions = frozenset(versions)
        t.dp.routes["m"] = live
        await t.c.start()
        name = t.c._task.get_name()
        await t.c.stop()
        return name

    with caplog.at_level("ERROR", logger="server.control.rollout.traffic"):
        assert asyncio.run(second({"1"}, "1")) == "traffic-analysis"
    assert [r.getMessage() for r in caplog.records] == ["traffic policy canary of m not restored: versions ['2'] of 'm' are not loaded"]
    caplog.clear()
    registry = asyncio.run(first())
    with caplog.at_level("ERROR", logger="server.control.rollout.traffic"):
        asyncio.run(second({"1", "2"}, "2"))
    assert [r.getMessage() for r in caplog.records] == ["traffic policy canary of m not restored: 'm' no longer routes to the canary's stable version 1"]


def test_shadow_records_get_the_disagreements_of_the_shadowed_version(tmp_path):
    calls = []

    def keep(record):
        pass

    class Records:
        def recorder(self, name, version):
            calls.append((name, version))
            return keep

    async def run():
        t = _make(tmp_path)
        t.c.shadow_records = Records()
        t.dp.backend_infer = _sender([])
        await t.c.set_shadow("m", 2, 10)
        shadow = t.dp.router.shadows["m"]
        await t.c.stop()
        return shadow

    assert asyncio.run(run()).record is keep and calls == [("m", "2")]


def test_a_manual_promotion_carries_the_last_verdict_and_its_actor(tmp_path):
    t = _after_a_passing_tick(tmp_path, lambda c: c.promote("m", actor="zoe"))
    actor, action, target, outcome, detail = t.reg.audits[-1]
    assert (actor, action, target, outcome) == ("zoe", "canary.promote", "m:2", "ok") and detail.startswith("pass")
    assert t.dep.calls == [("deploy", "m:2", "zoe")]


def test_unnamed_actors_are_recorded_as_unknown_and_the_controller(tmp_path):
    async def run():
        t = _make(tmp_path)
        t.dp.backend_infer = _sender([])
        await t.c.set_bluegreen("m", 2)
        await t.c.rollback("m")
        await t.c.set_experiment("m", [("a", 1, 1), ("b", 2, 1)])
        await t.c.rollback("m")
        await t.c.set_shadow("m", 2, 10)
        await t.c.stop_shadow("m")
        await t.c.set_bluegreen("m", 2)
        await t.c.switch("m")
        return t

    t = asyncio.run(run())
    assert {r["actor"] for r in t.c.store.history("m")} == {"unknown"}
    assert [a[0] for a in t.reg.audits] == ["", "traffic-controller", "", "traffic-controller", "", "", "", "traffic-controller"]


def test_switch_asks_triton_about_the_endpoint_and_survives_a_failing_refresh(tmp_path):
    asked = []

    async def run():
        t = _make(tmp_path)

        async def refresh(name):
            asked.append(name)
            raise BackendUnavailable("triton busy")

        t.dp.refresh = refresh
        await t.c.set_bluegreen("m", 2)
        await t.c.switch("m")
        return t

    assert asyncio.run(run()).dep.deployed == ["m:2"] and asked == ["m"]


def test_first_percent_equal_or_above_the_first_step_is_not_prepended(tmp_path):
    async def run():
        t = _make(tmp_path)
        same = await t.c.set_canary("m", 2, percent=10, steps=[10, 50])
        await t.c.rollback("m")
        above = await t.c.set_canary("m", 2, percent=20, steps=[10, 50])
        await t.c.rollback("m")
        small = await t.c.set_canary("m", 2, percent=5, window_s=0.5)
        return same, above, small

    same, above, small = asyncio.run(run())
    assert same.spec["steps"] == [10.0, 50.0] and above.spec["steps"] == [10.0, 50.0]
    assert small.spec["window_s"] == 0.5 and small.spec["interval_s"] == 60.0 and small.spec["key_header"] == ""


def test_a_shadow_of_under_one_percent_is_valid(tmp_path):
    async def run():
        t = _make(tmp_path)
        t.dp.backend_infer = _sender([])
        policy = await t.c.set_shadow("m", 2, 0.5)
        await t.c.stop()
        return policy

    assert asyncio.run(run()).spec["percent"] == 0.5


def test_an_ab_report_compares_only_what_both_arms_have(tmp_path):
    async def run():
        t = _make(tmp_path)
        await t.c.set_experiment("m", [("control", 1, 1), ("treatment", 2, 1)])
        router = t.dp.router
        for i, ms in enumerate((1, 2, 3, 4, 100)):
            router.observe("m", "control", "OK", ms / 1000.0, SimpleNamespace(id=f"c{i}"), None, None, None)
        for i in range(5):
            await t.c.feedback("m", f"c{i}", 1.0)
        return t

    t = asyncio.run(run())
    report = t.c.ab_report("m")
    assert report["comparisons"] == []  # the treatment has neither requests nor outcomes
    control = report["arms"][0]
    assert control["latency_p50_ms"] == pytest.approx(3.0) and control["latency_p99_ms"] == pytest.approx(96.16)


def test_outcome_comparisons_use_the_reports_alpha(tmp_path):
    async def run():
        t = _make(tmp_path)
        await t.c.set_experiment("m", [("control", 1, 1), ("treatment", 2, 1)])
        router = t.dp.router
        for i in range(60):
            arm = "control" if i % 2 else "treatment"
            router.observe("m", arm, "OK", 0.001, SimpleNamespace(id=f"r{i}"), None, None, None)
            await t.c.feedback("m", f"r{i}", (0.2 if arm == "treatment" else 0.0) + (i % 7) * 0.1)
        return t

    t = asyncio.run(run())
    strict = [c["significant"] for c in t.c.ab_report("m", alpha=1e-9)["comparisons"] if c["metric"] == "outcome"]
    usual = [c["significant"] for c in t.c.ab_report("m")["comparisons"] if c["metric"] == "outcome"]
    assert strict and not any(strict) and any(usual)


def test_a_new_policy_replaces_only_the_active_one_and_stamps_it(tmp_path):
    from server.control.rollout.traffic import TrafficStore

    store = TrafficStore(_Registry(f"sqlite:///{tmp_path}/s.db").engine)
    old = store.insert("m", "split", "canary", {}, {}, "a")
    store.update(old, status="promoted")
    before = store.history("m")[0]["updated_at"]
    store.insert("m", "split", "ab", {}, {}, "b")
    rows = {r["id"]: r for r in store.history("m")}
    assert rows[old]["status"] == "promoted" and rows[old]["updated_at"] == before
    replaced = store.insert("m", "split", "ab", {}, {}, "c")
    rows = {r["id"]: r for r in store.history("m")}
    assert rows[replaced - 1]["status"] == "replaced" and rows[replaced - 1]["updated_at"] >= rows[replaced - 1]["created_at"]
    for i in range(25):
        store.insert("n", "shadow", "shadow", {}, {}, "d")
    assert len(store.history("n")) == 20


# ---- what the mutation pass found unpinned (issue 34) -------------------------------------------------


def test_each_policy_is_stored_with_the_actor_who_set_it(tmp_path):
    async def run():
        t = _make(tmp_path)
        t.dp.backend_infer = _sender([])
        await t.c.set_bluegreen("m", 2, actor="bo")
        await t.c.rollback("m")
        await t.c.set_experiment("m", [("a", 1, 1), ("b", 2, 1)], actor="cy")
        await t.c.set_shadow("m", 2, 10, actor="di")
        await t.c.stop()
        return t

    t = asyncio.run(run())
    assert [(r["kind"], r["actor"]) for r in reversed(t.c.store.history("m"))] == [("bluegreen", "bo"), ("ab", "cy"), ("shadow", "di")]


def test_a_canary_set_without_an_actor_or_window_is_stored_as_unknown_with_a_sixty_second_window(tmp_path):
    async def run():
        t = _make(tmp_path)
        return t, await t.c.set_canary("m", 2, percent=10)

    t, policy = asyncio.run(run())
    assert t.staged == [("m", 2)] and policy.spec["window_s"] == 60.0 and t.dp.router.splits["m"].window_s == 60.0
    assert t.c.store.history("m")[0]["actor"] == "unknown" and t.reg.audits[-1][:2] == ("", "canary.start")


def test_set_canary_names_what_it_refuses(tmp_path):
    async def run():
        t = _make(tmp_path)
        with pytest.raises(InvalidRequest) as bad_window:
            await t.c.set_canary("m", 2, percent=5, window_s=-1)
        with pytest.raises(Conflict) as live:
            await t.c.set_canary("m", 1, percent=5)
        await t.c.set_bluegreen("m", 2)
        with pytest.raises(Conflict) as second:
            await t.c.set_canary("m", 2, percent=5)
        return bad_window.value, live.value, second.value

    bad_window, live, second = asyncio.run(run())
    assert bad_window.message == "window_s must be > 0"
    assert live.message == "m:1 is already live"
    assert second.message == "endpoint 'm' already has a bluegreen running; promote or roll it back first"


def test_an_automatic_promotion_that_fails_is_rolled_back_by_the_controller_with_its_verdict(tmp_path, caplog):
    async def run():
        t = _make(tmp_path)
        await t.c.set_canary("m", 2, steps=[10], interval_s=1, thresholds=LIMITS)
        _traffic(t.dp, t.clock, 200)
        t.clock.now += 2
        t.dep.fail_deploy = BackendUnavailable("warm-up rows failed")
        with pytest.raises(BackendUnavailable):
            await t.c.analyze()
        return t

    with caplog.at_level("WARNING", logger="server.control.rollout.traffic"):
        t = asyncio.run(run())
    actor, action, target, outcome, detail = t.reg.audits[-1]
    assert (actor, action, target, outcome) == ("traffic-controller", "canary.rollback", "m:2", "rolled_back")
    assert detail.startswith(f"promotion failed: {BackendUnavailable('x').reason}: warm-up rows failed; pass")
    assert [r.getMessage() for r in caplog.records] == [f"canary m:2 rolled back automatically: {detail}"]
    assert t.dep.calls == [("deploy", "m:2", "traffic-controller")] and _statuses(t.c) == [("canary", "rolled_back")]


def test_a_canary_whose_split_disappeared_can_still_be_promoted(tmp_path):
    async def run():
        t = _make(tmp_path)
        await t.c.set_canary("m", 2, percent=10, thresholds=LIMITS)
        t.dp.router.splits.pop("m")  # the state watch dropped it meanwhile
        await t.c.promote("m", actor="al")
        return t

    t = asyncio.run(run())
    assert t.dp.routes["m"] == "2" and _statuses(t.c) == [("canary", "promoted")]


def test_a_running_bluegreen_is_left_alone_by_the_canary_analysis(tmp_path):
    async def run():
        t = _make(tmp_path)
        await t.c.set_bluegreen("m", 2)
        await t.c.analyze()
        assert _statuses(t.c) == [("bluegreen", "active")]
        await t.c.switch("m")
        return t

    t = asyncio.run(run())
    assert _statuses(t.c) == [("bluegreen", "switched")] and t.dp.routes["m"] == "2"


def test_the_analysis_reaches_a_canary_after_a_shadow_of_the_same_endpoint(tmp_path):
    async def run():
        t = _make(tmp_path)
        t.dp.backend_infer = _sender([])
        await t.c.set_shadow("m", 2, 10)  # first in the controller's policies
        await t.c.set_canary("m", 2, steps=[10, 50], interval_s=1, thresholds=LIMITS)
        _traffic(t.dp, t.clock, 200)
        t.clock.now += 2
        await t.c.analyze()
        await t.c.stop()
        return t

    t = asyncio.run(run())
    assert [a.weight for a in t.dp.router.splits["m"].arms] == [50.0, 50.0]


def test_a_held_lock_of_another_endpoint_does_not_stop_the_analysis_of_this_one(tmp_path):
    async def run():
        t = _make(tmp_path)
        await t.c.set_canary("m", 2, steps=[10, 50], interval_s=1, thresholds=LIMITS)
        _traffic(t.dp, t.clock, 200)
        t.clock.now += 2
        async with t.c._lock("other"):
            await t.c.analyze()
        return t

    t = asyncio.run(run())
    assert [a.weight for a in t.dp.router.splits["m"].arms] == [50.0, 50.0]


@pytest.mark.parametrize("start", ["canary", "experiment"])
def test_a_split_being_set_holds_its_endpoint_against_a_second_one(tmp_path, start):
    """While a canary (or an experiment) of m is staging, a blue-green of m waits for it, then is
    refused because m has a split: never two splits installed one over the other."""

    async def run():
        t = _make(tmp_path, real_stage=True)
        deploying = t.dep._lock("m")
        await deploying.acquire()
        if start == "canary":
            first = asyncio.create_task(t.c.set_canary("m", 2, percent=10))
        else:
            first = asyncio.create_task(t.c.set_experiment("m", [("a", 1, 1), ("b", 2, 1)]))
        await _settle_loop()
        second = asyncio.create_task(t.c.set_bluegreen("m", 2))
        await _settle_loop()
        deploying.release()
        policy = await first
        with pytest.raises(Conflict, match="already has a"):
            await second
        return t, policy

    t, policy = asyncio.run(run())
    assert t.c.policies[("m", "split")] is policy and _statuses(t.c) == [(policy.kind, "active")]


def test_a_rollback_during_the_automatic_promotion_waits_for_it(tmp_path):
    """The analysis holds the endpoint while it promotes: a rollback arriving meanwhile waits, then
    finds the canary already promoted (nothing left to roll back)."""

    async def run():
        t = _make(tmp_path)
        await t.c.set_canary("m", 2, steps=[10], interval_s=1, thresholds=LIMITS)
        _traffic(t.dp, t.clock, 200)
        t.clock.now += 2
        moving = asyncio.Event()
        entered = asyncio.Event()

        async def deploy(ref, options=None, actor=""):
            entered.set()
            await moving.wait()
            t.dp.routes["m"] = "2"

        t.dep.deploy = deploy
        analysis = asyncio.create_task(t.c.analyze())
        await entered.wait()
        rollback = asyncio.create_task(t.c.rollback("m", actor="eve"))
        await _settle_loop()
        moving.set()
        await analysis
        with pytest.raises(Conflict, match="has no traffic split running"):
            await rollback
        return t

    t = asyncio.run(run())
    assert _statuses(t.c) == [("canary", "promoted")] and t.dp.routes["m"] == "2"


def test_a_shadow_already_gone_from_the_router_still_stops_with_an_empty_report(tmp_path):
    async def run():
        t = _make(tmp_path)
        t.dp.backend_infer = _sender([])
        await t.c.set_shadow("m", 2, 10)
        await t.dp.router.shadows.pop("m").stop()  # the state watch removed it meanwhile
        await t.c.stop_shadow("m", actor="hal")
        return t

    t = asyncio.run(run())
    assert _statuses(t.c) == [("shadow", "ended")] and ("m", "shadow") not in t.c.policies
    assert t.reg.audits[-1] == ("hal", "shadow.stop", "m:2", "ok", "")


def test_a_bluegreen_is_no_experiment_to_report_on_while_running_or_after_its_switch(tmp_path):
    async def run():
        t = _make(tmp_path)
        await t.c.set_bluegreen("m", 2)
        with pytest.raises(ModelNotFound, match="has no experiment to report on"):
            t.c.ab_report("m")
        await t.c.switch("m")
        with pytest.raises(ModelNotFound, match="has no experiment to report on"):
            t.c.ab_report("m")
        return t

    asyncio.run(run())


def test_an_ended_experiments_report_outlives_a_later_bluegreen(tmp_path):
    async def run():
        t = _make(tmp_path)
        await t.c.set_experiment("m", [("a", 1, 1), ("b", 2, 1)], experiment="e")
        await t.c.rollback("m")
        await t.c.set_bluegreen("m", 2)
        await t.c.switch("m")
        return t.c.ab_report("m")

    report = asyncio.run(run())
    assert report["experiment"] == "e" and [a["name"] for a in report["arms"]] == ["a", "b"]


@pytest.mark.parametrize("kind", ["canary", "ab"])
def test_a_restored_split_keeps_its_window_on_the_routers_clock(tmp_path, kind):
    async def first():
        t = _make(tmp_path)
        if kind == "canary":
            await t.c.set_canary("m", 2, percent=10, window_s=30, thresholds=LIMITS)
        else:
            await t.c.set_experiment("m", [("a", 1, 1), ("b", 2, 1)])
        return t.reg

    registry = asyncio.run(first())

    async def second():
        t = _make(tmp_path, registry=registry)
        await t.c.start()
        await t.c.stop()
        return t

    t = asyncio.run(second())
    split = t.dp.router.splits["m"]
    assert split.window_s == (30.0 if kind == "canary" else 60.0)
    _traffic(t.dp, t.clock, 100)
    assert sum(arm["window_requests"] for arm in t.c.get_policy("m")["arms"]) == 100
    t.clock.now += split.window_s + 1  # the router's clock: the window has forgotten them
    assert sum(arm["window_requests"] for arm in t.c.get_policy("m")["arms"]) == 0


def test_the_constructors_settings_are_the_ones_used(tmp_path):
    """tick_s and shadow_records given to the constructor are the ones in use; a shadow gets two
    workers unless told otherwise."""
    from server.control.rollout.traffic import TrafficController

    calls = []

    class Records:
        def recorder(self, name, version):
            calls.append((name, version))
            return print

    async def run():
        clock = Clock()
        dp = _DataPlane(clock)
        dp.backend_infer = _sender([])
        registry = _Versions(f"sqlite:///{tmp_path}/t.db")
        c = TrafficController(dp, registry, _Recorder(dp, registry, tmp_path), tick_s=0.01, clock=clock, shadow_records=Records())

        c.deployer.stage = c.deployer.fake.stage  # loads nothing
        ticks = []

        async def analyze():
            ticks.append(1)

        c.analyze = analyze
        await c.start()
        await c.set_shadow("m", 2, 10)
        shadow = dp.router.shadows["m"]
        workers = len(shadow.tasks)
        await _until(lambda: len(ticks) >= 2)
        await c.stop()
        return shadow, workers

    shadow, workers = asyncio.run(run())
    assert workers == 2 and shadow.record is print and calls == [("m", "2")]


def test_a_replaced_policy_is_stamped_when_it_is_replaced(tmp_path, monkeypatch):
    from server.control.rollout import traffic

    now = [100.0]
    monkeypatch.setattr(traffic.time, "time", lambda: now[0])
    store = traffic.TrafficStore(_Registry(f"sqlite:///{tmp_path}/s.db").engine)
    old = store.insert("m", "split", "canary", {}, {}, "a")
    now[0] = 250.0
    store.insert("m", "split", "ab", {}, {}, "b")
    row = {r["id"]: r for r in store.history("m")}[old]
    assert (row["status"], row["created_at"], row["updated_at"]) == ("replaced", 100.0, 250.0)
