"""Composite endpoints and batch jobs.

* ``composite_members``: each registered composite version's nodes and the member versions they
  pin (lineage; ``member_version_id`` is null for a member served but not registered).
* ``batch_files``: uploaded and produced files (``/v1/files``): the owner tenant, the blob in the
  artifact store (``blob``: its sha256), size, purpose.
* ``batch_jobs``: one row per ``/v1/batches`` job: state, timestamps, counts, the worker's lease.
* ``batch_rows``: one row per input line: its result is committed with its row id, once
  (``state`` pending -> done | failed | expired).
* ``tenancy_usage.traffic_class``: ``realtime`` or ``batch`` (a batch job's rows are metered
  apart); rows written before read ``realtime``.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "composite_members",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("composite_version_id", sa.Integer, sa.ForeignKey("model_versions.id", ondelete="CASCADE"), nullable=False),
        sa.Column("node", sa.String(64), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("version", sa.Integer, nullable=True),
        sa.Column("member_version_id", sa.Integer, sa.ForeignKey("model_versions.id", ondelete="RESTRICT"), nullable=True),
        sa.UniqueConstraint("composite_version_id", "node", name="uq_composite_members_node"),
    )
    op.create_index("ix_composite_members_composite", "composite_members", ["composite_version_id"])
    op.create_table(
        "batch_files",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("blob", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Integer, nullable=False),
        sa.Column("deleted", sa.Boolean, nullable=False, server_default=sa.false()),
    )
    op.create_index("ix_batch_files_tenant", "batch_files", ["tenant", "created_at"])
    op.create_table(
        "batch_jobs",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("team", sa.String(128), nullable=False, server_default=""),
        sa.Column("endpoint", sa.String(300), nullable=False),
        sa.Column("input_file_id", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("metadata", sa.JSON, nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("errors", sa.JSON, nullable=True),
        sa.Column("output_file_id", sa.String(64), nullable=True),
        sa.Column("error_file_id", sa.String(64), nullable=True),
        sa.Column("created_at", sa.Integer, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=False),
        *(sa.Column(f"{event}_at", sa.Integer, nullable=True) for event in ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")),
        sa.Column("total", sa.Integer, nullable=False, server_default="0"),
        sa.Column("completed", sa.Integer, nullable=False, server_default="0"),
        sa.Column("failed", sa.Integer, nullable=False, server_default="0"),
        sa.Column("lease_owner", sa.String(128), nullable=True),
        sa.Column("lease_until", sa.Float, nullable=True),
    )
    op.create_index("ix_batch_jobs_tenant", "batch_jobs", ["tenant", "created_at"])
    op.create_index("ix_batch_jobs_status", "batch_jobs", ["status"])
    op.create_table(
        "batch_rows",
        sa.Column("job_id", sa.String(64), sa.ForeignKey("batch_jobs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("row_index", sa.Integer, primary_key=True),
        sa.Column("custom_id", sa.String(512), nullable=False),
        sa.Column("body", sa.Text, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("status_code", sa.Integer, nullable=True),
        sa.Column("response", sa.Text, nullable=True),
        sa.UniqueConstraint("job_id", "custom_id", name="uq_batch_rows_custom_id"),
    )
    op.create_index("ix_batch_rows_state", "batch_rows", ["job_id", "state", "row_index"])
    if "traffic_class" not in {c["name"] for c in sa.inspect(op.get_bind()).get_columns("tenancy_usage")}:
        with op.batch_alter_table("tenancy_usage") as batch:  # absent unless an earlier build's create_all made it
            batch.add_column(sa.Column("traffic_class", sa.String(16), nullable=False, server_default="realtime"))


def downgrade() -> None:
    with op.batch_alter_table("tenancy_usage") as batch:
        batch.drop_column("traffic_class")
    op.drop_index("ix_batch_rows_state", table_name="batch_rows")
    op.drop_table("batch_rows")
    op.drop_index("ix_batch_jobs_status", table_name="batch_jobs")
    op.drop_index("ix_batch_jobs_tenant", table_name="batch_jobs")
    op.drop_table("batch_jobs")
    op.drop_index("ix_batch_files_tenant", table_name="batch_files")
    op.drop_table("batch_files")
    op.drop_index("ix_composite_members_composite", table_name="composite_members")
    op.drop_table("composite_members")
