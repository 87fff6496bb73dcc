"""The local warm pool's bookkeeping (server.runtime.local_replicas, issue 29): empty members and
loaded standbys, what a replica's start takes, a standby taking a dead replica's place, a standby
gone stale when its model's directory changed. Supervisors and the loader are fakes (pure logic);
the real Tritons are tests/integration/test_warm_standby.py's."""

from __future__ import annotations

import asyncio
import itertools
import os

import pytest

from server.runtime.local_replicas import LocalReplicaPool, parse_standby

_pids = itertools.count(100)


class FakeSupervisor:
    def __init__(self, name: str):
        self.name, self.pid, self.state = name, None, "stopped"
        self.grpc_target = f"127.0.0.1:{next(_pids)}"
        self.on_down = self.on_restart = None

    async def start(self):
        self.pid, self.state = next(_pids), "ready"

    async def stop(self):
        self.pid, self.state = None, "stopped"

    def die(self):  # what the real supervisor's watch does: on_down, then (restarted) on_restart
        self.pid, self.state = None, "restarting"
        self.on_down()

    async def restart(self):
        self.pid = next(_pids)
        await self.on_restart()
        self.state = "ready"


def pool_of(tmp_path, **kw) -> tuple[LocalReplicaPool, list]:
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "m" / "config.pbtxt").write_text("name: 'm'")
    loads: list = []

    async def load(target, model):
        loads.append((target, model))

    pool = LocalReplicaPool(tmp_path, tmp_path / "work", load=load, **kw)
    pool._supervisor = FakeSupervisor
    return pool, loads


async def one_standby(tmp_path):
    """A pool keeping one standby of ``m``, filled: (the pool, its loads, the standby)."""
    pool, loads = pool_of(tmp_path, standby={"m": 1})
    await pool.fill_warm()
    (standby,) = pool.warm
    return pool, loads, standby


def test_standby_specs_parse():
    assert parse_standby("") == {}
    assert parse_standby("fraud_xgboost=2, tiny_llama") == {"fraud_xgboost": 2, "tiny_llama": 1}
    with pytest.raises(ValueError):
        parse_standby("fraud=two")


async def test_a_start_takes_a_standby_of_its_model_else_an_empty_member(tmp_path):
    pool, loads = pool_of(tmp_path, warm_pool=1, standby={"m": 1})
    await pool.fill_warm()
    (standby_pid,) = pool.standby_pids()["m"]
    assert len(pool.warm_pids()) == 1 and [m for _, m in loads] == ["m"]
    await pool.start("local-1", {"other"})  # no standby of its models: the empty member
    assert pool.from_warm == {"local-1": "empty"} and pool.holds("local-1") == set()
    await pool.start("local-2", {"m"})
    assert pool.pid("local-2") == standby_pid and pool.holds("local-2") == {"m"}
    await asyncio.gather(*pool._refills)  # refilled behind them: one empty, one standby again
    assert len(pool.warm_pids()) == 1 and len(pool.standby_pids()["m"]) == 1 and pool.standby_pids()["m"] != [standby_pid]


async def test_a_standby_takes_a_dead_replicas_place_and_the_dead_one_becomes_the_standby(tmp_path):
    pool, loads = pool_of(tmp_path, standby={"m": 1})
    downs = []
    pool.on_down = downs.append
    await pool.fill_warm()
    await pool.start("local-1", {"m"})
    await asyncio.gather(*pool._refills)
    (standby_pid,) = pool.standby_pids()["m"]
    dead = pool.supervisors["local-1"]
    assert pool.take_over("local-1", {"m", "x"}) is None  # the standby does not hold all it hosts
    target = pool.take_over("local-1", {"m"})
    assert target == pool.target("local-1") and pool.pid("local-1") == standby_pid and pool.taken_over == 1
    dead.pid, dead.state = None, "restarting"
    assert pool.standby_pids()["m"] == [None]  # counted (no refill), not taken while it restarts
    await dead.restart()
    assert pool.standby_pids()["m"] == [dead.pid] and loads[-1] == (dead.grpc_target, "m")
    pool.supervisors["local-1"].die()  # the replica's callbacks went with the standby
    assert downs == ["local-1"]
    pool.adopt("local-0", FakeSupervisor("embedded"))
    assert pool.take_over("local-0", {"m"}) is None  # the embedded one's supervisor is the frontend's


