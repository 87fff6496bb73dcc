"""``inferplane dev cluster`` (issue 27): the production topology on loopback, one command.

PostgreSQL and Redis are the machine's (checked first, with a clear message where one is missing);
then ``tritons`` Triton processes (supervised here, explicit model control, all reading the one
repository folder: the frontends load the repository's models on each, the leader's reconciler places
what is deployed later and brings a Triton that returns up to date), the control-plane replicas
(``inferplane control run``: one leads, the others stand by), and the frontends (``inferplane serve
--workers N`` with ``INFERPLANE_CONTROL_PLANE=external``: stateless, they watch the desired state and
carry control RPCs to the leader). Every process is a child that dies with this one; Ctrl-C stops them
all, frontends first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import redis
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from server.db import make_engine, normalize_url
from server.runtime.supervisor import TritonSupervisor, _die_with_parent, free_port
from server.runtime.workers import stop_processes

log = logging.getLogger(__name__)

READY = re.compile(r"inferplane ready grpc=(\S+) metrics=(\S+) http=(\S+)")


class ClusterError(RuntimeError):
    """A dependency is missing or a member did not start; the message says which and what to do."""


@dataclass
class Member:
    role: str  # control | frontend
    name: str
    process: asyncio.subprocess.Process
    grpc: str = ""
    http: str = ""
    metrics: str = ""


@dataclass
class LocalCluster:
    database_url: str
    redis_url: str | None
    repository: Path
    workdir: Path
    controls: int = 2
    frontends: int = 2
    workers: int = 2
    env: dict[str, str] = field(default_factory=dict)
    tritons: int = 3
    triton_processes: list[TritonSupervisor] = field(default_factory=list)
    members: list[Member] = field(default_factory=list)

    @property
    def triton_urls(self) -> str:
        return ",".join(t.grpc_target for t in self.triton_processes)

    async def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.triton_processes = [TritonSupervisor(self.repository, self.workdir / f"triton{i}", tag=f"t{i}") for i in range(self.tritons)]
        await asyncio.gather(*(t.start() for t in self.triton_processes))
        common = {"INFERPLANE_DATABASE_URL": self.database_url, **({"INFERPLANE_REDIS_URL": self.redis_url} if self.redis_url else {})}
        for i in range(self.controls):  # one after the other: the first migrates an empty database
            args = ["control", "run", "--triton-url", self.triton_urls, "--model-repository", str(self.repository),
                    "--workdir", str(self.workdir / f"control{i}")]  # fmt: skip
            await self._spawn("control", f"control{i}", args, common)
        for i in range(self.frontends):
            args = ["serve", "--workers", str(self.workers), "--grpc-port", str(free_port()), "--http-port", str(free_port()),
                    "--metrics-port", str(free_port()), "--triton-url", self.triton_urls,
                    "--model-repository", str(self.repository), "--workdir", str(self.workdir / f"frontend{i}")]  # fmt: skip
            await self._spawn("frontend", f"frontend{i}", args, {**common, "INFERPLANE_CONTROL_PLANE": "external"})

    async def _spawn(self, role: str, name: str, args: list[str], env: dict[str, str], timeout: float = 180.0) -> Member:
        log_path = self.workdir / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as stderr:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "server.cli.main", *args, stdout=asyncio.subprocess.PIPE, stderr=stderr,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env, **env}, preexec_fn=_die_with_parent,
            )  # fmt: skip
        member = Member(role, name, proc)
        self.members.append(member)  # stopped with the others even when it never gets ready
        try:
            while True:
                line = (await asyncio.wait_for(proc.stdout.readline(), timeout)).decode(errors="replace")
                if not line:
                    raise ClusterError(f"{name} exited before it was ready (exit {await proc.wait()}); see {log_path}")
                m = READY.search(line)
                if m:
                    member.grpc, member.metrics, member.http = m.group(1), m.group(2), m.group(3)
                    break
        except asyncio.TimeoutError:
            raise ClusterError(f"{name} was not ready within {timeout:g}s; see {log_path}") from None
        asyncio.get_running_loop().create_task(_drain(proc.stdout))
        return member

    def describe(self) -> str:
        lines = [f"database  {self.database_url}", f"redis     {self.redis_url or '(none: quotas per worker)'}",
                 *(f"triton{i:<3} {t.grpc_target} (repository {self.repository})" for i, t in enumerate(self.triton_processes))]  # fmt: skip
        for m in self.members:
            if m.role == "control":
                lines.append(f"{m.name:<9} control RPCs grpc={m.grpc} (pid {m.process.pid})")
            else:
                lines.append(f"{m.name:<9} grpc={m.grpc} http={m.http} metrics={m.metrics} ({self.workers} workers, pid {m.process.pid})")
        return "\n".join(lines)

    async def stop(self, timeout: float = 15.0) -> None:
        for role in ("frontend", "control"):
            await stop_processes([m.process for m in self.members if m.role == role and m.process.returncode is None], timeout)
        await asyncio.gather(*(t.stop() for t in self.triton_processes))


def check_postgres(url: str) -> None:
    """The database answers (PostgreSQL: created when the server is up but the database is not)."""
    url = normalize_url(url)
    try:
        engine = make_engine(url)
        with engine.connect():
            pass
        engine.dispose()
        return
    except OperationalError as err:
        parsed = make_url(url)
        if parsed.get_backend_name() != "postgresql" or "does not exist" not in str(err):
            raise ClusterError(
                f"PostgreSQL at {parsed.render_as_string(hide_password=True)} does not answer ({str(err).splitlines()[0]}); "
                "start it (.ci/run installs Debian's postgresql and starts it on 127.0.0.1:5432) or give --database-url"
            ) from None
    admin = create_engine(parsed.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{parsed.database}"'))
    admin.dispose()


def check_redis(url: str) -> None:
    client = redis.Redis.from_url(url, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as err:
        raise ClusterError(f"Redis at {url} does not answer ({err}); start redis-server or give --redis-url ''") from None
    finally:
        client.close()


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass
