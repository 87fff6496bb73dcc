"""Writes the replica ledger (``replica_intervals``, server.control.planning.cost_store) from what the fleet runs:
every ``interval_s`` it reads which replica serves which endpoints (the replica set's members that are
up, and the models ready on each) and opens an interval for each new (replica, endpoint) pair and
closes the ones that went away — a controller over desired-vs-recorded, so a restart converges by
itself (an interval a dead frontend left open closes at the next sync: at most one period too long).
The process that owns the control plane runs it; stopping closes the intervals of replicas that
stop with it (the embedded Tritons).

The hardware class and capacity type of the replicas come from the settings (``hardware_class``,
``capacity_type``); each endpoint's memory on a replica (the share key of a shared replica) is its
registry hardware metadata (``server.control.scaling.placement.memory_need``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from server.control.planning.cost_store import CostStore
from server.dataplane.replicas import UP
from server.periodic import Periodic

log = logging.getLogger(__name__)


def ledger_changes(open_pairs: set[tuple[str, str]], observed: Mapping[str, set[str]]) -> tuple[set, set]:
    """(pairs to open, pairs to close) to make the ledger say what ``observed`` (replica -> endpoints) says."""
    now = {(replica, endpoint) for replica, endpoints in observed.items() for endpoint in endpoints}
    return now - open_pairs, open_pairs - now


class ReplicaLedger:
    def __init__(
        self, store: CostStore, observe: Callable[[], Mapping[str, set[str]]], *, hardware: str, capacity_type: str,
        memory_of: Callable[[str], int], interval_s: float = 30.0, close_on_stop: bool = True, clock: Callable[[], float] = time.time,
    ):  # fmt: skip
        self.store = store
        self.observe = observe
        self.hardware, self.capacity_type = hardware, capacity_type
        self.memory_of = memory_of
        self.interval_s = interval_s
        self.close_on_stop = close_on_stop
        self.clock = clock
        self._rounds = Periodic("replica-ledger", interval_s, self._round, first_s=0.0)
        self._seen: set[str] = set()

    def sync(self, observed: Mapping[str, set[str]] | None = None) -> tuple[int, int]:
        """One round (blocking: the database); returns (opened, closed)."""
        observed = self.observe() if observed is None else observed
        at = self.clock()
        opened, closed = ledger_changes(self.store.open_pairs(), observed)
        for replica, endpoint in sorted(closed):
            self.store.replica_down(replica, endpoint, at)
        for replica, endpoint in sorted(opened):
            self.store.replica_up(replica, endpoint, hardware=self.hardware, capacity_type=self.capacity_type,
                                  memory_bytes=self.memory_of(endpoint), at=at)  # fmt: skip
        self._seen |= set(observed)
        return len(opened), len(closed)

    def start(self) -> None:
        self._rounds.start()

    async def _round(self) -> None:
        try:
            await asyncio.to_thread(self.sync, self.observe())
        except Exception as err:  # the database is away: the next round catches up
            log.warning("replica ledger sync failed (%s); next round in %.0fs", err, self.interval_s)

    async def stop(self) -> None:
        await self._rounds.stop()
        if self.close_on_stop and self._seen:
            at = self.clock()
            try:
                await asyncio.to_thread(lambda: [self.store.replica_down(r, None, at) for r in sorted(self._seen)])
            except Exception as err:
                log.warning("closing the replica ledger's intervals failed (%s); the next sync closes them", err)


def fleet_ledger(settings, fleet, registry) -> ReplicaLedger:
    """The ledger of a running frontend's fleet (server.control.scaling.fleet.Fleet)."""

    def observe() -> dict[str, set[str]]:
        return {m.id: set(m.models) for m in fleet.replicas.members() if m.state == UP}

    return ReplicaLedger(
        CostStore(registry), observe, hardware=settings.hardware_class, capacity_type=settings.capacity_type,
        memory_of=fleet.memory_of, interval_s=settings.replica_ledger_interval_s, close_on_stop=not (settings.triton_url or settings.model_groups_file),
    )  # fmt: skip
