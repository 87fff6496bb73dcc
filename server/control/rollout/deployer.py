"""Deploy and roll back registered model versions behind a stable endpoint name.

One endpoint is one Triton model ``NAME`` whose version directories are registry versions.
``config.pbtxt`` lists the versions Triton keeps loaded (``version_policy { specific }``): the
live one plus, for ``rollback_grace_s`` after a switch, the one it replaced. Triton reloads a
model in the background when its config changes, so the live version keeps serving while a new
one loads; a failed load leaves the loaded versions as they were.

``deploy``: materialize ``NAME/VERSION`` from the registry (artifact verified against its sha256,
the framework adapter chosen by format), load, wait for readiness, warm up with rows from the
version's validation set (outputs checked against the expected ones), then switch the endpoint's
traffic in one assignment: ``dataplane.routes[NAME] = VERSION``.
``rollback``: the previous version is still loaded during the grace period, so the switch is the
same single assignment (no reload). Each endpoint has its own lock; nothing here touches another
endpoint's model, so deploying one model never disturbs another's traffic.

An LLM (a safetensors version with its config and tokenizer as companions) deploys the same way:
its files are materialized into ``NAME/VERSION/hf/``, the config is its engine's (the engine adapter
``llm_engine.py`` with the version's engine settings from its hardware metadata, the CPU engine or
vLLM from ``.venv-vllm``; or the native ``vllm`` / ``tensorrtllm`` backend where a Triton has it,
``tensor_parallel`` from ``gpus=N``), and the warm-up is a short greedy generation pinned to the new
version (``DataPlane.backend_generate``). Canary, rollback and expiry need nothing more.
``install`` writes a version into the repository before Triton starts (``inferplane demo build``).

Process and network calls go through the DataPlane (``load_model``, ``triton.infer_raw``); the
config/version planning below is pure.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from model_repository.config_writer import CONFIG_FILE, ModelConfig, ServingConfig, read_config, to_text
from model_repository.layout import ADAPTERS_DIR
from model_repository.llm import install_llm_engine
from server.dataplane import codecs
from server.control.planning.budgets import BudgetGuard
from server.control.planning.cost_store import CostStore
from server.control.planning.prices import load_prices
from server.control.registry import backend_configs, safe_formats
from server.control.registry.backend_configs import ADAPTERS, Choice, TritonTarget
from server.errors import Conflict, DeployFailed, InferplaneError, InvalidRequest, ModelNotFound
from server.protogen.inference import grpc_service_pb2 as pb
from server.control.composition.composites import COMPOSITE_FORMAT  # a composite version deploys through CompositeDeployer
from server.control.registry.registry import Registry, VersionRecord, parse_ref
from server.control.rollout.composite_deployer import CompositeDeployer
from server.control.rollout.results import DeployResult
from server.control.registry.artifacts import artifact_store_for

log = logging.getLogger(__name__)

# the Triton a deployer reaches when nobody told it what the replicas have: the CPU wheel's (python only)
EMBEDDED = (TritonTarget("embedded"),)
_CPU_PYTHON = Choice(backend_configs.PYTHON)
VERSION_FILE = "inferplane_version.json"
LLM_DIR = "hf"  # an LLM version's Hugging Face folder (model.safetensors + its companions), as model_repository/llm.py writes it
LLM_WARMUP_PROMPT, LLM_WARMUP_TOKENS = "Hello", 2
WARMUP_ROWS = 8
DEFAULT_PREFERRED = (16, 32, 64)

# model.py of every deployed version: the framework adapter, told this version's artifact and digest.
# Triton's config (and so its parameters) is shared by all versions of a model, but each version
# has its own artifact; the adapter's own check (_common.verify_artifact) still refuses a file
# whose sha256 differs from the registry's.
_VERSION_SHIM = '''"""Written by the inferplane deployer: the framework adapter, pinned to this version's artifact."""

import json
from pathlib import Path

from _adapter import TritonPythonModel as _Adapter


class TritonPythonModel(_Adapter):
    def initialize(self, args):
        pinned = json.loads((Path(args["model_repository"]) / str(args["model_version"]) / "inferplane_version.json").read_text())
        config = json.loads(args["model_config"])
        parameters = config.setdefault("parameters", {})
        parameters["artifact"] = {"string_value": pinned["artifact"]}
        parameters["artifact_sha256"] = {"string_value": pinned["sha256"]}
        super().initialize(dict(args, model_config=json.dumps(config)))
