"""Deploy, stage (canary, blue-green), roll back and retire composite versions as one unit.

``Deployer.deploy`` hands a composite version here: its stored spec is compiled against the
members the data plane serves now (each pinned member version must be ready), the operator
models and the ensemble are written into the repository and loaded, the plan is installed in the
data plane (the version is then ready, like a loaded model version) and the endpoint's route
switches in one assignment. A version stays installed for the deployer's grace period after it
stops being live, so a rollback is the same single switch; after it the version's Triton
models are unloaded and removed with its plan. A canary or an A/B split between two composite
versions is the traffic controller's as for any endpoint (``Deployer.stage`` calls
:meth:`CompositeDeployer.stage`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil

import numpy as np

from server.control.composition.composites import spec_of
from server.control.composition.composition import Member, TensorType
from server.control.composition.composition_compiler import Compiled, compile_spec, read_plans, remove_plan, write_compiled
from server.control.registry.registry import VersionRecord
from server.dataplane import codecs
from server.dataplane.composite import ENSEMBLE, Plan
from server.dataplane.generation import is_embedding
from server.dataplane.signature import is_llm, version_key
from server.errors import Conflict, DeployFailed, InferplaneError, ModelNotFound
from server.protogen.inference import grpc_service_pb2 as pb
from server.control.rollout.results import DeployResult

log = logging.getLogger(__name__)


class CompositeDeployer:
    def __init__(self, deployer):
        self.d = deployer  # the Deployer that owns this one (rollout/deployer.py; it imports this module)

    @property
    def dp(self):
        return self.d.dp

    def owns(self, name: str) -> bool:
        return self.dp.composites.serves(name)

    # ---- members as served here -----------------------------------------------------------

    def lookup(self, name: str, version: int | None) -> Member:
        signature = self.dp.signature(name)
        if signature is None:
            raise ModelNotFound(f"member '{name}' is not served here: deploy or load it first")
        if self.dp.composites.serves(name):
            raise Conflict(f"'{name}' is a composite; a node calls a model")
        if version is not None and str(version) not in signature.versions:
            raise ModelNotFound(f"version {version} of member '{name}' is not ready here (ready: {sorted(signature.versions, key=version_key)})")
        pinned = version if version is not None else (int(signature.latest_version) if signature.latest_version.isdigit() else None)
        kind = "llm" if is_llm(signature) else "embedding" if is_embedding(signature) else "model"
        return Member(
            name, pinned, {t.name: TensorType(t.datatype, t.dims) for t in signature.inputs.values()},
            {t.name: TensorType(t.datatype, t.dims) for t in signature.outputs.values()}, signature.max_batch_size,
            optional_inputs=frozenset(n for n, t in signature.inputs.items() if t.optional), decoupled=signature.decoupled, kind=kind,
        )  # fmt: skip

    # ---- install / uninstall one version ----------------------------------------------------

    async def install(self, record: VersionRecord) -> Compiled:
        """Compile, write, load and install ``record``; on any failure nothing of it stays."""
        name = record.name
        spec = await asyncio.to_thread(spec_of, self.d.registry, record)
        compiled = compile_spec(spec, record.version, self.lookup)
        current = self.dp.signature(name) if self.owns(name) else None
        if current is not None and not _same_signature(current, compiled.signature):
            raise Conflict(
                f"{record.ref} derives a different signature than the {name} being served; "
                "one endpoint serves one signature — register the new composition under a new name"
            )
        written = await asyncio.to_thread(write_compiled, compiled, self.d.repository)
        plan = Plan.from_json(compiled.plan)
        try:
            for model in written:
                await asyncio.wait_for(self.dp.load_model(model), timeout=self.d.load_timeout_s)
            if plan.mode == ENSEMBLE:
                await self._warm(plan)
            self.dp.install_composite(plan)
        except (InferplaneError, asyncio.TimeoutError) as err:
            why = f"readiness timeout after {self.d.load_timeout_s:g}s" if isinstance(err, asyncio.TimeoutError) else f"{err.reason}: {err.message}"
            await self._uninstall(name, str(record.version), plan)
            raise DeployFailed(f"installing {record.ref} failed: {why}; {self.d.serving_note(name)}") from None
        return compiled

    async def _warm(self, plan: Plan) -> None:
        """One row of zeros (text: one word) through the ensemble: it loads and answers."""
        request = pb.ModelInferRequest(model_name=plan.triton_model, id="inferplane-warmup")
        for t in plan.inputs:
            shape = [1, *(1 if d == -1 else d for d in t.dims)]
            if t.datatype == "BYTES":
                array = np.full(shape, b"warm-up", dtype=np.object_)
            else:
                array = np.zeros(shape, dtype=codecs.numpy_dtype(t.datatype))
            datatype, shape, data = codecs.from_numpy(array)
            request.inputs.add(name=t.name, datatype=datatype, shape=shape)
            request.raw_input_contents.append(data)
        raw = await self.dp.backend_infer(request.SerializeToString(), timeout=self.d.load_timeout_s)
        response = pb.ModelInferResponse.FromString(raw)
        missing = {o[0] for o in plan.outputs} - {o.name for o in response.outputs}
        if missing:
            raise DeployFailed(f"the warm-up answer of {plan.triton_model} lacks outputs {sorted(missing)}")

    async def _uninstall(self, name: str, version: str, plan: Plan | None = None) -> None:
        if plan is None:
            plans = self.dp.composites.plans.get(name, {})
            plan = plans.get(version)
            if plan is None:
                doc = read_plans(self.d.repository, name).get(version)
                plan = Plan.from_json(doc) if doc else None
        if self.owns(name) and version in self.dp.composites.plans.get(name, {}):
            self.dp.remove_composite(name, version)
        for model in reversed(plan.triton_models if plan is not None else ()):
            with contextlib.suppress(InferplaneError):
                await self.dp.unload_model(model, missing_ok=True)
            await asyncio.to_thread(shutil.rmtree, self.d.repository / model, True)
        await asyncio.to_thread(remove_plan, self.d.repository, name, int(version))

    # ---- what the deployer and the traffic controller call ------------------------------------

    async def deploy(self, record: VersionRecord, options, actor: str, started: float) -> DeployResult:
        name = record.name
        live = self.dp.live_version(name) if self.owns(name) else None
        reloaded = False
        if str(record.version) not in self.dp.ready_versions(name):
            await self.install(record)
            reloaded = True
        ready_at = self.d.clock()
        mode = self.dp.composites.plan(name, str(record.version)).mode
        await asyncio.to_thread(self.d.registry.record_deployment, name, name, record.version, {"composite": mode}, actor)
        self.dp.set_live(name, str(record.version))  # the switch: one assignment on the event loop
        switch_ms = (self.d.clock() - ready_at) * 1000.0
        self.d.schedule_expiry(name)  # the deployer's grace period, expired through expire() below
        previous = int(live) if live and live.isdigit() else None
        return DeployResult(
            endpoint=name, version=record.version, previous=previous, switch_ms=switch_ms,
            total_ms=(self.d.clock() - started) * 1000.0, loaded_versions=self._installed(name), reloaded=reloaded,
            message=f"composite {name}:{record.version} is live ({mode})"
            + (f"; {name}:{previous} stays installed for {self.d.grace_s:g}s" if previous and previous != record.version else ""),
        )  # fmt: skip

    async def rollback(self, name: str, actor: str, started: float) -> DeployResult:
        ep = await asyncio.to_thread(self.d.registry.endpoint, name, 0)
        if ep.previous is None:
            raise Conflict(f"endpoint '{name}' has no previous version to roll back to")
        target = ep.previous
        reloaded = False
        if str(target) not in self.dp.ready_versions(name):  # the grace period is over: install it again
            await self.install(await asyncio.to_thread(self.d.registry.get, name, target))
            reloaded = True
        await asyncio.to_thread(self.d.registry.record_rollback, name)
        self.dp.set_live(name, str(target))
        switch_ms = (self.d.clock() - started) * 1000.0
        self.d.schedule_expiry(name)
        return DeployResult(
            endpoint=name, version=target, previous=ep.live, switch_ms=switch_ms, total_ms=switch_ms,
            loaded_versions=self._installed(name), reloaded=reloaded,
            message=f"composite {name}:{target} is live again" + (" (installed again: the grace period had ended)" if reloaded else ""),
        )  # fmt: skip

    async def stage(self, name: str, record: VersionRecord) -> str:
        """Install ``record`` beside the live version (no traffic moves); returns the live version."""
        live = self.dp.live_version(name)
        if not live or not self.owns(name):
            raise Conflict(f"endpoint '{name}' has no live version on this frontend; deploy one first")
        self.d.hold(name)  # the versions a policy needs stay installed while it runs
        if str(record.version) not in self.dp.ready_versions(name):
            await self.install(record)
        return live

    async def expire(self, name: str) -> None:
        """The grace period ended: every installed version but the live one is uninstalled."""
        live = self.dp.live_version(name)
        if not live:
            return
        for version in [v for v in self._installed_str(name) if v != live]:
            try:
                await self._uninstall(name, version)
            except Exception as err:  # keep the others going; the version stays until the next expiry
                log.error("composite %s: retiring version %s failed: %s", name, version, err)
                continue
            log.info("composite %s: grace period over, version %s retired", name, version)

    def _installed_str(self, name: str) -> list[str]:
        return sorted(self.dp.composites.plans.get(name, {}), key=version_key)

    def _installed(self, name: str) -> list[int]:
        return [int(v) for v in self._installed_str(name) if v.isdigit()]


def _same_signature(current, derived: dict) -> bool:
    def key_current():
        return (
            sorted((t.name, t.datatype, tuple(t.dims)) for t in current.inputs.values()),
            sorted((t.name, t.datatype, tuple(t.dims)) for t in current.outputs.values()),
        )

    def key_derived():
        return (
            sorted((t["name"], t["datatype"], tuple(t["dims"])) for t in derived["inputs"]),
            sorted((t["name"], t["datatype"], tuple(t["dims"])) for t in derived["outputs"]),
        )

    return key_current() == key_derived()
