"""Local Triton replicas: extra ``tritonserver`` children beside the embedded one.

Each replica is a :class:`~server.runtime.supervisor.TritonSupervisor` of its own: its own
loopback ports, its own workdir (``WORKDIR/replicas/ID``: backends, log), its own shared-memory
prefix (the supervisor's ``tag``), the same model repository — and, in explicit model control,
only the models the control plane loads on it. Each is restarted by its supervisor when it dies;
the pool reports that (``on_down(id)``, ``on_restart(id, target)``) so the replica set stops
sending it traffic and lets it rejoin. The embedded Triton the frontend starts is adopted as the
first replica.

Warm pool (issue 29): Tritons started before any scale-up asks for them, of two kinds.

* *standbys* (``INFERPLANE_WARM_STANDBY=fraud_xgboost=1,tiny_llama=1``): a Triton holding one
  endpoint's model, loaded (its Python-backend stub started, its weights read) and out of rotation; a
  replica's start whose placement hosts that model takes it, and the executor puts it into rotation
  without loading anything (``holds``) — the scale-up is a member joining, no process start, no load;
* *empty* members (``INFERPLANE_WARM_POOL=N``): started, nothing loaded; a replica's start with no
  standby for its models takes one and the executor loads the models into it as usual.

A taken member's id and callbacks are re-pointed to the replica and the pool is refilled in the
background. A standby is taken only while the model's directory is what it loaded (``_signature``:
a deploy that wrote another version makes it an empty member's worth: the executor loads again); a
standby whose Triton died and restarted loads its model again. Placement decides how many standbys
the pool keeps (``keep_standby``: those whose model fits a replica, server.control.scaling.placement).

The pool converges on what it keeps: a warm member whose start or model load fails (a Triton not live
within its timeout on a loaded machine, a load refused) is started again after a backoff that doubles
with each failure in a row (``retry_delay``: 1 s, 2 s, ... up to 30 s; a success starts it over), each
failure logged with its count and the wait — not left short until a placement change refills it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from pathlib import Path

from server.runtime.supervisor import TritonSupervisor
from server.runtime.triton_install import TritonInstallation

log = logging.getLogger(__name__)

Loader = Callable[[str, str], Awaitable[None]]  # (gRPC target, model): load the model there, return once ready


def parse_standby(spec: str) -> dict[str, int]:
    """``"fraud_xgboost=1,tiny_llama=2"`` -> ``{"fraud_xgboost": 1, "tiny_llama": 2}`` (a bare name: 1)."""
    out: dict[str, int] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, _, count = part.partition("=")
        name = name.strip()
        if not name or (count and not count.strip().isdigit()):
            raise ValueError(f"warm standby entries are MODEL or MODEL=N, got {part!r}")
        out[name] = int(count) if count.strip() else 1
    return out


def retry_delay(failures: int, first_s: float, max_s: float) -> float:
    """The wait before the pool starts a warm member again after ``failures`` failed starts in a row."""
    return min(first_s * 2 ** max(0, failures - 1), max_s)


def _signature(model_dir: Path) -> tuple[int, int]:
    """What a model's directory holds, cheaply: (files, newest mtime in ns) of its files; the
    ``__pycache__`` the Python backend's stub writes when it loads (and the directory mtimes it
    bumps) are not the model."""
    files = [p for p in model_dir.rglob("*") if "__pycache__" not in p.parts and p.is_file()] if model_dir.is_dir() else []
    stamps = [p.stat().st_mtime_ns for p in files]
    return len(stamps), max(stamps, default=0)


def _ready_pid(warm: "_Warm") -> int | None:
    """A member's pid once it is what it is kept as: live, and a standby's model loaded (the supervisor
    is ready only after its restart's reload)."""
    return warm.supervisor.pid if warm.supervisor.state == "ready" else None


@dataclass
class _Warm:
    supervisor: TritonSupervisor
    model: str | None = None  # a standby's model; None: empty
    signature: tuple[int, int] = (0, 0)  # the model's directory when it was loaded


class LocalReplicaPool:
    def __init__(
        self,
        repository: Path,
        workdir: Path,
        *,
        install: TritonInstallation | None = None,
        startup_timeout: float = 120.0,
        response_cache_bytes: int = 64 << 20,
        otlp_traces_url: str | None = None,
        on_down: Callable[[str], None] | None = None,
        on_restart: Callable[[str, str], Awaitable[None]] | None = None,
        warm_pool: int = 0,
        standby: dict[str, int] | None = None,
        load: Loader | None = None,
        retry_s: float = 1.0,
        retry_max_s: float = 30.0,
    ):
        self.repository = Path(repository)
        self.workdir = Path(workdir)
        self._install = install
        self.startup_timeout = startup_timeout
        self.response_cache_bytes = response_cache_bytes
        self.otlp_traces_url = otlp_traces_url  # each replica's Triton traces as the embedded one does
        self.on_down = on_down
        self.on_restart = on_restart
        self.supervisors: dict[str, TritonSupervisor] = {}
        self.adopted: set[str] = set()  # started by someone else (the embedded one): never stopped here
        self.started_s: dict[str, float] = {}  # how long each replica took to become live
        self.warm_pool = warm_pool
        self.standby = dict(standby or {})  # model -> standbys kept
        self.load = load
        if self.standby and load is None:
            raise ValueError("a warm standby needs a loader")
        self.warm: list[_Warm] = []  # started (a standby: its model loaded), no replica yet
        self.from_warm: dict[str, str] = {}  # replica -> what it took: "empty" or the standby's model
        self._held: dict[str, set[str]] = {}  # replica -> models its Triton held when it took a standby
        self._warming: dict[str | None, int] = {}
        self.taken_over = 0  # replicas whose dead Triton a standby replaced (take_over)
        self._warm_started = 0
        self._refills: set[asyncio.Task] = set()
        self.retry_s, self.retry_max_s = retry_s, retry_max_s  # the backoff after a failed warm start
        self.warm_failures = 0  # warm starts (or their model loads) that failed, ever
        self._failing = 0  # ... in a row: the backoff's exponent (a success resets it)
        self._retry: asyncio.Task | None = None  # the one pending start-again, if any

    @property
    def install(self) -> TritonInstallation:
        if self._install is None:
            self._install = TritonInstallation.find()
        return self._install

    def adopt(self, replica_id: str, supervisor: TritonSupervisor) -> None:
        """Count an already running supervisor as a replica (the frontend's embedded Triton)."""
        self.supervisors[replica_id] = supervisor
        self.adopted.add(replica_id)

    def ids(self) -> list[str]:
        return list(self.supervisors)

    def target(self, replica_id: str) -> str:
        return self.supervisors[replica_id].grpc_target

    def pid(self, replica_id: str) -> int | None:
        supervisor = self.supervisors.get(replica_id)
        return supervisor.pid if supervisor is not None else None

    def down_handler(self, replica_id: str) -> Callable[[], None]:
        def down() -> None:
            if self.on_down is not None:
                self.on_down(replica_id)

        return down

    def restart_handler(self, replica_id: str) -> Callable[[], Awaitable[None]]:
        async def restarted() -> None:
            if self.on_restart is not None:
                await self.on_restart(replica_id, self.supervisors[replica_id].grpc_target)

        return restarted

    def _supervisor(self, name: str) -> TritonSupervisor:
        return TritonSupervisor(
            self.repository,
            self.workdir / "replicas" / name,
            install=self.install,
            on_down=self.down_handler(name),
            on_restart=self.restart_handler(name),
            startup_timeout=self.startup_timeout,
            response_cache_bytes=self.response_cache_bytes,
            otlp_traces_url=self.otlp_traces_url,
            tag=name.replace("_", "-"),
        )

    def warm_pids(self) -> list[int | None]:
        """The empty members' pids (None: one restarting)."""
        return [_ready_pid(w) for w in self.warm if w.model is None]

    def standby_pids(self) -> dict[str, list[int | None]]:
        """Each model's standbys' pids (None: one restarting, its model not loaded again yet — its new
        process has a pid from its spawn on, before it is live and holds the model)."""
        out: dict[str, list[int | None]] = {}
        for w in self.warm:
            if w.model is not None:
                out.setdefault(w.model, []).append(_ready_pid(w))
        return out

    async def keep_standby(self, counts: dict[str, int]) -> None:
        """Keep ``counts`` standbys per model from now on (placement's: those that fit a replica): the
        waiting ones beyond them stop, freeing their memory; missing ones start in the background."""
        self.standby = {m: n for m, n in counts.items() if n > 0}
        surplus: list[_Warm] = []
        for model in sorted({w.model for w in self.warm if w.model is not None}):
            surplus += [w for w in self.warm if w.model == model][self.standby.get(model, 0) :]
        for warm in surplus:
            self.warm.remove(warm)
            log.warning("warm standby of %s (pid %s) stopped: placement keeps %d", warm.model, warm.supervisor.pid, self.standby.get(warm.model, 0))
        await asyncio.gather(*(w.supervisor.stop() for w in surplus))
        if self._short():
            self._refill()

    def _kept(self, model: str | None) -> int:
        """The warm members of ``model`` (None: the empty ones)."""
        return sum(1 for w in self.warm if w.model == model)

    def _short(self) -> list[str | None]:
        """One entry per member missing (counting those starting): empty ones (None), then standbys."""
        kinds: list[str | None] = []
        for kind, n in [(None, self.warm_pool), *self.standby.items()]:
            have = self._kept(kind) + self._warming.get(kind, 0)
            kinds += [kind] * max(0, n - have)
        return kinds

    async def fill_warm(self) -> None:
        """Start warm members (and load the standbys' models) until the pool holds what it keeps;
        the members start concurrently."""
        kinds = self._short()
        for kind in kinds:  # counted before anything awaits: a refill running beside this one sees them
            self._warming[kind] = self._warming.get(kind, 0) + 1
        await asyncio.gather(*(self._fill_one(kind) for kind in kinds))

    async def _fill_one(self, model: str | None) -> None:
        self._warm_started += 1
        name = f"warm-{self._warm_started}"
        warm = _Warm(self._supervisor(name), model)  # its own workdir and shm prefix
        warm.supervisor.on_down = lambda: None
        warm.supervisor.on_restart = lambda: self._reload_standby(warm)
        try:
            await warm.supervisor.start()
            if model is not None:
                warm.signature = _signature(self.repository / model)
                await self.load(warm.supervisor.grpc_target, model)
                if self._kept(model) >= self.standby.get(model, 0):  # placement refused it while it started
                    log.info("warm Triton %s for %s not kept: the pool keeps %d", name, model, self.standby.get(model, 0))
                    await warm.supervisor.stop()
                    return
            self.warm.append(warm)
            self._failing = 0
            log.info("warm Triton %s ready at %s%s", name, warm.supervisor.grpc_target, f" holding {model}" if model else "")
        except Exception as err:  # short until the start-again (a scale-up meanwhile starts cold)
            self.warm_failures += 1
            self._failing += 1
            delay = retry_delay(self._failing, self.retry_s, self.retry_max_s)
            log.warning("starting warm Triton %s%s failed (%d in a row): %s; starting one again in %.1fs",
                        name, f" for {model}" if model else "", self._failing, err, delay)  # fmt: skip
            await warm.supervisor.stop()
            self._start_again(delay)
        finally:
            self._warming[model] -= 1

    async def _reload_standby(self, warm: _Warm) -> None:
        """A standby's Triton restarted (empty): load its model again before it counts as one."""
        if warm.model is None or warm not in self.warm:
            return
        model = warm.model
        self.warm.remove(warm)
        self._warming[model] = self._warming.get(model, 0) + 1  # still counted: a refill meanwhile starts no second one
        try:
            warm.signature = _signature(self.repository / model)
            await self.load(warm.supervisor.grpc_target, model)
        except Exception as err:  # it stays, empty (a live Triton), and a standby of the model is started
            log.warning("reloading %s on a restarted standby failed: %s", model, err)
            warm.model = None
        finally:
            self._warming[model] -= 1
        self.warm.append(warm)
        if warm.model is None:
            self._refill()

    def _refill(self) -> None:
        self._background(self.fill_warm(), "warm-pool-refill")

    def _start_again(self, delay: float) -> None:
        """Fill the pool again in ``delay`` s (one pending at a time: it fills every kind short then)."""
        if self._retry is not None and not self._retry.done():
            return

        async def later() -> None:
            await asyncio.sleep(delay)
            self._retry = None  # a failure in this fill schedules the next one
            await self.fill_warm()

        self._retry = self._background(later(), "warm-pool-retry")

    def _background(self, work: Coroutine[None, None, None], name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._refills.add(task)
        task.add_done_callback(self._refills.discard)
        return task

    def _live(self) -> list[_Warm]:
        return [w for w in self.warm if w.supervisor.pid is not None and w.supervisor.state == "ready"]

    def _current(self, warm: _Warm) -> bool:
        return warm.model is not None and warm.signature == _signature(self.repository / warm.model)

    def _pick(self, models: set[str]) -> _Warm | None:
        """A standby of one of ``models`` still current, else an empty member."""
        live = self._live()
        for w in live:
            if w.model in models:
                if self._current(w):
                    return w
                log.info("standby of %s (pid %s) is stale: its model's directory changed since it loaded", w.model, w.supervisor.pid)
        return next((w for w in live if w.model is None), None)

    def take_over(self, replica_id: str, models: set[str]) -> str | None:
        """A replica's Triton died: a standby holding all of ``models`` (what the replica hosts)
        becomes the replica at once, and the dead one, restarting, becomes that standby (it loads
        the model again). Returns the replica's new gRPC target; None when no standby fits (or the
        replica is the embedded one: its supervisor is the frontend's)."""
        if replica_id in self.adopted or replica_id not in self.supervisors or not models:
            return None
        standby = next((w for w in self._live() if {w.model} >= models and self._current(w)), None)
        if standby is None:
            return None
        self.warm.remove(standby)
        dead, live = self.supervisors[replica_id], standby.supervisor
        live.on_down, live.on_restart = self.down_handler(replica_id), self.restart_handler(replica_id)
        self.supervisors[replica_id] = live
        self._held[replica_id] = {standby.model}
        self.from_warm[replica_id] = standby.model
        back = _Warm(dead, standby.model)  # not live while it restarts: nothing takes it before it reloaded
        dead.on_down, dead.on_restart = lambda: None, lambda: self._reload_standby(back)
        self.warm.append(back)
        self.taken_over += 1
        log.warning("local replica %s: its Triton died; standby %s (pid %s) took over", replica_id, live.grpc_target, live.pid)
        return live.grpc_target

    def _take_warm(self, replica_id: str, models: set[str]) -> TritonSupervisor | None:
        warm = self._pick(models)
        if warm is None:
            return None
        self.warm.remove(warm)
        supervisor = warm.supervisor
        supervisor.on_down = self.down_handler(replica_id)
        supervisor.on_restart = self.restart_handler(replica_id)
        self.from_warm[replica_id] = warm.model or "empty"
        if warm.model is not None:
            self._held[replica_id] = {warm.model}
        self._refill()
        return supervisor

    def holds(self, replica_id: str) -> set[str]:
        """The models a replica's Triton already held when it started (it took a standby)."""
        return set(self._held.get(replica_id, ()))

    async def start(self, replica_id: str, models: Iterable[str] = ()) -> str:
        """Start a replica that is to host ``models`` (or take a warm member: a standby of one of them,
        else an empty one); returns its gRPC target once its Triton is live (``holds``: the models
        it has loaded already)."""
        if replica_id in self.supervisors:
            return self.supervisors[replica_id].grpc_target
        loop = asyncio.get_running_loop()
        began = loop.time()
        warm = self._take_warm(replica_id, set(models))
        if warm is not None:
            self.supervisors[replica_id] = warm
            self.started_s[replica_id] = loop.time() - began
            log.info("local replica %s took warm Triton %s (pid %s)", replica_id, warm.grpc_target, warm.pid)
            return warm.grpc_target
        supervisor = self._supervisor(replica_id)
        self.supervisors[replica_id] = supervisor
        try:
            await supervisor.start()
        except BaseException:
            self.supervisors.pop(replica_id, None)
            await supervisor.stop()
            raise
        self.started_s[replica_id] = loop.time() - began
        log.info("local replica %s started at %s in %.1fs", replica_id, supervisor.grpc_target, self.started_s[replica_id])
        return supervisor.grpc_target

    async def stop(self, replica_id: str) -> None:
        if replica_id in self.adopted:
            return
        supervisor = self.supervisors.pop(replica_id, None)
        self._held.pop(replica_id, None)
        if supervisor is not None:
            await supervisor.stop()
            log.info("local replica %s stopped", replica_id)

    async def stop_all(self) -> None:
        for task in list(self._refills):
            task.cancel()
        # all at once: each Triton's graceful stop (unloading its models) takes seconds, and one after
        # the other a frontend with N replicas took N times that to exit
        warm, self.warm = self.warm, []
        await asyncio.gather(
            *(self.stop(r) for r in [r for r in self.supervisors if r not in self.adopted]), *(w.supervisor.stop() for w in warm)
        )
