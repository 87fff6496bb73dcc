"""The typed-API schemas each endpoint serves, in the registry database (table ``typed_schemas``).

One row per (endpoint, schema major): the schema as JSON (``server.control.typed.typed_schema``), the
model version it was last derived from, and whether it is still served (``active``) or was retired
(``inferplane endpoints retire-schema NAME v1``). Synchronous; the catalog calls it off the event loop.
"""

from __future__ import annotations

import time

from sqlalchemy import JSON, Column, Engine, Float, Integer, MetaData, String, Table, UniqueConstraint, select, update

from server.db import upsert

metadata = MetaData()
schemas_table = Table(
    "typed_schemas",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("endpoint", String(200), nullable=False, index=True),
    Column("major", Integer, nullable=False),
    Column("revision", Integer, nullable=False),
    Column("model_version", String(32), nullable=False),
    Column("schema", JSON, nullable=False),
    Column("state", String(16), nullable=False),  # active | retired
    Column("actor", String(200), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    UniqueConstraint("endpoint", "major", name="uq_typed_schemas_endpoint_major"),
)


class TypedSchemaStore:
    def __init__(self, engine: Engine):
        self.engine = engine

    def save(self, endpoint: str, schema: dict, actor: str = "") -> None:
        """Insert or replace the row of (endpoint, schema["major"]); it is active afterwards."""
        now = time.time()
        values = {
            "revision": int(schema.get("revision", 0)), "model_version": str(schema.get("model_version", "")),
            "schema": schema, "state": "active", "actor": actor or "unknown", "updated_at": now,
        }  # fmt: skip
        with self.engine.begin() as conn:
            upsert(conn, schemas_table, {"endpoint": endpoint, "major": int(schema["major"])}, values, new={"created_at": now})

    def retire(self, endpoint: str, major: int, actor: str = "") -> bool:
        with self.engine.begin() as conn:
            result = conn.execute(
                update(schemas_table)
                .where(schemas_table.c.endpoint == endpoint, schemas_table.c.major == major, schemas_table.c.state == "active")
                .values(state="retired", actor=actor or "unknown", updated_at=time.time())
            )
            return result.rowcount > 0

    def rows(self, endpoint: str | None = None) -> list[dict]:
        """Every row (of one endpoint), oldest major first."""
        query = select(schemas_table).order_by(schemas_table.c.endpoint, schemas_table.c.major)
        if endpoint is not None:
            query = query.where(schemas_table.c.endpoint == endpoint)
        with self.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(query)]
