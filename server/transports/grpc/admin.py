"""The platform's own admin API (``inferplane.v1.Admin``): a thin adapter over the DataPlane.

Authorization (with ``--auth on``): every call needs a valid key. What changes the serving state
(LoadModel, UnloadModel, RegisterModel, Deploy, Rollback) and the audit log need an admin tenant;
the read-only calls show only the models granted to the caller, and an ungranted model answers
exactly like one that does not exist (as on the OIP RepositoryIndex). With auth off every caller
is the open tenant and may do everything (development mode).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path

from server.dataplane.dataplane import DataPlane
from server.errors import InferplaneError, InvalidRequest, ModelNotFound, Unimplemented
from server.protogen.inferplane.v1 import admin_pb2, admin_pb2_grpc
from server.transports.grpc.context import call_context
from server.tenancy.identity import Principal
from server.dataplane.signature import ModelSignature, version_key


def model_status(dp: DataPlane, name: str) -> admin_pb2.ModelStatus:
    signature: ModelSignature | None = dp.signature(name)
    if signature is None:
        return admin_pb2.ModelStatus(name=name, state="UNAVAILABLE", reason="not loaded or failed to load")
    status = admin_pb2.ModelStatus(
        name=name,
        versions=sorted(signature.versions, key=version_key),
        state="READY" if dp.backend_up else "UNAVAILABLE",
        backend=signature.backend,
        max_batch_size=signature.max_batch_size,
    )
    for spec in signature.inputs.values():
        status.inputs.add(name=spec.name, datatype=spec.datatype, dims=spec.dims)
    for spec in signature.outputs.values():
        status.outputs.add(name=spec.name, datatype=spec.datatype, dims=spec.dims)
    return status


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, dataplane: DataPlane, registry=None, deployer=None, schemas=None):
        self.dp = dataplane
        self.registry = registry  # server.control.registry.registry.Registry (None: this process has no control plane)
        self.deployer = deployer  # server.control.rollout.deployer.Deployer
        self.schemas = schemas  # server.transports.typed.admin.SchemaAdmin (None: no typed APIs served)

    # ---- who may call what -----------------------------------------------------------------

    def _admin(self, context, what: str) -> Principal:
        return self.dp.gate.require_admin(call_context(context), what)

    def _caller(self, context) -> Principal:
        return self.dp.gate.authenticate(call_context(context))

    @staticmethod
    def _granted(principal: Principal, name: str, hidden: str) -> None:
        """An ungranted model raises ``hidden``: the answer the registry gives for an unknown one."""
        if not principal.tenant.may_use(name):
            raise ModelNotFound(hidden)

    def _registered(self, context, request) -> tuple[Principal, object]:
        """(caller, registry) for a request naming a registered model (and maybe a version): an
        ungranted one answers like an unregistered one."""
        principal = self._caller(context)
        registry, _ = self._control()
        what = f"version {int(request.version)} of model '{request.name}'" if request.version else f"model '{request.name}'"
        self._granted(principal, request.name, f"{what} is not registered")
        return principal, registry

    def _actor(self, context, principal: Principal) -> str:
        """The audit log's actor: the authenticated tenant and key when auth is on."""
        if self.dp.gate.enabled:
            return f"{principal.name}/{principal.key_id}"
        return actor(context)

    # ---- models Triton serves ---------------------------------------------------------------

    async def ListModels(self, request, context):
        tenant = self._caller(context).tenant
        names = [n for n in self.dp.names() if tenant.may_use(n)]
        return admin_pb2.ListModelsResponse(models=[model_status(self.dp, n) for n in names])

    async def LoadModel(self, request, context):
        self._admin(context, "LoadModel")
        await self.dp.load_model(request.name)
        return admin_pb2.LoadModelResponse(model=model_status(self.dp, request.name))

    async def UnloadModel(self, request, context):
        self._admin(context, "UnloadModel")
        await self.dp.unload_model(request.name)
        return admin_pb2.UnloadModelResponse()

    # ---- registry and deploy (issue 5) ------------------------------------------------------

    def _control(self):
        if self.registry is None or self.deployer is None:
            raise Unimplemented("this frontend process has no registry/deployer (run a single-process frontend)")
        return self.registry, self.deployer

    async def RegisterModel(self, request, context):
        return await self._register(request, request.artifact, context, "RegisterModel")

    async def RegisterModelStream(self, request_iterator, context):
        """Spool the streamed artifact to a temporary file chunk by chunk, then register the file."""
        self._admin(context, "RegisterModel")
        self._control()
        header = None
        with tempfile.TemporaryDirectory(prefix="inferplane-upload-") as folder:
            path = Path(folder) / "artifact"
            with open(path, "wb") as spool:
                async for chunk in request_iterator:
                    if header is None:
                        if not chunk.HasField("header"):
                            raise InvalidRequest("the first RegisterModelChunk must carry the header (the registration)")
                        header = chunk.header
                    elif chunk.HasField("header"):
                        raise InvalidRequest("only the first RegisterModelChunk carries a header")
                    if chunk.data:
                        await asyncio.to_thread(spool.write, chunk.data)
            if header is None:
                raise InvalidRequest("an empty RegisterModelStream: send the header, then the artifact's bytes")
            if header.artifact:
                raise InvalidRequest("RegisterModelStream sends the artifact as data chunks, not in the header")
            return await self._register(header, path, context, "RegisterModel")

    async def _register(self, request, artifact, context, method: str):
        principal = self._admin(context, method)
        registry, _ = self._control()
        try:
            signature = json.loads(request.signature_json or "null")
            hardware = json.loads(request.hardware_json or "{}")
        except ValueError as err:
            raise InvalidRequest(f"signature_json / hardware_json are not JSON: {err}") from None
        record, created = await asyncio.to_thread(
            registry.register,
            request.name,
            artifact,
            signature=signature,
            filename=request.filename,
            format=request.format or None,
            validation=request.validation_npz or None,
            companions=dict(request.companions),
            metrics=dict(request.metrics),
            hardware=hardware,
            tags=dict(request.tags),
            training_run=request.training_run,
            dataset_version=request.dataset_version,
            experiment=request.experiment,
            parent=request.parent or None,
            owner_team=request.owner_team,
            description=request.description,
            artifact_signature=request.artifact_signature or None,
            actor=self._actor(context, principal),
        )
        return admin_pb2.RegisterModelResponse(version=version_info(record), created=created)

    async def ListRegisteredModels(self, request, context):
        tenant = self._caller(context).tenant
        registry, _ = self._control()
        models = [m for m in await asyncio.to_thread(registry.list_models) if tenant.may_use(m.name)]
        return admin_pb2.ListRegisteredModelsResponse(
            models=[
                admin_pb2.RegisteredModel(
                    name=m.name, owner_team=m.owner_team, latest_version=m.latest_version,
                    version_count=m.version_count, description=m.description,
                )
                for m in models
            ]
        )  # fmt: skip

    async def ShowModel(self, request, context):
        _, registry = self._registered(context, request)
        if request.version:
            records = [await asyncio.to_thread(registry.get, request.name, int(request.version))]
        else:
            records = await asyncio.to_thread(registry.list_versions, request.name)
        return admin_pb2.ShowModelResponse(versions=[version_info(r) for r in records])

    async def GetLineage(self, request, context):
        principal, registry = self._registered(context, request)
        chain = await asyncio.to_thread(registry.lineage, request.name, int(request.version) or None)
        chain = [r for r in chain if principal.tenant.may_use(r.name)]  # ancestors under ungranted names stay hidden
        return admin_pb2.GetLineageResponse(chain=[version_info(r) for r in chain])

    async def Deploy(self, request, context):
        principal = self._admin(context, "Deploy")
        _, deployer = self._control()
        o = request.serving
        options = {
            "instances": o.instances or None,
            "max_batch": o.max_batch if o.has_max_batch else None,
            "queue_delay_us": o.queue_delay_us if o.has_queue_delay_us else None,
            "cache": o.cache if o.has_cache else None,
            "threads": o.threads or None,
            "coalesce": o.coalesce if o.HasField("coalesce") else None,
            "coalesce_max_inflight": o.coalesce_max_inflight if o.HasField("coalesce_max_inflight") else None,
            "coalesce_window_us": o.coalesce_window_us if o.HasField("coalesce_window_us") else None,
        }
        result = await deployer.deploy(request.ref, options, actor=self._actor(context, principal))
        return admin_pb2.DeployResponse(result=deploy_result(result))

    async def Rollback(self, request, context):
        principal = self._admin(context, "Rollback")
        _, deployer = self._control()
        result = await deployer.rollback(request.name, actor=self._actor(context, principal))
        return admin_pb2.RollbackResponse(result=deploy_result(result))

    async def ListEndpoints(self, request, context):
        tenant = self._caller(context).tenant
        registry, deployer = self._control()
        names = [ep.name for ep in await asyncio.to_thread(registry.endpoints) if tenant.may_use(ep.name)]
        return admin_pb2.ListEndpointsResponse(
            endpoints=[endpoint_info(await deployer.endpoint_status(n), history=False) for n in names]
        )

    async def GetEndpoint(self, request, context):
        principal = self._caller(context)
        _, deployer = self._control()
        self._granted(principal, request.name, f"endpoint '{request.name}' has never been deployed")
        return admin_pb2.GetEndpointResponse(endpoint=endpoint_info(await deployer.endpoint_status(request.name)))

    async def ListAudit(self, request, context):
        self._admin(context, "ListAudit")
        registry, _ = self._control()
        entries = await asyncio.to_thread(registry.audit_log, request.limit or 50, request.target or None)
        return admin_pb2.ListAuditResponse(
            entries=[
                admin_pb2.AuditEntry(at=_ts(e.at), actor=e.actor, action=e.action, target=e.target, outcome=e.outcome, detail=e.detail)
                for e in entries
            ]
        )

    # ---- typed per-model APIs (issue 21: server.transports.typed) ---------------------------

    async def GetModelProto(self, request, context):
        self._granted(self._caller(context), request.name, f"unknown model '{request.name}'")
        return await self._schemas().get_model_proto(request)

    async def RetireSchema(self, request, context):
        principal = self._admin(context, "RetireSchema")
        return await self._schemas().retire_schema(request, self._actor(context, principal))

    def _schemas(self):
        if self.schemas is None:
            raise Unimplemented("this frontend serves no typed APIs")
        return self.schemas


