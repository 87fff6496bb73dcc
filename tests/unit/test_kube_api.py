"""The Kubernetes API users (server.runtime.kube_api, server.control.service.kube_lease): the pure logic only.

No Kubernetes API server runs here (none ships in a package this project can install), so these check
the EndpointSlice parsing, the members and zones discovery makes of it, and the Lease's arithmetic —
take, renew, takeover after the duration on the standby's own clock, resourceVersion conflicts,
the renew deadline, release — against ``ApiFake``: an in-memory object store with the API server's
optimistic concurrency (a PUT with a stale resourceVersion is a 409), nothing more. The address row is
a real SQLite database.
"""

from __future__ import annotations

import asyncio
import copy

import pytest

from server import migrations
from server.control.service.kube_lease import KubernetesLease, Observation, may_take, observe, taken
from server.control.service.leader import AddressRow, LeaderDirectory, lease_for
from server.dataplane.replicas import DnsSource, ReplicaSet
from server.db import make_engine
from server.runtime.kube_api import ClusterAccess, Conflict, EndpointSliceSource, KubeError, NotFound, service_of, slice_targets
from tests.backend_fake import FakeBackend

MODEL = "m"


class ApiFake:
    """Objects by path, each with a resourceVersion bumped at every write; ``down``: every call fails."""

    namespace = "serving"

    def __init__(self):
        self.objects: dict[str, dict] = {}
        self.version = 0
        self.down = False
        self.calls: list[tuple[str, str]] = []

    def _check(self, method: str, path: str):
        self.calls.append((method, path))
        if self.down:
            raise KubeError(0, "connection refused")

    def _store(self, path: str, body: dict) -> dict:
        self.version += 1
        body = copy.deepcopy(body)
        body.setdefault("metadata", {})["resourceVersion"] = str(self.version)
        self.objects[path] = body
        return copy.deepcopy(body)

    async def get(self, path: str) -> dict:
        self._check("GET", path)
        if path not in self.objects:
            raise NotFound(404, path)
        return copy.deepcopy(self.objects[path])

    async def create(self, path: str, body: dict) -> dict:
        self._check("POST", path)
        full = f"{path}/{body['metadata']['name']}"
        if full in self.objects:
            raise Conflict(409, "already exists")
        return self._store(full, body)

    async def replace(self, path: str, body: dict) -> dict:
        self._check("PUT", path)
        if path not in self.objects:
            raise NotFound(404, path)
        if body.get("metadata", {}).get("resourceVersion") != self.objects[path]["metadata"]["resourceVersion"]:
            raise Conflict(409, "the object has been modified")
        return self._store(path, body)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def engine(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path}/p.db")
    migrations.upgrade(engine)
    yield engine
    engine.dispose()


def _lease(api, engine, holder: str, clock, ttl_s: float = 6.0) -> KubernetesLease:
    return KubernetesLease(api, AddressRow(engine, holder, ttl_s), holder, f"{holder}:8001", ttl_s=ttl_s, clock=clock)


# ---- EndpointSlices -----------------------------------------------------------------------------------


SLICES = [
    {"endpoints": [
        {"addresses": ["10.0.1.5"], "conditions": {"ready": True}, "zone": "eu-1a"},
        {"addresses": ["10.0.2.7"], "conditions": {"ready": False}, "zone": "eu-1b"},  # not ready: left out
        {"addresses": ["10.0.2.8"], "zone": "eu-1b"},  # no conditions: ready (the API's rule)
    ]},
    {"endpoints": [{"addresses": ["fd00::9"], "conditions": {"ready": True}}]},  # no zone known
    {"endpoints": None},
]  # fmt: skip


def test_endpoint_slices_give_each_ready_pod_its_zone():
    assert slice_targets(SLICES, 8001) == {"10.0.1.5:8001": "eu-1a", "10.0.2.8:8001": "eu-1b", "[fd00::9]:8001": ""}
    assert service_of("triton-general", "serving") == ("triton-general", "serving")
    assert service_of("triton-general.other.svc.cluster.local", "serving") == ("triton-general", "other")


def test_discovery_through_endpoint_slices_gives_members_their_zones_and_an_api_outage_keeps_them():
    api = ApiFake()
    source = EndpointSliceSource("triton-general", 8001, "general", "on_demand", api)
    path = source.path()
    assert path == "/apis/discovery.k8s.io/v1/namespaces/serving/endpointslices?labelSelector=kubernetes.io%2Fservice-name%3Dtriton-general"
    api.objects[path] = {"items": SLICES}

    async def main():
        rs = ReplicaSet(client_factory=lambda target: FakeBackend(target, (MODEL,)))
        rs.add_source(source)
        joined, left = await rs.discover(source)
        assert joined == ["10.0.1.5:8001", "10.0.2.8:8001", "[fd00::9]:8001"] and left == []
        assert {m.target: m.zone for m in rs.members()} == {"10.0.1.5:8001": "eu-1a", "10.0.2.8:8001": "eu-1b", "[fd00::9]:8001": ""}
        api.down = True  # the API server away: the members stay, none is drained
        assert await rs.discover(source) == ([], [])
        api.down = False
        api.objects[path] = {"items": [{"endpoints": [{"addresses": ["10.0.1.5"], "zone": "eu-1c"}]}]}
        assert await rs.discover(source) == ([], ["10.0.2.8:8001", "[fd00::9]:8001"])
        assert [m.zone for m in rs.members()] == ["eu-1c"]  # the address now belongs to a pod in another zone

    asyncio.run(main())


