"""The control plane's leader lease as a Kubernetes ``coordination.k8s.io/v1`` Lease (issue 27).

``INFERPLANE_CONTROL_LEASE=kubernetes``: the replicas of ``inferplane control run`` compete for the Lease
``inferplane-control-plane`` in their namespace (Role ``inferplane-leader-lease``: create leases, and
get/update that one). It is the interface of server.control.service.leader's leases (``acquire``,
``renew``, ``release``, ``renew_s``, ``term``), with the rules of client-go's leader election:

* **optimistic concurrency**: every write is a PUT carrying the ``resourceVersion`` last read; the API
  server refuses it (409 Conflict) when another replica wrote in between, so two replicas never both
  take the Lease;
* **no clock is compared across hosts**: a standby does not read the holder's ``renewTime``; it
  remembers when *it* first saw the Lease's current ``resourceVersion`` (``Observation``) and takes the
  Lease only once that version has stood unchanged for ``leaseDurationSeconds`` on its own clock;
* **the leader stops first**: a renewal that fails (the API server away) keeps the leadership only
  until ``renew_deadline_s`` (2/3 of the duration) after the last renewal that succeeded, so the leader
  has stopped its writers before any standby may take over;
* **release** empties ``holderIdentity``: a standby takes it at its next try, not after a duration.

The leader's address for the frontends (``LeaderDirectory``) stays in the database's lease row, written
by the ``AddressRow`` handed in. Never run against a real API server (see server.runtime.kube_api).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from server.runtime.kube_api import Conflict, KubeAPI, KubeError, NotFound

log = logging.getLogger(__name__)

LEASE_NAME = "inferplane-control-plane"


def micro_time(t: float) -> str:
    """A ``MicroTime`` (RFC 3339, microseconds, UTC)."""
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class Observation:
    version: str  # the Lease's resourceVersion ...
    at: float  # ... first seen at this time of this process's clock


def observe(lease: dict, last: Observation | None, now: float) -> Observation:
    version = str(lease.get("metadata", {}).get("resourceVersion", ""))
    return last if last is not None and last.version == version else Observation(version, now)


def may_take(lease: dict, holder: str, seen: Observation, now: float) -> bool:
    """Whether ``holder`` may write itself into ``lease`` now: it is free, already ours, or its version
    has not changed for its duration since this process first saw it."""
    spec = lease.get("spec") or {}
    current = spec.get("holderIdentity") or ""
    if current in ("", holder):
        return True
    return now - seen.at >= float(spec.get("leaseDurationSeconds") or 0)


def taken(lease: dict, holder: str, duration_s: float, now: float) -> dict:
    """``lease`` written for ``holder`` (its metadata kept: the PUT carries its resourceVersion)."""
    spec = dict(lease.get("spec") or {})
    changed = spec.get("holderIdentity") != holder
    if changed:
        spec["acquireTime"] = micro_time(now)
        spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (1 if spec.get("holderIdentity") else 0)
    spec.update(holderIdentity=holder, leaseDurationSeconds=max(1, math.ceil(duration_s)), renewTime=micro_time(now))
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": dict(lease.get("metadata") or {}), "spec": spec}


def fresh(name: str, holder: str, duration_s: float, now: float) -> dict:
    return taken({"metadata": {"name": name}, "spec": {}}, holder, duration_s, now)


def released(lease: dict) -> dict:
    out = taken(lease, "", 1, time.time())
    out["spec"]["holderIdentity"] = ""
    return out


class KubernetesLease:
    def __init__(self, api: KubeAPI, address_row, holder: str, address: str, *, ttl_s: float = 6.0, name: str = LEASE_NAME,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.api = api
        self.row = address_row  # server.control.service.leader.AddressRow: the address frontends read
        self.holder = holder
        self.address = address
        self.ttl_s = ttl_s
        self.renew_s = ttl_s / 4
        self.renew_deadline_s = ttl_s * 2 / 3
        self.name = name
        self.term = 0
        self._clock = clock
        self._seen: Observation | None = None
        self._held: dict | None = None  # the Lease as our last write left it
        self._renewed_at = 0.0

    @property
    def collection(self) -> str:
        return f"/apis/coordination.k8s.io/v1/namespaces/{self.api.namespace}/leases"

    @property
    def path(self) -> str:
        return f"{self.collection}/{self.name}"

    async def acquire(self) -> bool:
        now = self._clock()
        try:
            lease = await self.api.get(self.path)
        except NotFound:
            try:
                written = await self.api.create(self.collection, fresh(self.name, self.holder, self.ttl_s, time.time()))
            except Conflict:  # another replica created it first
                return False
            return await self._lead(written, now)
        self._seen = observe(lease, self._seen, now)
        if not may_take(lease, self.holder, self._seen, now):
            return False
        try:
            written = await self.api.replace(self.path, taken(lease, self.holder, self.ttl_s, time.time()))
        except Conflict:  # another replica wrote first (took or renewed it)
            return False
        return await self._lead(written, now)

    async def _lead(self, written: dict, now: float) -> bool:
        self._held, self._renewed_at = written, now
        self.term = int((written.get("spec") or {}).get("leaseTransitions") or 0) + 1
        await asyncio.to_thread(self.row.take, self.address)
        return True

    async def renew(self) -> bool:
        now = self._clock()
        try:
            try:
                self._held = await self.api.replace(self.path, taken(self._held or {}, self.holder, self.ttl_s, time.time()))
            except Conflict:  # written by someone since our last write: still ours only if it still names us
                lease = await self.api.get(self.path)
                if (lease.get("spec") or {}).get("holderIdentity") != self.holder:
                    log.error("the Kubernetes Lease %s is held by %s now: leadership lost", self.name, (lease.get("spec") or {}).get("holderIdentity"))
                    return False
                self._held = await self.api.replace(self.path, taken(lease, self.holder, self.ttl_s, time.time()))
        except KubeError as err:
            if now - self._renewed_at >= self.renew_deadline_s:
                log.error("renewing the Kubernetes Lease %s failed past its deadline (%s): leadership lost", self.name, err)
                return False
            log.warning("renewing the Kubernetes Lease %s failed (%s): retrying", self.name, err)
            return True
        self._renewed_at = now
        try:
            await asyncio.to_thread(self.row.advertise, self.address)
        except Exception as err:  # the Lease still holds; only the advertisement is late
            log.warning("renewing the leader's address row failed: %s", err)
        return True

    async def release(self) -> None:
        if self._held is None:
            return
        try:
            await self.api.replace(self.path, released(self._held))
        except KubeError as err:  # it lapses after its duration instead
            log.warning("releasing the Kubernetes Lease %s failed: %s", self.name, err)
        self._held = None
