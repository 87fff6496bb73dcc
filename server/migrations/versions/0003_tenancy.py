"""Tenancy: tenants (plan, grants, quotas, admin), hashed API keys, usage records.

A database where an earlier build created these tables with ``create_all`` (before this
revision existed) keeps them: a table that is already there is adopted, not created again.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def _existing() -> set[str]:
    return set(sa.inspect(op.get_bind()).get_table_names())


def upgrade() -> None:
    existing = _existing()
    if "tenancy_tenants" not in existing:
        op.create_table(
            "tenancy_tenants",
            sa.Column("name", sa.String(128), primary_key=True),
            sa.Column("team", sa.String(128), nullable=False),
            sa.Column("plan", sa.String(32), nullable=False),
            sa.Column("models", sa.JSON, nullable=False),
            sa.Column("quota", sa.JSON, nullable=False),
            sa.Column("model_quotas", sa.JSON, nullable=False),
            sa.Column("admin", sa.Boolean, nullable=False),
            sa.Column("created_at", sa.Float, nullable=False),
        )
    if "tenancy_keys" not in existing:
        op.create_table(
            "tenancy_keys",
            sa.Column("key_id", sa.String(16), primary_key=True),
            sa.Column("key_hash", sa.String(64), nullable=False),
            sa.Column("tenant", sa.String(128), nullable=False),
            sa.Column("created_at", sa.Float, nullable=False),
            sa.Column("revoked_at", sa.Float, nullable=True),
            sa.Column("expires_at", sa.Float, nullable=True),
            sa.Column("rotated_to", sa.String(16), nullable=True),
            sa.UniqueConstraint("key_hash", name="uq_tenancy_keys_key_hash"),
        )
        op.create_index("ix_tenancy_keys_tenant", "tenancy_keys", ["tenant"])
    if "tenancy_usage" not in existing:
        op.create_table(
            "tenancy_usage",
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("ts", sa.Float, nullable=False),
            sa.Column("tenant", sa.String(128), nullable=False),
            sa.Column("team", sa.String(128), nullable=False),
            sa.Column("model", sa.String(256), nullable=False),
            sa.Column("version", sa.String(32), nullable=False),
            sa.Column("requests", sa.Integer, nullable=False),
            sa.Column("tokens", sa.BigInteger, nullable=False),
            sa.Column("compute_us", sa.BigInteger, nullable=False),
        )
        op.create_index("ix_tenancy_usage_ts", "tenancy_usage", ["ts"])


def downgrade() -> None:
    op.drop_index("ix_tenancy_usage_ts", table_name="tenancy_usage")
    op.drop_table("tenancy_usage")
    op.drop_index("ix_tenancy_keys_tenant", table_name="tenancy_keys")
    op.drop_table("tenancy_keys")
    op.drop_table("tenancy_tenants")
