"""The gRPC traffic service's handlers (``server.transports.grpc.traffic``): who may call is checked
before anything is asked of the controller, a change is made as its caller, and the policy it answers
is read after the change (its message names the version live now).

A recording controller stands in for ``TrafficController`` (pure logic: the real controller has its
own tests, the service on a real port is in tests/integration/test_traffic.py)."""

from __future__ import annotations

import asyncio

import pytest

from server.errors import ModelNotFound, PermissionDenied, Unimplemented
from server.protogen.inferplane.v1 import traffic_pb2 as tpb
from server.tenancy.identity import Gatekeeper, KeyEntry, KeyRing, Tenant, hash_key
from server.transports.grpc.traffic import TrafficService

ADMIN_KEY, USER_KEY = "ipk_00000001_admin", "ipk_00000002_user"
PEPPER = b"pepper"


class Context:
    def __init__(self, key: str | None = None, actor: str = "ops"):
        self._metadata = [("x-inferplane-actor", actor)] + ([("x-api-key", key)] if key else [])

    def invocation_metadata(self):
        return self._metadata

    def time_remaining(self):
        return None

    def peer(self):
        return "ipv4:127.0.0.1:1"

    def auth_context(self):
        return {}


class DataPlane:
    def __init__(self, gate: Gatekeeper):
        self.gate = gate
        self.live = {"fraud": "1"}

    def live_version(self, name: str) -> str:
        return self.live.get(name, "")


class Controller:
    """Records each change; a promotion, rollback or switch moves the live version."""

    def __init__(self, dataplane: DataPlane):
        self.dp = dataplane
        self.calls: list[tuple] = []

    async def promote(self, name, actor=""):
        self.calls.append(("promote", name, actor))
        self.dp.live[name] = "2"

    async def rollback(self, name, actor=""):
        self.calls.append(("rollback", name, actor))
        self.dp.live[name] = "0"

    async def switch(self, name, actor=""):
        self.calls.append(("switch", name, actor))
        self.dp.live[name] = "3"

    async def set_bluegreen(self, name, version, actor=""):
        self.calls.append(("set_bluegreen", name, version, actor))

    async def set_experiment(self, name, arms, key_header="", experiment="", actor=""):
        self.calls.append(("set_experiment", name, arms, key_header, experiment, actor))

    async def set_shadow(self, name, version, percent, actor=""):
        self.calls.append(("set_shadow", name, version, percent, actor))

    async def set_canary(self, name, version, percent, steps, interval_s, window_s, thresholds, key_header, actor):
        self.calls.append(("set_canary", name, version, percent, steps, interval_s, window_s, thresholds, key_header, actor))

    async def feedback(self, name, request_id, value):
        self.calls.append(("feedback", name, request_id, value))
        return "b"

    def get_policy(self, name):
        return {"name": name, "live": self.dp.live.get(name, "")}


def _service(gate: Gatekeeper | None = None, with_controller: bool = True):
    dp = DataPlane(gate or Gatekeeper())
    controller = Controller(dp) if with_controller else None
    return TrafficService(dp, controller), controller


CHANGES = {
    "Promote": tpb.PromoteRequest(name="fraud"),
    "Rollback": tpb.TrafficRollbackRequest(name="fraud"),
    "Switch": tpb.SwitchRequest(name="fraud"),
    "SetBlueGreen": tpb.SetBlueGreenRequest(name="fraud", version=4),
    "SetShadow": tpb.SetShadowRequest(name="fraud", version=4, percent=25.0),
    "SetExperiment": tpb.SetExperimentRequest(name="fraud", experiment="exp", key_header="x-user", arms=[tpb.ExperimentArm(name="a", version=1, weight=1.0)]),
    "SetCanary": tpb.SetCanaryRequest(name="fraud", version=2, percent=10.0),
}


