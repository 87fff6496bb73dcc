"""Alembic environment: always called with a live connection by ``server.migrations``."""

from alembic import context

connection = context.config.attributes.get("connection")
if connection is None:  # pragma: no cover - the registry never runs alembic without a connection
    raise RuntimeError("run migrations through server.migrations.upgrade()/downgrade()")

# render_as_batch: SQLite cannot ALTER most things in place; batch mode copies the table
context.configure(connection=connection, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