async def test_a_standby_whose_model_changed_is_not_taken(tmp_path):
    pool, _ = pool_of(tmp_path, standby={"m": 1})
    await pool.fill_warm()
    stamp = (tmp_path / "m" / "config.pbtxt").stat().st_mtime_ns + 10**9
    (tmp_path / "m" / "2").mkdir()
    os.utime(tmp_path / "m" / "config.pbtxt", ns=(stamp, stamp))
    await pool.start("local-1", {"m"})
    assert pool.holds("local-1") == set() and "local-1" not in pool.from_warm  # started cold: the executor loads it


async def test_placement_sets_how_many_standbys_the_pool_keeps(tmp_path):
    pool, loads = pool_of(tmp_path, standby={"m": 2})
    await pool.fill_warm()
    waiting = pool.standby_pids()["m"]
    assert len(waiting) == 2
    await pool.keep_standby({"m": 0})  # refused (its copy outgrows a replica): the waiting ones stop
    assert pool.standby_pids() == {} and pool._short() == [] and not pool._refills
    await pool.keep_standby({"m": 1})  # fits again: one starts in the background
    await asyncio.gather(*pool._refills)
    assert len(pool.standby_pids()["m"]) == 1 and not set(pool.standby_pids()["m"]) & set(waiting)


async def test_a_standby_refused_while_it_started_is_not_kept(tmp_path):
    pool, loads = pool_of(tmp_path, standby={"m": 1})

    async def refused_meanwhile(target, model):
        loads.append((target, model))
        pool.standby = {}  # what keep_standby({"m": 0}) does while this one loads

    pool.load = refused_meanwhile
    await pool.fill_warm()
    assert loads and pool.standby_pids() == {} and pool.warm == []


async def test_the_local_executor_refuses_a_standby_larger_than_a_replica_and_reports_it(tmp_path):
    from server.control.scaling.executors import LocalExecutor
    from server.dataplane.replicas import ReplicaSet

    pool, _ = pool_of(tmp_path, standby={"m": 1})
    await pool.fill_warm()
    assert len(pool.standby_pids()["m"]) == 1  # started before placement knew the model's memory need
    need = {"m": 512 << 20}
    executor = LocalExecutor(ReplicaSet(), pool, client_factory=None, capacity_bytes=4 << 30, memory_of=need.get, standby={"m": 1})
    await executor.keep_standby()
    assert pool.standby_pids()["m"] and executor.describe()["memory_mb"] == {"replicas": 0, "standby": 512}
    need["m"] = 8 << 30  # the registry says 8 GiB: more than a replica's 4 GiB
    await executor.keep_standby()
    described = executor.describe()
    assert pool.standby_pids() == {} and pool.standby == {}  # stopped, and none started again
    assert described["standby_refused"] == {"m": 1} and described["memory_mb"] == {"replicas": 0, "standby": 0}


async def test_the_local_executor_counts_the_standbys_a_scale_up_can_take_now(tmp_path):
    from server.control.scaling.executors import LocalExecutor
    from server.dataplane.replicas import ReplicaSet

    pool, _ = pool_of(tmp_path, standby={"m": 2})
    await pool.fill_warm()
    executor = LocalExecutor(ReplicaSet(), pool, client_factory=None, standby={"m": 2})
    assert (executor.standby_ready("m"), executor.standby_ready("other")) == (2, 0)
    restarting = next(w for w in pool.warm if w.model == "m")
    restarting.supervisor.pid = None  # its Triton died and restarts: not takeable (the policy's cheap scale-up)
    assert executor.standby_ready("m") == 1


class FailsFirst(FakeSupervisor):
    """A supervisor whose first ``fails`` starts raise (a Triton not live within its timeout on a loaded machine)."""

    fails = 1

    async def start(self):
        if FailsFirst.fails > 0:
            FailsFirst.fails -= 1
            raise RuntimeError("tritonserver not live after 120.0s")
        await super().start()