@pytest.mark.parametrize("rpc", [*CHANGES, "Feedback", "AbReport", "ShadowReport", "GetPolicy"])
def test_without_a_control_plane_every_rpc_is_unimplemented(rpc):
    service, _ = _service(with_controller=False)
    request = CHANGES.get(rpc) or getattr(tpb, {"Feedback": "FeedbackRequest", "AbReport": "AbReportRequest"}.get(rpc, "GetPolicyRequest"))(name="fraud")
    with pytest.raises(Unimplemented):
        asyncio.run(getattr(service, rpc)(request, Context()))


@pytest.mark.parametrize(
    ("rpc", "message"),
    [
        ("Promote", "fraud:2 is live"),
        ("Rollback", "every request of 'fraud' goes to 0"),
        ("Switch", "fraud:3 is live"),
        ("SetBlueGreen", "green fraud:4 is loaded and warm; no traffic yet"),
        ("SetShadow", "25% of requests copied to fraud:4"),
        ("SetExperiment", "experiment 'exp' is running"),
        ("SetCanary", "fraud:2 is the canary"),
    ],
)
def test_a_change_is_made_as_its_caller_and_answers_the_policy_after_it(rpc, message):
    service, controller = _service()
    answer = asyncio.run(getattr(service, rpc)(CHANGES[rpc], Context(actor="ops")))
    assert answer.policy.message == message
    assert answer.policy.name == "fraud"
    [call] = controller.calls
    assert call[-1] == "ops"  # auth off: the metadata actor is who changed it
    assert call[1] == "fraud"


def test_the_change_arguments_reach_the_controller():
    service, controller = _service()
    asyncio.run(service.SetExperiment(CHANGES["SetExperiment"], Context()))
    asyncio.run(service.SetShadow(tpb.SetShadowRequest(name="fraud", version=4, percent=0.0), Context()))
    canary = tpb.SetCanaryRequest(name="fraud", version=2, percent=10.0, steps=[10, 50], key_header="x-user")
    canary.thresholds.max_p99_ms = 250.0
    canary.thresholds.min_samples = 7
    answer = asyncio.run(service.SetCanary(canary, Context()))
    assert controller.calls[0] == ("set_experiment", "fraud", [("a", 1, 1.0)], "x-user", "exp", "ops")
    assert controller.calls[1] == ("set_shadow", "fraud", 4, 0.0, "ops")
    assert controller.calls[2] == ("set_canary", "fraud", 2, 10.0, [10.0, 50.0], 60.0, 60.0, {"min_samples": 7, "max_p99_s": 0.25}, "x-user", "ops")
    assert answer.policy.message == "fraud:2 is the canary"


def _gate() -> Gatekeeper:
    ring = KeyRing(PEPPER)
    ring.load(
        [Tenant("ops", admin=True), Tenant("acme", models=frozenset({"churn"}))],
        [KeyEntry("00000001", hash_key(ADMIN_KEY, PEPPER), "ops"), KeyEntry("00000002", hash_key(USER_KEY, PEPPER), "acme")],
    )
    return Gatekeeper(ring)


def test_with_auth_a_change_needs_an_admin_and_is_made_as_its_key():
    service, controller = _service(_gate())
    with pytest.raises(PermissionDenied):
        asyncio.run(service.Promote(CHANGES["Promote"], Context(USER_KEY)))
    assert controller.calls == []  # refused before the controller was asked
    asyncio.run(service.Promote(CHANGES["Promote"], Context(ADMIN_KEY)))
    [(_, _, actor)] = controller.calls
    assert actor.startswith("ops/")


def test_a_report_needs_a_key_that_may_use_the_model():
    service, controller = _service(_gate())
    with pytest.raises(ModelNotFound):
        asyncio.run(service.Feedback(tpb.FeedbackRequest(name="fraud", request_id="r1", value=1.0), Context(USER_KEY)))
    assert controller.calls == []
    answer = asyncio.run(service.Feedback(tpb.FeedbackRequest(name="fraud", request_id="r1", value=1.0), Context(ADMIN_KEY)))
    assert answer.arm == "b"
    assert controller.calls == [("feedback", "fraud", "r1", 1.0)]
