"""One leader for the control plane's writers (issue 27): a lease every replica competes for.

* **PostgreSQL** (``PostgresLease``): a session-level ``pg_try_advisory_lock`` held on a dedicated
  connection. The lock lives exactly as long as that session: a leader killed with ``kill -9`` closes
  its socket and the server drops the lock at once; a host that vanishes without closing it is found
  by TCP keepalives set on both ends of the session (``keepalive_s``). Renewing is one round trip on
  that connection; an error means the session (and so the lock) may be gone: leadership is lost.
* **SQLite** (``RowLease``, the embedded default; also usable on PostgreSQL): the ``control_lease``
  row (migration 0010) names a holder and an expiry; a replica takes the row when it is free or
  expired and renews it every ``ttl_s / 4``; a renewal that finds another holder has lost.

* **Kubernetes** (``KubernetesLease``, ``INFERPLANE_CONTROL_LEASE=kubernetes``): a ``coordination.k8s.io/v1``
  Lease (server.control.service.kube_lease).

Every way the leader writes its address (where frontends carry control RPCs) into that row, and
``LeaderDirectory`` reads it back. ``Leadership`` is the loop: acquire (retrying every ``retry_s``),
run ``on_lead``, renew until a renewal fails, then ``on_lost``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable

import psycopg
from sqlalchemy import BigInteger, Column, Engine, Float, MetaData, String, Table, insert, select, update

from server.control.service.kube_lease import KubernetesLease
from server.db import libpq_url, session_factory

log = logging.getLogger(__name__)

LEASE = "control"
ADVISORY_KEY = 0x1F_E12_7A_CE  # one bigint for the whole platform's control plane
metadata = MetaData()
control_lease = Table(
    "control_lease",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("holder", String(200), nullable=False),
    Column("address", String(200), nullable=False),
    Column("expires_at", Float, nullable=False),
    Column("term", BigInteger, nullable=False),
)


def holder_id() -> str:
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:6]}"


class RowLease:
    """The lease row: free, expired or ours -> taken; renewals extend it while we still hold it."""

    def __init__(self, engine: Engine, holder: str, address: str, *, ttl_s: float = 6.0, clock: Callable[[], float] = time.time):
        self.engine = engine
        self.holder = holder
        self.address = address
        self.ttl_s = ttl_s
        self.renew_s = ttl_s / 4
        self._session = session_factory(engine)
        self._clock = clock
        self.term = 0

    def _try(self) -> bool:
        now = self._clock()
        with self._session() as session:
            if self.engine.dialect.name == "sqlite":
                session.connection().exec_driver_sql("BEGIN IMMEDIATE")  # one writer decides at a time
            row = session.execute(select(control_lease).where(control_lease.c.name == LEASE).with_for_update()).first()
            if row is None:
                session.execute(insert(control_lease).values(name=LEASE, holder=self.holder, address=self.address, expires_at=now + self.ttl_s, term=1))
                self.term = 1
            elif row.holder == self.holder or row.expires_at < now:
                self.term = row.term if row.holder == self.holder else row.term + 1
                session.execute(
                    update(control_lease).where(control_lease.c.name == LEASE)
                    .values(holder=self.holder, address=self.address, expires_at=now + self.ttl_s, term=self.term)
                )  # fmt: skip
            else:
                session.rollback()
                return False
            session.commit()
            return True

    def _renew(self) -> bool:
        now = self._clock()
        with self._session() as session:
            # still ours while nobody took it, even after a stall past the expiry (a lone process keeps leading)
            done = session.execute(
                update(control_lease)
                .where(control_lease.c.name == LEASE, control_lease.c.holder == self.holder)
                .values(expires_at=now + self.ttl_s, address=self.address)
            )  # fmt: skip
            session.commit()
            return done.rowcount == 1

    def _release(self) -> None:
        with self._session() as session:
            session.execute(
                update(control_lease).where(control_lease.c.name == LEASE, control_lease.c.holder == self.holder).values(expires_at=0.0)
            )
            session.commit()

    async def acquire(self) -> bool:
        return await asyncio.to_thread(self._try)

    async def renew(self) -> bool:
        return await asyncio.to_thread(self._renew)

    async def release(self) -> None:
        await asyncio.to_thread(self._release)


class AddressRow:
    """The lease row of a lease held elsewhere (PostgreSQL's advisory lock, a Kubernetes Lease): it only
    tells frontends the leader's address (``LeaderDirectory``), with an expiry renewals push forward."""

    def __init__(self, engine: Engine, holder: str, ttl_s: float):
        self.holder = holder
        self.ttl_s = ttl_s
        self._session = session_factory(engine)

    def take(self, address: str) -> int:
        """The lease is ours: the row names us whatever it said; returns the new term."""
        with self._session() as session:
            row = session.execute(select(control_lease.c.term).where(control_lease.c.name == LEASE).with_for_update()).first()
            term = (row[0] + 1) if row else 1
            values = {"holder": self.holder, "address": address, "expires_at": time.time() + self.ttl_s, "term": term}
            if row is None:
                session.execute(insert(control_lease).values(name=LEASE, **values))
            else:
                session.execute(update(control_lease).where(control_lease.c.name == LEASE).values(**values))
            session.commit()
        return term

    def advertise(self, address: str) -> None:
        with self._session() as session:
            session.execute(
                update(control_lease).where(control_lease.c.name == LEASE)
                .values(holder=self.holder, address=address, expires_at=time.time() + self.ttl_s)
            )  # fmt: skip
            session.commit()


class PostgresLease:
    """``pg_try_advisory_lock`` on a session of its own; the row only tells frontends the address."""

    def __init__(self, engine: Engine, database_url: str, holder: str, address: str, *, renew_s: float = 1.0, keepalive_s: int = 5):
        self.engine = engine
        self.url = libpq_url(database_url)
        self.holder = holder
        self.address = address
        self.renew_s = renew_s
        self.keepalive_s = keepalive_s
        self._conn: psycopg.AsyncConnection | None = None
        self._row = AddressRow(engine, holder, ttl_s=10 * renew_s)
        self.term = 0

    async def _connect(self) -> psycopg.AsyncConnection:
        k = self.keepalive_s
        conn = await psycopg.AsyncConnection.connect(
            self.url, autocommit=True, keepalives=1, keepalives_idle=k, keepalives_interval=1, keepalives_count=3, connect_timeout=5,
            application_name="inferplane-control-lease",
        )  # fmt: skip
        for name, value in (("tcp_keepalives_idle", k), ("tcp_keepalives_interval", 1), ("tcp_keepalives_count", 3)):
            await conn.execute(f"SET {name} = {int(value)}")  # the server drops a vanished leader's session (and lock)
        return conn

    async def acquire(self) -> bool:
        if self._conn is None or self._conn.closed:
            self._conn = await self._connect()
        got = (await (await self._conn.execute("SELECT pg_try_advisory_lock(%s)", (ADVISORY_KEY,))).fetchone())[0]
        if not got:
            return False
        self.term = await asyncio.to_thread(self._row.take, self.address)
        return True

    async def renew(self) -> bool:
        try:
            await self._conn.execute("SELECT 1")
        except psycopg.Error as err:
            log.error("the control-plane lease's session failed (%s): leadership lost", err)
            return False
        try:
            await asyncio.to_thread(self._row.advertise, self.address)  # the address row's expiry (frontends check it)
        except Exception as err:  # the lock still holds; only the advertisement is late
            log.warning("renewing the leader's address row failed: %s", err)
        return True

    async def release(self) -> None:
        if self._conn is not None and not self._conn.closed:
            await self._conn.close()  # the session ends: the lock goes with it


def lease_for(engine: Engine, database_url: str, holder: str, address: str, *, ttl_s: float = 6.0, kubernetes=None):
    """The database's lease, or with ``kubernetes`` (a ``server.runtime.kube_api.KubeAPI``) a Kubernetes Lease."""
    if kubernetes is not None:
        return KubernetesLease(kubernetes, AddressRow(engine, holder, ttl_s), holder, address, ttl_s=ttl_s)
    if engine.dialect.name == "postgresql":
        return PostgresLease(engine, database_url, holder, address, renew_s=ttl_s / 6)
    return RowLease(engine, holder, address, ttl_s=ttl_s)


class LeaderDirectory:
    """Where the leader is: the lease row's address while it has not expired (cached ``cache_s``)."""

    def __init__(self, engine: Engine, cache_s: float = 1.0, clock: Callable[[], float] = time.time):
        self._session = session_factory(engine)
        self.cache_s = cache_s
        self._clock = clock
        self._cached: tuple[float, str | None] = (0.0, None)

    def _read(self) -> str | None:
        with self._session() as session:
            row = session.execute(select(control_lease.c.address, control_lease.c.expires_at).where(control_lease.c.name == LEASE)).first()
        if row is None or row.expires_at < self._clock():
            return None
        return row.address

    async def address(self, fresh: bool = False) -> str | None:
        at, address = self._cached
        if fresh or address is None or self._clock() - at > self.cache_s:
            address = await asyncio.to_thread(self._read)
            self._cached = (self._clock(), address)
        return address


def lease_row(engine: Engine) -> dict | None:
    """The lease row as it stands (``inferplane control status``)."""
    with session_factory(engine)() as session:
        row = session.execute(select(control_lease).where(control_lease.c.name == LEASE)).first()
    return dict(row._mapping) if row is not None else None


class Leadership:
    """Acquire, lead, renew; ``leading`` says whether this process's writers may run now."""

    def __init__(self, lease, on_lead: Callable[[], Awaitable[None]], on_lost: Callable[[], Awaitable[None]], *, retry_s: float = 0.5):
        self.lease = lease
        self.on_lead = on_lead
        self.on_lost = on_lost
        self.retry_s = retry_s
        self.leading = False
        self.led_at: float | None = None

    async def try_once(self) -> bool:
        try:
            got = await self.lease.acquire()
        except Exception as err:  # the database is away: a standby tries again
            log.warning("acquiring the control-plane lease failed: %s", err)
            return False
        if got:
            self.leading = True
            self.led_at = time.time()
            log.info("this process leads the control plane (term %s)", getattr(self.lease, "term", "?"))
            await self.on_lead()
        return got

    async def run(self) -> None:
        """From standby (or after ``try_once`` won): lead until the lease is lost, then stand by again."""
        while True:
            while not self.leading and not await self.try_once():
                await asyncio.sleep(self.retry_s)
            while True:
                await asyncio.sleep(self.lease.renew_s)
                try:
                    held = await self.lease.renew()
                except Exception as err:
                    log.error("renewing the control-plane lease failed: %s", err)
                    held = False
                if not held:
                    break
            self.leading = False
            log.error("the control-plane lease is lost: this process's writers stop")
            await self.on_lost()

    async def release(self) -> None:
        if self.leading:
            self.leading = False
            try:
                await self.lease.release()
            except Exception as err:
                log.warning("releasing the control-plane lease failed: %s", err)