def actor(context) -> str:
    """Who is calling, for the audit log: ``x-inferplane-actor`` metadata, else the peer address."""
    for key, value in context.invocation_metadata() or ():
        if key == "x-inferplane-actor" and value:
            return str(value)[:200]
    return f"anonymous@{context.peer()}"


def _ts(value) -> str:
    return value.isoformat() if value is not None else ""


def _tensors(decls):
    out = []
    for t in decls:
        d = admin_pb2.TensorDecl(name=t["name"], datatype=t["datatype"], dims=t["dims"])
        if t.get("range") is not None:
            d.has_range, d.range_lo, d.range_hi = True, t["range"][0], t["range"][1]
        out.append(d)
    return out


def version_info(r) -> admin_pb2.ModelVersionInfo:
    return admin_pb2.ModelVersionInfo(
        name=r.name, version=r.version, sha256=r.sha256, format=r.format, framework=r.framework,
        size_bytes=r.size_bytes, inputs=_tensors(r.signature.get("inputs", [])),
        outputs=_tensors(r.signature.get("outputs", [])), training_run=r.training_run,
        dataset_version=r.dataset_version, experiment=r.experiment, parent=r.parent or "",
        owner_team=r.owner_team, metrics=r.metrics, tags=r.tags, hardware_json=json.dumps(r.hardware, sort_keys=True),
        created_at=_ts(r.created_at), created_by=r.created_by, has_validation_set=bool(r.validation_sha256),
        signing_key_id=r.signing_key_id or "",
    )  # fmt: skip


def deploy_result(r) -> admin_pb2.DeployResult:
    return admin_pb2.DeployResult(
        endpoint=r.endpoint, version=r.version, previous=r.previous or 0, switch_ms=r.switch_ms,
        total_ms=r.total_ms, loaded_versions=r.loaded_versions, reloaded=r.reloaded, message=r.message,
    )  # fmt: skip


def endpoint_info(status: dict, history: bool = True) -> admin_pb2.EndpointInfo:
    ep = status["endpoint"]
    info = admin_pb2.EndpointInfo(
        name=ep.name, live=ep.live or 0, previous=ep.previous or 0, routed=status["routed"],
        ready_versions=status["ready_versions"], loaded_versions=status["loaded_versions"],
        serving_json=json.dumps(ep.serving, sort_keys=True),
    )  # fmt: skip
    if history:
        for d in ep.history:
            info.history.add(
                version=d.version, state=d.state, actor=d.actor, created_at=_ts(d.created_at),
                ended_at=_ts(d.ended_at), serving_json=json.dumps(d.serving, sort_keys=True),
            )  # fmt: skip
    return info
