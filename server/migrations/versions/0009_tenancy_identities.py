"""mTLS: client-certificate identities (SPIFFE ID / SAN URI, or a canonical subject) bound to tenants.

A table an earlier build created with ``create_all`` is adopted, as 0003 does.

Revision ID: 0009
Revises: 0008 (composites and batches; before it 0007, endpoint scaling)
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if "tenancy_identities" in set(sa.inspect(op.get_bind()).get_table_names()):
        return  # created by the store's models before this revision (create_all): adopted
    op.create_table(
        "tenancy_identities",
        sa.Column("binding_id", sa.String(16), primary_key=True),
        sa.Column("identity", sa.String(1024), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("revoked_at", sa.Float, nullable=True),
    )
    op.create_index("ix_tenancy_identities_tenant", "tenancy_identities", ["tenant"])
    op.create_index("ix_tenancy_identities_identity", "tenancy_identities", ["identity"])


def downgrade() -> None:
    op.drop_index("ix_tenancy_identities_identity", table_name="tenancy_identities")
    op.drop_index("ix_tenancy_identities_tenant", table_name="tenancy_identities")
    op.drop_table("tenancy_identities")
