"""Load signals of every serving process for the leader's autoscaler, and scaled-to-zero endpoints in the
desired state (issue 27).

``signal_reports``: one row per (reporting process, model) — its latest in-flight, queue, held,
request-rate and token-rate sample, and the desired-state generation it has applied — replaced at each
report (server/control/scaling/signal_reports.py).
``desired_state.wake_budget_s``: set while an endpoint is scaled to zero (its cold-start budget), so
every frontend holds its first request and asks the leader to wake it.

Revision ID: 0015
Revises: 0014
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "signal_reports",
        sa.Column("reporter", sa.String(200), primary_key=True),
        sa.Column("model", sa.String(200), primary_key=True),
        sa.Column("inflight", sa.Float, nullable=False),
        sa.Column("queue", sa.Float, nullable=False),
        sa.Column("held", sa.Float, nullable=False),
        sa.Column("qps", sa.Float, nullable=False),
        sa.Column("tokens_per_s", sa.Float, nullable=False),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("generation", sa.BigInteger, nullable=False, server_default="0"),
    )
    with op.batch_alter_table("desired_state") as batch:
        batch.add_column(sa.Column("wake_budget_s", sa.Float, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("desired_state") as batch:
        batch.drop_column("wake_budget_s")
    op.drop_table("signal_reports")
