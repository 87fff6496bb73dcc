"""Desired state across processes (issue 27): what every frontend worker applies, versioned per endpoint;
the control plane's leader lease; the arms' outcome counts each serving process reports to the leader.

``desired_state``: one row per endpoint — its live version and its traffic split (kind, arms, sticky key,
salt) — and ``generation``, taken from one counter over all endpoints, so that a watcher asks only for
the rows newer than the last generation it applied. ``control_lease``: the lease row for databases
without advisory locks (SQLite: holder, expiry), and, for both, the leader's address where frontends
carry writes. ``arm_reports``: per-process outcome counts of each split's arms since the last report.

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "desired_state",
        sa.Column("endpoint", sa.String(200), primary_key=True),
        sa.Column("generation", sa.BigInteger, nullable=False),
        sa.Column("live", sa.String(32), nullable=True),
        sa.Column("split", sa.JSON, nullable=True),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    op.create_index("ix_desired_state_generation", "desired_state", ["generation"])
    op.create_table(
        "control_lease",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("holder", sa.String(200), nullable=False),
        sa.Column("address", sa.String(200), nullable=False),
        sa.Column("expires_at", sa.Float, nullable=False),
        sa.Column("term", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "arm_reports",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("reporter", sa.String(200), nullable=False),
        sa.Column("endpoint", sa.String(200), nullable=False),
        sa.Column("arm", sa.String(200), nullable=False),
        sa.Column("outcomes", sa.JSON, nullable=False),
        sa.Column("at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("arm_reports")
    op.drop_table("control_lease")
    op.drop_index("ix_desired_state_generation", table_name="desired_state")
    op.drop_table("desired_state")
