"""Deploys that answer at once: ``POST /v1/models/deploy`` starts one and returns its id; the deploy
(autoscaling config stored, version loaded on its replicas, warmed, traffic switched) runs in the
background; ``GET /v1/models/deploy/{endpoint_id}`` reports ``provisioning``, ``ready`` or ``failed``.

An operation is checked before it is accepted (the reference parses, the version is registered,
the autoscaling config is valid), so a 202 means the platform is working on something it can do.
Operations are kept in memory (the newest 1000); the endpoint itself, its deployments and its
scaling config are in the registry.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict

from batching.autoscale_policy import ScalingConfig
from server.control.registry.registry import parse_ref
from server.errors import InferplaneError, InvalidRequest, ModelNotFound

log = logging.getLogger(__name__)

PROVISIONING, READY, FAILED = "provisioning", "ready", "failed"
KEEP = 1000


class Provisioner:
    def __init__(self, deployer, registry, autoscaler=None, replicas=None, clock=time.time):
        self.deployer = deployer
        self.registry = registry
        self.autoscaler = autoscaler
        self.replicas = replicas
        self._clock = clock
        self.operations: OrderedDict[str, dict] = OrderedDict()
        self._tasks: set[asyncio.Task] = set()

    async def submit(self, ref: str, serving: dict | None = None, autoscaling: dict | None = None, actor: str = "") -> dict:
        name, version = parse_ref(ref)
        record = await asyncio.to_thread(self.registry.get, name, version)  # NOT_FOUND before any 202
        config = None
        if autoscaling:
            if self.autoscaler is None:
                raise InvalidRequest("autoscaling is not available in this frontend process")
            try:
                config = ScalingConfig.from_dict(dict(autoscaling))
            except (TypeError, ValueError) as err:
                raise InvalidRequest(f"autoscaling: {err}") from None
        endpoint_id = f"{name}-{uuid.uuid4().hex[:12]}"
        estimate = self.autoscaler.estimated_ready_s(name) if self.autoscaler is not None else 5.0
        op = {
            "endpoint_id": endpoint_id, "endpoint": name, "version": record.version, "status": PROVISIONING,
            "estimated_ready_seconds": estimate, "submitted_at": self._clock(), "ready_at": None, "error": None,
            "autoscaling": config.as_dict() if config is not None else (self.autoscaler.config(name).as_dict() if self.autoscaler and self.autoscaler.config(name) else None),
        }  # fmt: skip
        self.operations[endpoint_id] = op
        while len(self.operations) > KEEP:
            self.operations.popitem(last=False)
        task = asyncio.get_running_loop().create_task(self._run(op, f"{name}:{record.version}", serving, config, actor))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return dict(op)

    async def _run(self, op: dict, ref: str, serving: dict | None, config: ScalingConfig | None, actor: str) -> None:
        try:
            if config is not None:
                await self.autoscaler.configure(op["endpoint"], config, actor)
            result = await self.deployer.deploy(ref, serving, actor)
        except InferplaneError as err:
            op.update(status=FAILED, error={"code": err.reason, "message": err.message}, ready_at=self._clock())
        except Exception as err:  # a bug: the operation says so instead of hanging in provisioning
            log.exception("deploy %s failed", ref)
            op.update(status=FAILED, error={"code": "INTERNAL", "message": f"{type(err).__name__}: {err}"}, ready_at=self._clock())
        else:
            op.update(status=READY, ready_at=self._clock(), result=result.as_dict())

    def get(self, endpoint_id: str) -> dict:
        op = self.operations.get(endpoint_id)
        if op is None:
            raise ModelNotFound(f"no deploy operation '{endpoint_id}' (operations are kept by the frontend that accepted them)")
        out = dict(op)
        name = op["endpoint"]
        if self.replicas is not None:
            out["ready_replicas"] = self.replicas.hosting_count(name)
        if self.autoscaler is not None and self.autoscaler.config(name) is not None:
            out["replicas"] = self.autoscaler.endpoints[name].state.replicas
        return out

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
