"""Endpoint scaling: each endpoint's serving config for the fleet (min/max replicas, target and
signal, scale-to-zero idle time, cold-start budget, windows), one row per endpoint, read again when
a frontend starts; every change is also an ``audit_log`` row.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "endpoint_scaling",
        sa.Column("endpoint", sa.String(200), primary_key=True),
        sa.Column("config", sa.JSON, nullable=False),
        sa.Column("actor", sa.String(200), nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("endpoint_scaling")
