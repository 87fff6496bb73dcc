"""Deployments (endpoint history) and optional Ed25519 artifact signatures with trusted keys.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("model_versions") as batch:
        batch.add_column(sa.Column("artifact_signature", sa.String(128), nullable=True))
        batch.add_column(sa.Column("signing_key_id", sa.String(64), nullable=True))
    op.create_table(
        "trusted_keys",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("team", sa.String(200), nullable=False),
        sa.Column("key_id", sa.String(64), nullable=False),
        sa.Column("public_key", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("team", "key_id", name="uq_trusted_keys_team_key"),
    )
    op.create_table(
        "team_policies",
        sa.Column("team", sa.String(200), primary_key=True),
        sa.Column("require_signed", sa.Boolean, nullable=False),
    )
    op.create_table(
        "deployments",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("endpoint", sa.String(200), nullable=False),
        sa.Column("model_version_id", sa.Integer, sa.ForeignKey("model_versions.id", ondelete="RESTRICT"), nullable=False),
        sa.Column("serving", sa.JSON, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("actor", sa.String(200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_deployments_endpoint", "deployments", ["endpoint"])


def downgrade() -> None:
    op.drop_index("ix_deployments_endpoint", table_name="deployments")
    op.drop_table("deployments")
    op.drop_table("team_policies")
    op.drop_table("trusted_keys")
    with op.batch_alter_table("model_versions") as batch:
        batch.drop_column("signing_key_id")
        batch.drop_column("artifact_signature")
