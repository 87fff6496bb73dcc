"""Traffic policies: each endpoint's canary / blue-green / A/B split and shadow, with their history.

One row per policy ever set; ``status`` 'active' rows are re-installed when the frontend starts.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "traffic_policies",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("endpoint", sa.String(200), nullable=False),
        sa.Column("slot", sa.String(16), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("spec", sa.JSON, nullable=False),
        sa.Column("state", sa.JSON, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("actor", sa.String(200), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    op.create_index("ix_traffic_policies_endpoint", "traffic_policies", ["endpoint"])


def downgrade() -> None:
    op.drop_index("ix_traffic_policies_endpoint", table_name="traffic_policies")
    op.drop_table("traffic_policies")
