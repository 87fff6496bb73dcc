"""Typed per-model APIs: the protobuf schemas each endpoint serves, one row per schema major.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "typed_schemas",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("endpoint", sa.String(200), nullable=False),
        sa.Column("major", sa.Integer, nullable=False),
        sa.Column("revision", sa.Integer, nullable=False),
        sa.Column("model_version", sa.String(32), nullable=False),
        sa.Column("schema", sa.JSON, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("actor", sa.String(200), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.UniqueConstraint("endpoint", "major", name="uq_typed_schemas_endpoint_major"),
    )
    op.create_index("ix_typed_schemas_endpoint", "typed_schemas", ["endpoint"])


def downgrade() -> None:
    op.drop_index("ix_typed_schemas_endpoint", table_name="typed_schemas")
    op.drop_table("typed_schemas")
