"""The traffic API (``inferplane.v1.Traffic``): a thin adapter over :class:`server.control.rollout.traffic.TrafficController`.

Changing traffic (canary, promote, rollback, blue-green, experiments, shadow) needs an admin key
with ``--auth on`` (``Gatekeeper.require_admin``); reports and Feedback need a key that may use the
model (an ungranted model answers like an unknown one). A process without the control plane
(a worker of ``--workers N``) answers UNIMPLEMENTED. Errors go through the one error table.
"""

from __future__ import annotations

from server.transports.grpc.admin import actor as metadata_actor
from server.errors import ModelNotFound, Unimplemented
from server.protogen.inferplane.v1 import traffic_pb2 as tpb
from server.protogen.inferplane.v1 import traffic_pb2_grpc
from server.transports.grpc.context import call_context

_THRESHOLDS = ("min_samples", "max_error_rate", "max_error_increase", "max_p99_ratio")


def policy_message(p: dict) -> tpb.TrafficPolicyResponse:
    policy = tpb.TrafficPolicy(
        name=p["name"], live=p.get("live", ""), kind=p.get("kind", "none"), status=p.get("status", ""),
        step=p.get("step", 0), steps=p.get("steps", []), interval_s=p.get("interval_s", 0.0), verdict=p.get("verdict", ""),
        green=p.get("green", ""), shadow_version=p.get("shadow_version", ""), shadow_percent=p.get("shadow_percent", 0.0),
        key_header=p.get("key_header", ""), message=p.get("message", ""),
    )  # fmt: skip
    for arm in p.get("arms", []):
        policy.arms.add(**arm)
    return tpb.TrafficPolicyResponse(policy=policy)


class TrafficService(traffic_pb2_grpc.TrafficServicer):
    def __init__(self, dataplane, controller=None):
        self.dp = dataplane
        self.controller = controller  # server.control.rollout.traffic.TrafficController (None: no control plane here)

    # ---- who may call: the one check every RPC makes first ----------------------------------

    def _caller(self, context, model: str, *, admin: str = "") -> str:
        """Who calls (``principal/key`` for an admin change with auth on, else the caller's name or the
        metadata actor); refused unless this process has the control plane, the caller may change traffic
        (``admin``: the RPC's name) and may use ``model``."""
        if self.controller is None:
            raise Unimplemented("traffic management runs in the frontend process that owns the registry and deployer")
        ctx = call_context(context)
        gate = self.dp.gate
        if admin:
            principal = gate.require_admin(ctx, f"Traffic.{admin}")
            who = f"{principal.name}/{principal.key_id}" if gate.enabled else metadata_actor(context)
        else:
            principal = gate.authenticate(ctx)
            who = principal.name
        if model and not principal.tenant.may_use(model):
            raise ModelNotFound(f"unknown model '{model}'")
        return who

    def _policy(self, name: str, message: str = "") -> tpb.TrafficPolicyResponse:
        """The endpoint's policy as it is now (after a change: its message names the new live version)."""
        p = self.controller.get_policy(name)
        if message:
            p["message"] = message
        return policy_message(p)

    def _is_live(self, name: str) -> str:
        return f"{name}:{self.dp.live_version(name) or ''} is live"

    # ---- canary -----------------------------------------------------------------------------

    async def SetCanary(self, request, context):
        who = self._caller(context, request.name, admin="SetCanary")
        t = request.thresholds
        thresholds = {k: getattr(t, k) for k in _THRESHOLDS if t.HasField(k)}
        if t.HasField("max_p99_ms"):
            thresholds["max_p99_s"] = t.max_p99_ms / 1000.0
        await self.controller.set_canary(
            request.name, request.version, request.percent, list(request.steps), request.interval_s or 60.0,
            request.window_s or 60.0, thresholds, request.key_header, who,
        )  # fmt: skip
        return self._policy(request.name, f"{request.name}:{request.version} is the canary")

    async def Promote(self, request, context):
        name = request.name
        who = self._caller(context, name, admin="Promote")
        await self.controller.promote(name, who)
        return self._policy(name, self._is_live(name))

    async def Rollback(self, request, context):
        name = request.name
        who = self._caller(context, name, admin="Rollback")
        await self.controller.rollback(name, who)
        return self._policy(name, f"every request of '{name}' goes to {self.dp.live_version(name) or ''}")

    # ---- blue-green -------------------------------------------------------------------------

    async def SetBlueGreen(self, request, context):
        name, version = request.name, request.version
        who = self._caller(context, name, admin="SetBlueGreen")
        await self.controller.set_bluegreen(name, version, who)
        return self._policy(name, f"green {name}:{version} is loaded and warm; no traffic yet")

    async def Switch(self, request, context):
        name = request.name
        who = self._caller(context, name, admin="Switch")
        await self.controller.switch(name, who)
        return self._policy(name, self._is_live(name))

    # ---- A/B --------------------------------------------------------------------------------

    async def SetExperiment(self, request, context):
        who = self._caller(context, request.name, admin="SetExperiment")
        arms = [(a.name, a.version, a.weight) for a in request.arms]
        await self.controller.set_experiment(request.name, arms, request.key_header, request.experiment, who)
        return self._policy(request.name, f"experiment '{request.experiment or request.name}' is running")

    async def Feedback(self, request, context):
        self._caller(context, request.name)
        return tpb.FeedbackResponse(arm=await self.controller.feedback(request.name, request.request_id, request.value))

    async def AbReport(self, request, context):
        self._caller(context, request.name)
        report = self.controller.ab_report(request.name, request.alpha or 0.05)
        response = tpb.AbReportResponse(name=report["name"], experiment=report["experiment"])
        for arm in report["arms"]:
            response.arms.add(**arm)
        for c in report["comparisons"]:
            response.comparisons.add(
                arm=c["arm"], control=c["control"], metric=c["metric"], test=c["test"], statistic=c["statistic"],
                p_value=c["p_value"], effect=c["effect"], ci_low=c["ci_low"], ci_high=c["ci_high"],
                confidence=c["confidence"], significant=c["significant"],
            )  # fmt: skip
        return response

    # ---- shadow -----------------------------------------------------------------------------

    async def SetShadow(self, request, context):
        name, version, percent = request.name, request.version, request.percent
        who = self._caller(context, name, admin="SetShadow")
        await self.controller.set_shadow(name, version, percent, who)
        return self._policy(name, f"{percent:g}% of requests copied to {name}:{version}" if percent else "shadow stopped")

    async def ShadowReport(self, request, context):
        self._caller(context, request.name)
        r = await self.controller.shadow_report(request.name)
        return tpb.ShadowReportResponse(**{k: v for k, v in r.items() if k in tpb.ShadowReportResponse.DESCRIPTOR.fields_by_name})

    async def GetPolicy(self, request, context):
        self._caller(context, request.name)
        return self._policy(request.name)


def add_to_server(service: TrafficService, server) -> str:
    """Register the service on a ``grpc.aio`` server; returns its full name (for reflection)."""
    traffic_pb2_grpc.add_TrafficServicer_to_server(service, server)
    return tpb.DESCRIPTOR.services_by_name["Traffic"].full_name