'''


# ---- pure planning ----------------------------------------------------------------------------


def serving_from(options: Mapping[str, Any] | None, base: Mapping[str, Any] | None = None) -> ServingConfig:
    """A ServingConfig from deploy options (instances, max_batch, queue_delay_us, cache, threads,
    coalesce, coalesce_max_inflight, coalesce_window_us) over ``base``."""
    merged = {**(base or {}), **{k: v for k, v in (options or {}).items() if v is not None}}
    max_batch = int(merged.get("max_batch", 64))
    inflight = merged.get("coalesce_max_inflight")
    try:
        return ServingConfig(
            max_batch_size=max_batch,
            preferred_batch_sizes=tuple(b for b in DEFAULT_PREFERRED if b <= max_batch),
            max_queue_delay_us=int(merged.get("queue_delay_us", 200)),
            instances=int(merged.get("instances", 1)),
            response_cache=bool(merged.get("cache", False)),
            threads=int(merged.get("threads", 1)),
            coalesce=bool(merged.get("coalesce", True)),
            coalesce_max_inflight=None if inflight is None else int(inflight),
            coalesce_window_us=int(merged.get("coalesce_window_us", 0)),
        )
    except ValueError as err:
        raise InvalidRequest(str(err)) from None


def serving_dict(serving: ServingConfig) -> dict[str, Any]:
    out = {
        "instances": serving.instances,
        "max_batch": serving.max_batch_size,
        "queue_delay_us": serving.max_queue_delay_us,
        "cache": serving.response_cache,
        "threads": serving.threads,
        "coalesce": serving.coalesce,
        "coalesce_window_us": serving.coalesce_window_us,
    }
    if serving.coalesce_max_inflight is not None:
        out["coalesce_max_inflight"] = serving.coalesce_max_inflight
    return out


def build_config(
    name: str, signature: Mapping[str, Any], serving: ServingConfig, versions: list[int], choice: Choice = _CPU_PYTHON, fmt: str = ""
) -> ModelConfig:
    """The endpoint's Triton config for ``choice`` (default: Python backend on CPU): declared tensors,
    serving fields, pinned versions (server.control.registry.backend_configs)."""
    return backend_configs.tabular_config(name, signature, serving, versions, choice, fmt)


def same_tensors(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Two signatures Triton can serve under one config (names, datatypes, dims)."""

    def key(sig):
        return [[(t["name"], t["datatype"], tuple(t["dims"])) for t in sig[side]] for side in ("inputs", "outputs")]

    return key(a) == key(b)


def warmup_request(name: str, version: int, signature: Mapping[str, Any], arrays: Mapping[str, np.ndarray], max_rows: int):
    """A ModelInferRequest pinned to ``version`` from validation arrays (zeros when there are none)."""
    inputs = signature["inputs"]
    request = pb.ModelInferRequest(model_name=name, model_version=str(version), id="inferplane-warmup")
    for t in inputs:
        array = arrays.get(t["name"])
        if array is None and len(inputs) == 1:
            array = arrays.get("features")
        if array is None:
            shape = [1] + [1 if d == -1 else d for d in t["dims"]]
            array = np.zeros(shape, dtype=codecs.numpy_dtype(t["datatype"]))
        array = np.ascontiguousarray(array[: max(1, max_rows)], dtype=codecs.numpy_dtype(t["datatype"]))
        request.inputs.add(name=t["name"], datatype=t["datatype"], shape=list(array.shape))
        request.raw_input_contents.append(array.tobytes())
    return request


def check_warmup(response: pb.ModelInferResponse, signature: Mapping[str, Any], arrays: Mapping[str, np.ndarray], rows: int) -> str:
    """Compare the warm-up outputs with the validation set's expected ones; '' when they agree."""
    outputs = signature["outputs"]
    for i, out in enumerate(response.outputs):
        spec = next((t for t in outputs if t["name"] == out.name), None)
        expected = arrays.get(out.name)
        if expected is None and len(outputs) == 1:
            expected = arrays.get("expected")
        if spec is None or expected is None or i >= len(response.raw_output_contents):
            continue
        got = codecs.to_numpy(response.raw_output_contents[i], out.datatype, list(out.shape))
        want = np.asarray(expected[:rows], dtype=got.dtype).reshape(got.shape)
        if not np.allclose(got, want, rtol=1e-3, atol=1e-4):
            return f"output '{out.name}' differs from the validation set (max abs diff {float(np.max(np.abs(got - want))):.4g})"
    return ""


# ---- per endpoint -----------------------------------------------------------------------------


@dataclass
class _EndpointState:
    loaded: set[int] = field(default_factory=set)  # versions listed in config.pbtxt
    expiry: asyncio.Task | None = None


class Deployer:
    def __init__(
        self,
        registry: Registry,
        dataplane,
        repository: Path,
        *,
        grace_s: float = 300.0,
        load_timeout_s: float = 120.0,
        clock=time.perf_counter,
    ):
        self.registry = registry
        self.dp = dataplane
        self.repository = Path(repository)
        self.grace_s = grace_s
        self.load_timeout_s = load_timeout_s
        self.clock = clock
        self._locks: dict[str, asyncio.Lock] = {}
        self._state: dict[str, _EndpointState] = {}
        self.schemas = None  # server.control.typed.typed_catalog.SchemaCatalog (typed APIs), set when they are served
        # server.control.scaling.placement_store.PlacementStore: the versions loaded here become every Triton's
        # placements (the reconciler, server.control.service.reconciler, loads them on the other Tritons)
        self.placements = None
        self.budget_guard = None  # server.control.planning.budgets.BudgetGuard: refuses a deploy once a hard budget is spent
        self.targets = lambda: EMBEDDED  # the Tritons' observed backends and GPUs (Fleet.triton_targets)

        self.composites = CompositeDeployer(self)  # composite endpoints deploy as one unit (server.control.rollout.composite_deployer)

    def choice_for(self, record: VersionRecord) -> Choice:
        """The backend that serves ``record`` on the Tritons here; MissingBackend when none has it."""
        return backend_configs.choose(record.format, record.hardware, self.targets(), record.signature)

    def config_for(self, name: str, record: VersionRecord, serving: ServingConfig, versions: list[int], choice: Choice | None = None) -> ModelConfig:
        """The endpoint's config, for the backend ``record`` (the live version) runs on: an LLM's
        engine config (the engine's tensors, decoupled), any other format's batched config."""
        choice = choice or self.choice_for(record)
        if record.format == safe_formats.SAFETENSORS:
            if choice.native:  # the engine's folder and arguments are each version's (model.json, _materialize)
                return backend_configs.llm_engine_config(name, versions, choice, LLM_DIR).config
            return backend_configs.llm_adapter_config(name, versions, choice, record.hardware)
        return build_config(name, record.signature, serving, versions, choice, record.format)

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def _st(self, name: str) -> _EndpointState:
        return self._state.setdefault(name, _EndpointState())

    # ---- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """After the models loaded (or on taking the lead): route each deployed endpoint to its live version again."""
        for ep in await asyncio.to_thread(self.registry.endpoints):
            if ep.live is None:
                continue
            loaded = self._config_versions(ep.name)
            self._st(ep.name).loaded = set(loaded)
            if str(ep.live) not in self.dp.ready_versions(ep.name) and self.dp.is_loaded(ep.name):
                # a standby taking over knows the versions the desired state named: a leader killed after
                # recording a deploy and before publishing it leaves the registry's live version unknown here
                with contextlib.suppress(InferplaneError):
                    await self.dp.refresh(ep.name)
            if str(ep.live) in self.dp.ready_versions(ep.name):
                self.dp.set_live(ep.name, str(ep.live))
                if set(loaded) != {ep.live}:
                    self.schedule_expiry(ep.name)
            else:
                log.error("endpoint %s: live version %s is not loaded", ep.name, ep.live)

    async def stop(self) -> None:
        for st in self._state.values():
            if st.expiry is not None:
                st.expiry.cancel()

    def _config_versions(self, name: str) -> list[int]:
        path = self.repository / name / CONFIG_FILE
        if not path.is_file():
            return []
        return [int(v) for v in read_config(path).version_policy.specific.versions]

    # ---- deploy -------------------------------------------------------------------------

    async def deploy(self, ref: str, options: Mapping[str, Any] | None = None, actor: str = "") -> DeployResult:
        started = self.clock()
        name, version = parse_ref(ref)
        target = f"{name}:{version or 'latest'}"
        try:
            async with self._lock(name):
                if self.budget_guard is not None:
                    await asyncio.to_thread(self.budget_guard.check_deploy, name, actor)
                result = await self._deploy(name, version, options, actor, started)
        except InferplaneError as err:
            await asyncio.to_thread(self.registry.audit, actor, "deploy", target, "failed", f"{err.reason}: {err.message}")
            raise
        await asyncio.to_thread(self.registry.audit, actor, "deploy", f"{name}:{result.version}", "ok", _summary(result))
        return result

    async def _deploy(self, name: str, version: int | None, options, actor: str, started: float) -> DeployResult:
        record = await asyncio.to_thread(self.registry.get, name, version)
        if record.format == COMPOSITE_FORMAT:
            return await self.composites.deploy(record, options, actor, started)
        choice = self.choice_for(record)  # MissingBackend (409) names the format and the backend no Triton has
        await asyncio.to_thread(self.registry.verify_signed, name, record.version)
        try:
            current = await asyncio.to_thread(self.registry.endpoint, name, 0)
        except ModelNotFound:
            current = None
        live = current.live if current else None
        if live is not None and self.dp.live_version(name) != str(live):
            live = None  # recorded but not serving here (e.g. it failed to load at start)
        serving = serving_from(options, current.serving if current else None)
        st = self._st(name)
        if live is not None and live != record.version:
            live_record = await asyncio.to_thread(self.registry.get, name, live)
            if not same_tensors(live_record.signature, record.signature):
                raise Conflict(
                    f"{record.ref} declares different input/output tensors than the live {name}:{live}; "
                    "one endpoint serves one signature — deploy it under a new model name"
                )
            if self.choice_for(live_record).backend != choice.backend:
                raise Conflict(
                    f"{record.ref} runs on Triton's '{choice.backend}' backend, the live {name}:{live} on "
                    f"'{self.choice_for(live_record).backend}'; one endpoint is one Triton model with one backend — "
                    "deploy it under a new model name"
                )
        # every loaded version stays listed: Triton unloads a version dropped from the config even when
        # the load then fails, and the rollback target must survive a failed deploy; expiry trims later
        keep = (st.loaded | {live}) if live is not None else set()
        versions = sorted(keep | {record.version})
        config = self.config_for(name, record, serving, versions, choice)
        on_disk = self.repository / name / CONFIG_FILE
        unchanged = on_disk.is_file() and to_text(read_config(on_disk)) == to_text(self.config_for(name, record, serving, sorted(st.loaded), choice))
        ready = str(record.version) in self.dp.ready_versions(name)
        reloaded = False
        if not (record.version in st.loaded and ready and unchanged):
            await self._load(name, record, config, versions)
            reloaded = True
        await self._warm(name, record)
        ready_at = self.clock()
        await asyncio.to_thread(self.registry.record_deployment, name, name, record.version, serving_dict(serving), actor)
        self.dp.set_live(name, str(record.version))  # the switch: one assignment on the event loop
        switch_ms = (self.clock() - ready_at) * 1000.0
        self.schedule_expiry(name)
        typed = await self._typed_schema(name, record, actor)
        return DeployResult(
            endpoint=name, version=record.version, previous=live, switch_ms=switch_ms,
            total_ms=(self.clock() - started) * 1000.0, loaded_versions=sorted(st.loaded), reloaded=reloaded,
            message=f"{name}:{record.version} is live" + (f" ({name}:{live} stays loaded for {self.grace_s:g}s)" if live and live != record.version else "") + typed,
        )  # fmt: skip

    # ---- staging (the traffic controller's policies) ----------------------------------------

    async def stage(self, name: str, version: int) -> str:
        """Load and warm ``name:version`` beside the live version, under the endpoint's lock (no traffic
        moves), and hold the grace period while a policy needs it; returns the live version."""
        async with self._lock(name):
            record = await asyncio.to_thread(self.registry.get, name, version)
            if record.format == COMPOSITE_FORMAT:  # composite versions stage as one unit
                return await self.composites.stage(name, record)
            self.choice_for(record)  # MissingBackend (409) when no Triton here has the backend it needs
            await asyncio.to_thread(self.registry.verify_signed, name, record.version)
            ep = await asyncio.to_thread(self.registry.endpoint, name, 0)
            live = self.dp.live_version(name)
            if ep.live is None or live != str(ep.live):
                raise Conflict(f"endpoint '{name}' has no live version on this frontend; deploy one first")
            live_record = await asyncio.to_thread(self.registry.get, name, ep.live)
            if not same_tensors(live_record.signature, record.signature):
                raise Conflict(f"{record.ref} declares different input/output tensors than the live {name}:{live}")
            st = self._st(name)
            self.hold(name)
            if not (str(record.version) in self.dp.ready_versions(name) and record.version in st.loaded):
                versions = sorted(st.loaded | {ep.live, record.version})
                config = self.config_for(name, live_record, serving_from(None, ep.serving), versions)
                await self._load(name, record, config, versions)
            await self._warm(name, record)
            return live

    def hold(self, name: str) -> None:
        """Keep every version of ``name`` loaded: the grace period's expiry is cancelled until the next
        :meth:`schedule_expiry` (a policy that needs the extra versions runs)."""
        st = self._st(name)
        if st.expiry is not None:
            st.expiry.cancel()
            st.expiry = None

    def install(self, ref: str, options: Mapping[str, Any] | None = None, actor: str = "") -> VersionRecord:
        """Deploy ``ref`` into the repository while no Triton runs (``inferplane demo build``): the
        version materialized from the store (digest-verified) as ``deploy`` does, the config listing
        it alone, the deployment recorded (once: installing the live version again records nothing);
        the frontend's ``start`` routes the endpoint to it once Triton has loaded it."""
        name, version = parse_ref(ref)
        record = self.registry.get(name, version)
        self.registry.verify_signed(name, record.version)
        serving = serving_from(options)
        choice = self.choice_for(record)
        config = self.config_for(name, record, serving, [record.version], choice)
        self._materialize(record, self.repository / name / str(record.version))
        _write_atomic(self.repository / name / CONFIG_FILE, to_text(config).encode())
        try:
            live = self.registry.endpoint(name, 0).live
        except ModelNotFound:
            live = None
        if live != record.version:
            self.registry.record_deployment(name, name, record.version, serving_dict(serving), actor)
        self.registry.audit(actor, "deploy", record.ref, "ok", "installed into the repository before Triton starts")
        return record

    async def _typed_schema(self, name: str, record: VersionRecord, actor: str) -> str:
        """The typed API's schema after the switch: checked against the live one (a breaking change
        bumps its major); never fails the deploy, which is done."""
        if self.schemas is None:
            return ""
        try:
            note = await self.schemas.deployed(name, record, actor)
        except Exception as err:  # the version serves; only its typed schema is not updated
            log.exception("endpoint %s: updating the typed API schema failed", name)
            return f"; typed API not updated: {err}"
        return f"; {note}" if note else ""

    async def _load(self, name: str, record: VersionRecord, config: ModelConfig, versions: list[int]) -> None:
        """Materialize the version, write the config and load; on any failure put everything back."""
        st = self._st(name)
        model_dir = self.repository / name
        config_path = model_dir / CONFIG_FILE
        old_config = config_path.read_bytes() if config_path.is_file() else None
        version_dir = model_dir / str(record.version)
        fresh_dir = not version_dir.exists() or record.version not in st.loaded
        if fresh_dir:
            try:
                await asyncio.to_thread(self._materialize, record, version_dir)
            except BaseException:
                if old_config is None:  # leave no config-less model directory in the repository
                    await asyncio.to_thread(shutil.rmtree, model_dir, True)
                raise
        _write_atomic(config_path, to_text(config).encode())
        await self._place(name, versions)  # the desired state first: the other Tritons load it meanwhile
        try:
            await asyncio.wait_for(self.dp.load_model(name), timeout=self.load_timeout_s)
        except (InferplaneError, asyncio.TimeoutError) as err:
            why = f"readiness timeout after {self.load_timeout_s:g}s" if isinstance(err, asyncio.TimeoutError) else err.message
            await self._restore(name, old_config, version_dir if fresh_dir else None, timed_out=isinstance(err, asyncio.TimeoutError))
            await self._resync(name)
            await self._place(name)
            raise DeployFailed(f"loading {record.ref} failed: {why}; {self.serving_note(name)}") from None
        if str(record.version) not in self.dp.ready_versions(name):
            await self._restore(name, old_config, version_dir if fresh_dir else None, timed_out=False)
            await self._resync(name)
            await self._place(name)
            raise DeployFailed(f"{record.ref} loaded but is not ready; {self.serving_note(name)}")
        st.loaded = set(versions)

    async def _place(self, name: str, versions=None) -> None:
        """Publish ``versions`` (default: those loaded here) as the placements of ``name`` (on the Tritons the
        autoscaler placed it on, else on every Triton), before this process acts on its own Triton, so no
        reconciler round sees the two disagree."""
        if self.placements is not None:
            await asyncio.to_thread(self.placements.place_versions, name, self._st(name).loaded if versions is None else versions)

    async def _resync(self, name: str) -> None:
        """After a failed load: read which versions Triton still has ready (what a rollback may use)."""
        st = self._st(name)
        if not self.dp.is_loaded(name):
            st.loaded = set()
            return
        with contextlib.suppress(InferplaneError):
            await self.dp.refresh(name)
        ready = self.dp.ready_versions(name)
        st.loaded = {v for v in st.loaded if str(v) in ready}

    def serving_note(self, name: str) -> str:
        live = self.dp.live_version(name)
        return f"{name}:{live} keeps serving" if live else f"nothing was serving '{name}' before"

    async def _restore(self, name: str, old_config: bytes | None, new_dir: Path | None, timed_out: bool) -> None:
        model_dir = self.repository / name
        if old_config is None:
            # the model never served: drop its directory so a restart does not try to load it
            await asyncio.to_thread(shutil.rmtree, model_dir, True)
            await self.dp.unload_model(name, missing_ok=True)
            return
        _write_atomic(model_dir / CONFIG_FILE, old_config)
        if new_dir is not None:
            await asyncio.to_thread(shutil.rmtree, new_dir, True)
        if timed_out:
            # supersede the load still running in Triton with the restored config
            with contextlib.suppress(InferplaneError, asyncio.TimeoutError):
                await asyncio.wait_for(self.dp.load_model(name), timeout=self.load_timeout_s)

    def _materialize(self, record: VersionRecord, version_dir: Path) -> None:
        """Write ``NAME/VERSION`` from the store (digest-verified) into a staging dir, then move it in:
        the artifact and its companions; for the Python backend the adapter and its pinning shim."""
        choice = self.choice_for(record)
        staging = version_dir.parent / f".staging-{record.version}-{uuid.uuid4().hex[:8]}"
        staging.mkdir(parents=True)
        llm = record.format == safe_formats.SAFETENSORS
        files = staging / LLM_DIR if llm else staging  # an LLM's weights, config and tokenizer: one Hugging Face folder
        try:
            files.mkdir(exist_ok=True)
            self.registry.store.copy_to(record.sha256, files / record.artifact_name)
            for cname, cdigest in record.companions.items():
                self.registry.store.copy_to(cdigest, files / cname)
            if llm and choice.native:
                generated = backend_configs.llm_engine_config(record.name, [record.version], choice, str(version_dir / LLM_DIR))
                for fname, text in generated.files.items():
                    (staging / fname).write_text(text, encoding="utf-8")
            elif llm:
                install_llm_engine(staging, "_adapter.py")
                (staging / "model.py").write_text(_VERSION_SHIM, encoding="utf-8")
            elif not choice.native:
                shutil.copyfile(ADAPTERS_DIR / (choice.adapter or ADAPTERS[record.format]), staging / "_adapter.py")
                for helper in ("_common.py", *choice.helpers):
                    shutil.copyfile(ADAPTERS_DIR / helper, staging / helper)
                (staging / "model.py").write_text(_VERSION_SHIM, encoding="utf-8")
            artifact = LLM_DIR if llm else record.artifact_name  # the engine adapter is given its folder
            pinned = {"name": record.name, "version": record.version, "artifact": artifact, "sha256": record.sha256}
            (staging / VERSION_FILE).write_text(json.dumps(pinned, indent=2) + "\n", encoding="utf-8")
            if version_dir.exists():
                trash = version_dir.parent / f".trash-{uuid.uuid4().hex[:8]}"
                version_dir.rename(trash)
                shutil.rmtree(trash, ignore_errors=True)
            staging.rename(version_dir)
        except InferplaneError as err:
            shutil.rmtree(staging, ignore_errors=True)
            raise DeployFailed(f"cannot materialize {record.ref}: {err.message}") from None
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    async def _warm(self, name: str, record: VersionRecord) -> None:
        if record.format == safe_formats.SAFETENSORS:
            return await self._warm_llm(name, record)
        arrays: dict[str, np.ndarray] = {}
        if record.validation_sha256:
            data = await asyncio.to_thread(self.registry.store.get, record.validation_sha256)
            with np.load(io.BytesIO(data), allow_pickle=False) as npz:
                arrays = {k: npz[k] for k in npz.files}
        max_batch = self.dp.signature(name).max_batch_size
        rows = min(WARMUP_ROWS, max_batch) if max_batch > 0 else 1
        request = warmup_request(name, record.version, record.signature, arrays, rows)
        try:
            raw = await self.dp.backend_infer(request.SerializeToString(), timeout=self.load_timeout_s)
        except InferplaneError as err:
            await self._unload_version(name, record.version)
            raise DeployFailed(f"warm-up request to {record.ref} failed: {err.message}; {self.serving_note(name)}") from None
        problem = check_warmup(pb.ModelInferResponse.FromString(raw), record.signature, arrays, int(request.inputs[0].shape[0]))
        if problem:
            await self._unload_version(name, record.version)
            raise DeployFailed(f"warm-up of {record.ref}: {problem}; {self.serving_note(name)}")

    async def _warm_llm(self, name: str, record: VersionRecord) -> None:
        """An LLM's warm-up: a short greedy generation pinned to the new version (its engine answers)."""
        try:
            await self.dp.backend_generate(name, str(record.version), LLM_WARMUP_PROMPT, LLM_WARMUP_TOKENS, timeout=self.load_timeout_s)
        except InferplaneError as err:
            await self._unload_version(name, record.version)
            raise DeployFailed(f"warm-up generation from {record.ref} failed: {err.message}; {self.serving_note(name)}") from None

    async def _unload_version(self, name: str, version: int) -> None:
        """Drop a version that loaded but must not serve (failed warm-up)."""
        st = self._st(name)
        live = self.dp.live_version(name)
        if live is None:
            await self._restore(name, None, None, timed_out=False)
            st.loaded = set()
            return
        keep = sorted(st.loaded - {version})
        record = await asyncio.to_thread(self.registry.get, name, int(live))
        current = await asyncio.to_thread(self.registry.endpoint, name, 0)
        config = self.config_for(name, record, serving_from(None, current.serving), keep)
        _write_atomic(self.repository / name / CONFIG_FILE, to_text(config).encode())
        await self._place(name, keep)
        with contextlib.suppress(InferplaneError, asyncio.TimeoutError):
            await asyncio.wait_for(self.dp.load_model(name), timeout=self.load_timeout_s)
        st.loaded = set(keep)
        await asyncio.to_thread(shutil.rmtree, self.repository / name / str(version), True)

    # ---- rollback -----------------------------------------------------------------------

    async def rollback(self, name: str, actor: str = "") -> DeployResult:
        started = self.clock()
        try:
            async with self._lock(name):
                result = await self._rollback(name, actor, started)
        except InferplaneError as err:
            await asyncio.to_thread(self.registry.audit, actor, "rollback", name, "failed", f"{err.reason}: {err.message}")
            raise
        await asyncio.to_thread(self.registry.audit, actor, "rollback", f"{name}:{result.version}", "ok", _summary(result))
        return result

    async def _rollback(self, name: str, actor: str, started: float) -> DeployResult:
        if self.composites.owns(name):
            return await self.composites.rollback(name, actor, started)
        ep = await asyncio.to_thread(self.registry.endpoint, name, 0)
        if ep.previous is None:
            raise Conflict(f"endpoint '{name}' has no previous version to roll back to")
        target = ep.previous
        st = self._st(name)
        if self.dp.is_loaded(name):
            with contextlib.suppress(InferplaneError):
                await self.dp.refresh(name)  # Triton's word on what is ready, not our memory (~ms)
        ready = str(target) in self.dp.ready_versions(name) and target in st.loaded
        reloaded = False
        if not ready:  # the grace period is over: load it again (not instant)
            record = await asyncio.to_thread(self.registry.get, name, target)
            versions = sorted(st.loaded | {target})
            await self._load(name, record, self.config_for(name, record, serving_from(None, ep.serving), versions), versions)
            await self._warm(name, record)
            reloaded = True
        await asyncio.to_thread(self.registry.record_rollback, name)
        self.dp.set_live(name, str(target))  # the switch
        switch_ms = (self.clock() - started) * 1000.0
        self.schedule_expiry(name)
        return DeployResult(
            endpoint=name, version=target, previous=ep.live, switch_ms=switch_ms, total_ms=switch_ms,
            loaded_versions=sorted(st.loaded), reloaded=reloaded,
            message=f"{name}:{target} is live again" + (" (reloaded: the grace period had ended)" if reloaded else ""),
        )  # fmt: skip

    # ---- grace period -------------------------------------------------------------------

    def schedule_expiry(self, name: str) -> None:
        """Start (again) the grace period after which every version of ``name`` but the live one is unloaded."""
        st = self._st(name)
        if st.expiry is not None:
            st.expiry.cancel()
        st.expiry = asyncio.get_running_loop().create_task(self._expire_later(name))

    async def _expire_later(self, name: str) -> None:
        await asyncio.sleep(self.grace_s)
        async with self._lock(name):
            await self.expire(name)

    async def expire(self, name: str) -> None:
        """Unload every version of the endpoint but the live one (the grace period ended)."""
        if self.composites.owns(name):
            return await self.composites.expire(name)
        st = self._st(name)
        live = self.dp.live_version(name)
        if live is None or st.loaded == {int(live)}:
            return
        try:
            record = await asyncio.to_thread(self.registry.get, name, int(live))
            ep = await asyncio.to_thread(self.registry.endpoint, name, 0)
            config = self.config_for(name, record, serving_from(None, ep.serving), [int(live)])
            _write_atomic(self.repository / name / CONFIG_FILE, to_text(config).encode())
            await self._place(name, {int(live)})
            await asyncio.wait_for(self.dp.load_model(name), timeout=self.load_timeout_s)
        except (InferplaneError, asyncio.TimeoutError) as err:
            log.error("endpoint %s: unloading retired versions failed: %s", name, err)
            return
        retired = sorted(st.loaded - {int(live)})
        st.loaded = {int(live)}
        for version in retired:
            await asyncio.to_thread(shutil.rmtree, self.repository / name / str(version), True)
        log.info("endpoint %s: grace period over, unloaded versions %s", name, retired)

    # ---- status -------------------------------------------------------------------------

    async def endpoint_status(self, name: str) -> dict[str, Any]:
        ep = await asyncio.to_thread(self.registry.endpoint, name, 20)
        signature = self.dp.signature(name)
        return {
            "endpoint": ep,
            "routed": self.dp.live_version(name) or "",
            "ready_versions": sorted(int(v) for v in signature.versions) if signature else [],
            "loaded_versions": sorted(self._st(name).loaded),
        }


def _summary(result: DeployResult) -> str:
    return (
        f"version={result.version} previous={result.previous} switch_ms={result.switch_ms:.2f} "
        f"total_ms={result.total_ms:.0f} reloaded={result.reloaded} loaded={result.loaded_versions}"
    )


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def build_control_plane(settings, dataplane) -> tuple[Registry, Deployer]:
    """The registry (migrated to the newest schema) and the deployer for a running frontend."""
    registry = Registry(settings.database_url, artifact_store_for(settings))
    deployer = Deployer(
        registry,
        dataplane,
        settings.model_repository,
        grace_s=settings.rollback_grace_s,
        load_timeout_s=settings.deploy_timeout_s,
    )
    deployer.budget_guard = BudgetGuard(CostStore(registry), load_prices)
    return registry, deployer