def test_with_a_dns_fallback_an_unreadable_api_still_finds_the_pods_zones_as_last_known():
    api = ApiFake()
    dns = DnsSource("triton-general", 8001, group="general", resolver=lambda name: ["10.0.1.5", "10.0.3.3"])
    source = EndpointSliceSource("triton-general", 8001, "general", "on_demand", api, fallback=dns)
    api.objects[source.path()] = {"items": SLICES[:1]}

    async def main():
        assert await source.targets() == {"10.0.1.5:8001", "10.0.2.8:8001"}
        api.down = True  # forbidden, away: DNS answers, the zones stay where they were known
        assert await source.targets() == {"10.0.1.5:8001", "10.0.3.3:8001"}
        assert source.zones == {"10.0.1.5:8001": "eu-1a", "10.0.3.3:8001": ""}

    asyncio.run(main())


def test_cluster_access_reads_the_service_account_folder(tmp_path):
    (tmp_path / "token").write_text("tok\n")
    (tmp_path / "namespace").write_text("serving\n")
    (tmp_path / "ca.crt").write_text("")
    access = ClusterAccess.from_dir(tmp_path, env={"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"})
    assert (access.api, access.namespace, access.ca_file) == ("https://10.96.0.1:443", "serving", tmp_path / "ca.crt")
    assert ClusterAccess.from_dir(tmp_path, "other", env={"KUBERNETES_SERVICE_HOST": "fd00::1"}).api == "https://[fd00::1]:443"
    with pytest.raises(KubeError, match="not in a Kubernetes pod"):
        ClusterAccess.from_dir(tmp_path, env={})


# ---- the Lease ------------------------------------------------------------------------------------------


def test_a_standby_takes_a_held_lease_only_after_its_version_stood_still_for_the_duration_on_its_own_clock():
    lease = {"metadata": {"resourceVersion": "7"}, "spec": {"holderIdentity": "a", "leaseDurationSeconds": 6, "renewTime": "2001-01-01T00:00:00.000000Z"}}
    seen = observe(lease, None, 100.0)
    assert not may_take(lease, "b", seen, 105.9)  # the renewTime long past means nothing: b's clock decides
    assert may_take(lease, "b", seen, 106.0)
    assert observe(lease, seen, 200.0) is seen
    renewed = {**lease, "metadata": {"resourceVersion": "8"}}
    assert observe(renewed, seen, 200.0) == Observation("8", 200.0)  # a renewal restarts the wait
    assert may_take(lease, "a", seen, 100.0) and may_take({"spec": {"holderIdentity": ""}}, "b", seen, 100.0)
    first = taken({"metadata": {"name": "x"}, "spec": {}}, "a", 6.0, 0.0)["spec"]
    second = taken({"spec": first}, "b", 6.0, 10.0)["spec"]
    assert (first["leaseTransitions"], second["leaseTransitions"], second["holderIdentity"], second["leaseDurationSeconds"]) == (0, 1, "b", 6)
    assert taken({"spec": second}, "b", 6.0, 11.0)["spec"]["acquireTime"] == second["acquireTime"]  # a renewal is not a transition


def test_two_replicas_one_leads_the_other_takes_over_when_renewals_stop_and_the_old_leader_learns_it_lost(engine):
    api, clock = ApiFake(), Clock()
    a, b = _lease(api, engine, "a", clock), _lease(api, engine, "b", clock)

    async def main():
        assert await a.acquire() and a.term == 1
        assert not await b.acquire()
        clock.t += 5
        assert await a.renew()
        clock.t += 5  # 10 s since b first looked, but a renewed 5 s ago: the version b sees is new
        assert not await b.acquire()
        clock.t += 6  # a renews no more (stalled, killed): the version b saw stood still for the duration
        assert await b.acquire() and b.term == 2
        assert not await a.renew()  # its PUT conflicts, the Lease names b: a stops
        assert (await LeaderDirectory(engine).address(fresh=True)) == "b:8001"
        await b.release()
        assert await a.acquire()  # released: taken at once

    asyncio.run(main())


def test_two_standbys_taking_at_once_one_wins_by_resource_version(engine):
    api, clock = ApiFake(), Clock()
    a, b, c = (_lease(api, engine, h, clock) for h in "abc")

    async def main():
        assert await a.acquire()
        for lease in (b, c):
            assert not await lease.acquire()
        clock.t += 7
        original = api.get

        async def both_read_before_either_writes(path):
            return copy.deepcopy(snapshot)

        snapshot = await original(a.path)
        api.get = both_read_before_either_writes
        assert [await b.acquire(), await c.acquire()] == [True, False]  # c's PUT carries the version b replaced
        api.get = original

    asyncio.run(main())


def test_a_failing_api_server_keeps_the_leader_only_until_the_renew_deadline(engine):
    api, clock = ApiFake(), Clock()
    a = _lease(api, engine, "a", clock, ttl_s=6.0)

    async def main():
        assert await a.acquire()
        api.down = True
        clock.t += 3.0
        assert await a.renew()  # a blip: still leading ...
        clock.t += 1.0
        assert not await a.renew()  # ... until 2/3 of the duration after the last renewal: before a standby may take it

    asyncio.run(main())


def test_lease_for_picks_the_kubernetes_lease_only_when_asked(engine):
    assert isinstance(lease_for(engine, "sqlite://", "h", "x:1", kubernetes=ApiFake()), KubernetesLease)
    assert not isinstance(lease_for(engine, "sqlite://", "h", "x:1"), KubernetesLease)
