"""Shadow copies on every serving process (issue 27).

``desired_state.shadow``: the endpoint's shadow ({"version", "percent", "key"}), published by the leader
and applied by every frontend worker like its split. ``shadow_reports``: one row per (reporting process,
endpoint, shadow key) — that process's cumulative comparison counts for the shadow — replaced at each
report; the leader's shadow report sums the rows of the shadow's key (server/control/rollout/shadow_reports.py).

Revision ID: 0017
Revises: 0016
"""

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "shadow_reports",
        sa.Column("reporter", sa.String(200), primary_key=True),
        sa.Column("endpoint", sa.String(200), primary_key=True),
        sa.Column("shadow", sa.String(300), primary_key=True),
        sa.Column("stats", sa.JSON, nullable=False),
        sa.Column("at", sa.Float, nullable=False),
    )
    with op.batch_alter_table("desired_state") as batch:
        batch.add_column(sa.Column("shadow", sa.JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("desired_state") as batch:
        batch.drop_column("shadow")
    op.drop_table("shadow_reports")
