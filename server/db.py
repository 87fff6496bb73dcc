"""The registry database: an engine and sessions from one URL (SQLite by default, PostgreSQL by URL).

A SQLite file's folder is created (the default, ``sqlite:///DATA_DIR/inferplane.db``, lives in the
settings' data dir, the same whatever the working directory).
PostgreSQL URLs may name the driver or not (``postgresql://`` uses psycopg 3).
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, create_engine, event
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


def display_url(url: str) -> str:
    """A database URL fit to print or log: the password masked."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy reads: show its scheme only
        return url.split(":", 1)[0] + ":…"
