"""Usage records split their tokens: ``input_tokens`` (LLM prompt, embedding input) and
``output_tokens`` (LLM completion); ``tokens`` stays, their sum.

Rows written before this revision keep their ``tokens`` and read 0 for both new columns (which
of them an old total was is not known). A ``tenancy_usage`` an earlier build created with
``create_all`` may already have the columns: a column that is already there is adopted.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

COLUMNS = ("input_tokens", "output_tokens")


def _existing() -> set[str]:
    return {c["name"] for c in sa.inspect(op.get_bind()).get_columns("tenancy_usage")}


def upgrade() -> None:
    missing = [name for name in COLUMNS if name not in _existing()]
    if missing:
        with op.batch_alter_table("tenancy_usage") as batch:
            for name in missing:
                batch.add_column(sa.Column(name, sa.BigInteger, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("tenancy_usage") as batch:
        for name in reversed(COLUMNS):
            batch.drop_column(name)
