"""The traffic API (``inferplane.v1.Traffic``): a thin adapter over :class:`server.control.rollout.traffic.TrafficController`.

Changing traffic (canary, promote, rollback, blue-green, experiments, shadow) needs an admin key
with ``--auth on`` (``Gatekeeper.require_admin``); reports and Feedback need a key that may use the
model (an ungranted model answers like an unknown one). A process without the control plane
(a worker of ``--workers N``) answers UNIMPLEMENTED. Errors go through the one error table.
"""

from __future__ import annotations

from server.transports.grpc.admin import actor as metadata_actor
from server.errors import InferplaneError, ModelNotFound, Unimplemented
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

    # ---- the one path every RPC takes -------------------------------------------------------

    async def _run(self, context, run, *, admin: str = "", model: str = ""):
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
        return await run(who)

    def _policy(self, name: str, message: str = "") -> tpb.TrafficPolicyResponse:
        p = self.controller.get_policy(name)
        if message:
            p["message"] = message
        return policy_message(p)

    async def _change(self, context, request, admin: str, change, said) -> tpb.TrafficPolicyResponse:
        """An admin change of one endpoint's traffic: ``await change(who)``, then its policy with the
        message ``said()`` (read after the change: the live version it names is the new one)."""

        async def run(who):
            await change(who)
            return self._policy(request.name, said())

        return await self._run(context, run, admin=admin, model=request.name)

    def _is_live(self, name: str) -> str:
        return f"{name}:{self.dp.live_version(name) or ''} is live"

    # ---- canary -----------------------------------------------------------------------------

    async def SetCanary(self, request, context):
        async def run(who):
            t = request.thresholds
            thresholds = {k: getattr(t, k) for k in _THRESHOLDS if t.HasField(k)}
            if t.HasField("max_p99_ms"):
                thresholds["max_p99_s"] = t.max_p99_ms / 1000.0
            await self.controller.set_canary(
                request.name, request.version, request.percent, list(request.steps), request.interval_s or 60.0,
                request.window_s or 60.0, thresholds, request.key_header, who,
            )  # fmt: skip
            return self._policy(request.name, f"{request.name}:{request.version} is the canary")

        return await self._run(context, run, admin="SetCanary", model=request.name)

    async def Promote(self, request, context):
        name = request.name
        return await self._change(context, request, "Promote", lambda who: self.controller.promote(name, who), lambda: self._is_live(name))

    async def Rollback(self, request, context):
        name = request.name
        return await self._change(
            context, request, "Rollback", lambda who: self.controller.rollback(name, who),
            lambda: f"every request of '{name}' goes to {self.dp.live_version(name) or ''}",
        )  # fmt: skip

    # ---- blue-green -------------------------------------------------------------------------

    async def SetBlueGreen(self, request, context):
        name, version = request.name, request.version
        return await self._change(
            context, request, "SetBlueGreen", lambda who: self.controller.set_bluegreen(name, version, who),
            lambda: f"green {name}:{version} is loaded and warm; no traffic yet",
        )  # fmt: skip

    async def Switch(self, request, context):
        name = request.name
        return await self._change(context, request, "Switch", lambda who: self.controller.switch(name, who), lambda: self._is_live(name))

    # ---- A/B --------------------------------------------------------------------------------

    async def SetExperiment(self, request, context):
        arms = [(a.name, a.version, a.weight) for a in request.arms]
        return await self._change(
            context, request, "SetExperiment",
            lambda who: self.controller.set_experiment(request.name, arms, request.key_header, request.experiment, who),
            lambda: f"experiment '{request.experiment or request.name}' is running",
        )  # fmt: skip

    async def Feedback(self, request, context):
        async def run(_who):
            return tpb.FeedbackResponse(arm=self.controller.feedback(request.name, request.request_id, request.value))

        return await self._run(context, run, model=request.name)

    async def AbReport(self, request, context):
        async def run(_who):
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

        return await self._run(context, run, model=request.name)

    # ---- shadow -----------------------------------------------------------------------------

    async def SetShadow(self, request, context):
        name, version, percent = request.name, request.version, request.percent
        return await self._change(
            context, request, "SetShadow", lambda who: self.controller.set_shadow(name, version, percent, who),
            lambda: f"{percent:g}% of requests copied to {name}:{version}" if percent else "shadow stopped",
        )  # fmt: skip

    async def ShadowReport(self, request, context):
        async def run(_who):
            r = await self.controller.shadow_report(request.name)
            return tpb.ShadowReportResponse(**{k: v for k, v in r.items() if k in tpb.ShadowReportResponse.DESCRIPTOR.fields_by_name})

        return await self._run(context, run, model=request.name)

    async def GetPolicy(self, request, context):
        async def run(_who):
            return self._policy(request.name)

        return await self._run(context, run, model=request.name)


def add_to_server(service: TrafficService, server) -> str:
    """Register the service on a ``grpc.aio`` server; returns its full name (for reflection)."""
    traffic_pb2_grpc.add_TrafficServicer_to_server(service, server)
    return tpb.DESCRIPTOR.services_by_name["Traffic"].full_name
