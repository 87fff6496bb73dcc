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
