"""Triton placements: which Triton serves which model version (the reconciler's desired state).

One row per (model, version, triton); ``triton`` is one Triton's id or ``*`` (every Triton the
reconciler sees). A removed placement keeps its row with ``removed_at`` set: the reconciler keeps
the version loaded for the drain period, then unloads it. ``generation`` counts the changes to a
model's placements (the reconciler logs it with what it applies).

Revision ID: 0014
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "triton_placements",
        sa.Column("model", sa.String(200), primary_key=True),
        sa.Column("version", sa.Integer, primary_key=True),
        sa.Column("triton", sa.String(200), primary_key=True),
        sa.Column("config", sa.Text, nullable=True),
        sa.Column("generation", sa.Integer, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.Column("removed_at", sa.Float, nullable=True),
    )


def downgrade() -> None:
    op.drop_table("triton_placements")
