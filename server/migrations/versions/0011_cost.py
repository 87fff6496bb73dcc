"""Cost: replica up/down intervals (what each endpoint's replicas reserved, for the owner view of cost)
and monthly budgets per team or endpoint (with an optional hard action at 100 %).

Revision ID: 0011
Revises: 0009 (the lead re-chains revisions at merge)
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "replica_intervals",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("replica", sa.String(200), nullable=False),
        sa.Column("endpoint", sa.String(200), nullable=False),
        sa.Column("hardware", sa.String(64), nullable=False),
        sa.Column("capacity_type", sa.String(16), nullable=False),
        sa.Column("memory_bytes", sa.BigInteger, nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("ended_at", sa.Float, nullable=True),
    )
    op.create_index("ix_replica_intervals_endpoint", "replica_intervals", ["endpoint"])
    op.create_index("ix_replica_intervals_started_at", "replica_intervals", ["started_at"])
    op.create_table(
        "cost_budgets",
        sa.Column("scope", sa.String(16), primary_key=True),  # team | endpoint
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("amount_usd", sa.Float, nullable=False),
        sa.Column("hard_action", sa.String(32), nullable=False),  # none | refuse_deploys | cap_replicas
        sa.Column("actor", sa.String(200), nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("cost_budgets")
    op.drop_index("ix_replica_intervals_started_at", table_name="replica_intervals")
    op.drop_index("ix_replica_intervals_endpoint", table_name="replica_intervals")
    op.drop_table("replica_intervals")
