"""The registry database: an engine and sessions from one URL (SQLite by default, PostgreSQL by URL).

A SQLite file's folder is created (the default, ``sqlite:///DATA_DIR/inferplane.db``, lives in the
settings' data dir, the same whatever the working directory).
PostgreSQL URLs may name the driver or not (``postgresql://`` uses psycopg 3).
"""

from __future__ import annotations

import contextlib
import fcntl
import zlib
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import Connection, Engine, Table, create_engine, event, insert, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker


def normalize_url(url: str) -> str:
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def libpq_url(url: str) -> str:
    """A PostgreSQL URL as libpq reads it (psycopg's own connections: LISTEN, the leader lease's session)."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def make_engine(url: str, **kwargs) -> Engine:
    """An engine for ``url``; SQLite gets its folder created, foreign keys on and a busy timeout."""
    url = normalize_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        if database and database != ":memory:" and not database.startswith("file:"):
            Path(database).parent.mkdir(parents=True, exist_ok=True)
        kwargs.setdefault("connect_args", {"timeout": 30})
        engine = create_engine(url, **kwargs)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection, _record) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.close()

        return engine
    kwargs.setdefault("pool_pre_ping", True)
    return create_engine(url, **kwargs)


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def upsert(session: Session | Connection, table: Table, key: dict, row: dict, *, new: dict | None = None) -> None:
    """Set ``row``'s columns on the row of ``table`` whose columns equal ``key``, or insert it (``key``, ``row``
    and ``new``: the columns only a new row gets, e.g. ``created_at``) where there is none: the same statements
    on SQLite and PostgreSQL. The caller commits."""
    where = [table.c[column] == value for column, value in key.items()]
    if not session.execute(update(table).where(*where).values(**row)).rowcount:
        session.execute(insert(table).values(**key, **row, **(new or {})))


def display_url(url: str) -> str:
    """A database URL fit to print or log: the password masked."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy reads: show its scheme only
        return url.split(":", 1)[0] + ":…"


@contextlib.contextmanager
def exclusive(connection: Connection, name: str) -> Iterator[None]:
    """Hold a lock named ``name`` across processes while the block runs: a PostgreSQL session
    advisory lock on ``connection``'s server, or for a SQLite file an ``flock`` on ``FILE.NAME.lock``
    beside it (an in-memory database is one process's: nothing to hold)."""
    if connection.dialect.name == "postgresql":
        key = zlib.crc32(f"inferplane:{name}".encode())
        connection.execute(text("SELECT pg_advisory_lock(:k)"), {"k": key})
        connection.commit()
        try:
            yield
        finally:
            connection.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
            connection.commit()
        return
    database = connection.engine.url.database or ""
    if connection.dialect.name != "sqlite" or not database or database == ":memory:" or database.startswith("file:"):
        yield
        return
    with open(f"{database}.{name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