async def test_a_failed_warm_start_is_started_again_until_the_pool_holds_what_it_keeps(tmp_path):
    pool, loads = pool_of(tmp_path, standby={"m": 1}, retry_s=0.01)
    pool._supervisor = FailsFirst
    FailsFirst.fails = 1
    await pool.fill_warm()
    assert pool.standby_pids() == {} and pool.warm_failures == 1 and loads == []  # short: its start failed
    assert pool._retry is not None and pool._short() == ["m"]  # ... and a start-again is pending
    await asyncio.gather(*pool._refills)  # the start-again, after its backoff
    assert len(pool.standby_pids()["m"]) == 1 and [m for _, m in loads] == ["m"] and pool.warm_failures == 1
    assert not pool._refills and pool._failing == 0  # converged: nothing more pending, the backoff starts over


async def test_a_failed_standby_load_is_started_again_and_failures_in_a_row_back_off(tmp_path):
    pool, loads = pool_of(tmp_path, warm_pool=1, standby={"m": 1}, retry_s=0.01)
    refusals = [RuntimeError("load failed: artifact missing")] * 3

    async def refused_thrice(target, model):
        loads.append((target, model))
        if refusals:
            raise refusals.pop()

    started: list[FakeSupervisor] = []
    pool.load = refused_thrice
    pool._supervisor = lambda name: started.append(FakeSupervisor(name)) or started[-1]
    await pool.fill_warm()
    assert len(pool.warm_pids()) == 1 and pool.standby_pids() == {} and pool._failing == 1  # the empty one started
    while pool._refills:  # each failure schedules the next start-again (one pending at a time)
        await asyncio.gather(*pool._refills)
    assert pool.warm_failures == 3 and len(loads) == 4 and len(pool.standby_pids()["m"]) == 1 and len(pool.warm_pids()) == 1
    assert pool._failing == 0 and len(started) == 5  # the empty one, three failed standbys, the one kept
    kept = {w.supervisor for w in pool.warm}
    assert all(s.state == "stopped" for s in started if s not in kept)  # the failed ones were stopped, not left running


def test_the_backoff_doubles_per_failure_in_a_row_up_to_its_cap():
    from server.runtime.local_replicas import retry_delay

    assert [retry_delay(n, 1.0, 30.0) for n in (1, 2, 3, 4, 5, 6, 9)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert retry_delay(0, 1.0, 30.0) == 1.0


async def test_a_standby_reloading_after_its_restart_counts_as_kept(tmp_path):
    pool, loads, standby = await one_standby(tmp_path)
    gate = asyncio.Event()

    async def slow(target, model):
        loads.append((target, model))
        await gate.wait()

    pool.load = slow
    standby.supervisor.die = lambda: None
    reload = asyncio.ensure_future(standby.supervisor.restart())  # its Triton restarted: loading the model again
    await asyncio.sleep(0)
    assert standby not in pool.warm and pool._short() == []  # not a member missing: no second standby
    await pool.fill_warm()
    assert len(loads) == 2  # the first fill, the reload: no new start meanwhile
    gate.set()
    await reload
    assert pool.warm == [standby] and pool.standby_pids()["m"] == [standby.supervisor.pid]


async def test_a_failed_reload_after_a_restart_leaves_an_empty_member_and_a_new_standby_is_started(tmp_path):
    pool, loads, standby = await one_standby(tmp_path)

    async def ok(target, model):
        loads.append((target, model))

    async def refusing(target, model):
        loads.append((target, model))
        pool.load = ok
        raise RuntimeError("load failed")

    pool.load = refusing
    await standby.supervisor.restart()
    assert standby.model is None and standby in pool.warm  # a live Triton kept, empty
    await asyncio.gather(*pool._refills)
    assert len(pool.standby_pids()["m"]) == 1 and pool.standby_pids()["m"] != [standby.supervisor.pid]


async def test_a_restarting_standby_is_not_reported_before_its_model_is_loaded_again(tmp_path):
    pool, _, standby = await one_standby(tmp_path)
    gate = asyncio.Event()

    async def slow(target, model):
        await gate.wait()

    pool.load = slow
    standby.supervisor.die = lambda: None
    standby.supervisor.state = "restarting"
    standby.supervisor.pid = 999  # its new process is spawned (a pid) while it starts and reloads
    assert pool.standby_pids()["m"] == [None]
    reload = asyncio.ensure_future(standby.supervisor.restart())
    await asyncio.sleep(0)
    assert pool.standby_pids() == {}  # out of the pool while it loads (counted as warming)
    gate.set()
    await reload
    assert pool.standby_pids()["m"] == [standby.supervisor.pid] != [None]
