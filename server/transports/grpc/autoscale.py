"""The autoscaling API (``inferplane.v1.Autoscale``): a thin adapter over
:class:`server.control.scaling.autoscaler.Autoscaler`.

``Configure`` needs an admin key with ``--auth on``; ``Status``, ``Explain`` and ``Signals`` any
valid key, and a tenant sees only the endpoints granted to it. A process without the autoscaler (a
worker of ``--workers N``) answers UNIMPLEMENTED for all but ``Signals``, which every serving process
answers from its own samples.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from server.errors import InvalidRequest, ModelNotFound, Unimplemented
from server.protogen.inferplane.v1 import autoscale_pb2 as apb
from server.protogen.inferplane.v1 import autoscale_pb2_grpc
from server.transports.grpc.admin import actor as metadata_actor
from server.transports.grpc.context import call_context

CONFIG_FIELDS = tuple(f.name for f in apb.AutoscaleConfig.DESCRIPTOR.fields)


def config_dict(message: apb.AutoscaleConfig) -> dict:
    """The fields a caller set (proto3 optional; the others keep the endpoint's values);
    ``scale_to_zero_after_s`` 0 means never."""
    out = {name: getattr(message, name) for name in CONFIG_FIELDS if message.HasField(name)}
    if out.get("scale_to_zero_after_s") == 0:
        out["scale_to_zero_after_s"] = None
    return out


class AutoscaleService(autoscale_pb2_grpc.AutoscaleServicer):
    def __init__(self, dataplane, autoscaler: Callable[[], object | None] = lambda: None, sampler=None):
        self.dp = dataplane
        self.autoscaler = autoscaler  # read at each call: a standby's autoscaler exists once it takes the lead
        self.sampler = sampler

    def _need(self):
        autoscaler = self.autoscaler()
        if autoscaler is None:
            raise Unimplemented("autoscaling runs in the frontend process that owns the registry and the replicas")
        return autoscaler

    async def Configure(self, request, context):
        autoscaler = self._need()
        ctx = call_context(context)
        gate = self.dp.gate
        principal = gate.require_admin(ctx, "Autoscale.Configure")
        who = f"{principal.name}/{principal.key_id}" if gate.enabled else metadata_actor(context)
        if not request.endpoint:
            raise InvalidRequest("endpoint is required")
        status = await autoscaler.configure(request.endpoint, config_dict(request.config), who)
        return apb.AutoscaleStatusResponse(endpoints_json=[json.dumps(status, default=str)])

    async def Status(self, request, context):
        autoscaler = self._need()
        tenant = self.dp.gate.authenticate(call_context(context)).tenant
        rows = [s for s in autoscaler.status() if tenant.may_use(s["endpoint"])]
        return apb.AutoscaleStatusResponse(endpoints_json=[json.dumps(s, default=str) for s in rows])

    async def Explain(self, request, context):
        autoscaler = self._need()
        tenant = self.dp.gate.authenticate(call_context(context)).tenant
        if not tenant.may_use(request.endpoint):
            raise ModelNotFound(f"endpoint '{request.endpoint}' has no autoscaling config")
        return apb.ExplainAutoscaleResponse(explain_json=json.dumps(autoscaler.explain(request.endpoint), default=str))

    async def Signals(self, request, context):
        tenant = self.dp.gate.authenticate(call_context(context)).tenant
        if self.sampler is None:
            raise Unimplemented("this frontend samples no load signals")
        out = {}
        for model in self.sampler.models():
            latest = self.sampler.latest(model)
            if latest is not None and tenant.may_use(model):
                out[model] = latest.as_dict()
        return apb.AutoscaleSignalsResponse(signals_json=json.dumps(out))


def add_to_server(service: AutoscaleService, server) -> str:
    """Register the service on a ``grpc.aio`` server; returns its full name (for reflection)."""
    autoscale_pb2_grpc.add_AutoscaleServicer_to_server(service, server)
    return apb.DESCRIPTOR.services_by_name["Autoscale"].full_name
