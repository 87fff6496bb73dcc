"""A version's content digest: its artifact and its companions (an LLM's config and tokenizer) as one.

``model_versions.content_sha256`` is the sha256 of the artifact's digest with every companion's
name and digest (``server.control.registry.artifacts.content_digest``); without companions it is the
artifact's sha256. It replaces the artifact digest as what makes a version unique within its
model: the same weights with another tokenizer are another version. Existing rows are filled in.

Revision ID: 0016
Revises: 0015
"""

import hashlib

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def content_digest(artifact_sha256: str, companions: dict) -> str:
    """``server.control.registry.artifacts.content_digest`` as it was when this migration was
    written: a migration stays what it was when the code moves on
    (``tests/unit/test_registry_migrations.py`` checks that the two agree)."""
    if not companions:
        return artifact_sha256
    lines = [f"artifact {artifact_sha256}", *(f"{name} {companions[name]}" for name in sorted(companions))]
    return hashlib.sha256(("\n".join(lines) + "\n").encode()).hexdigest()


def upgrade() -> None:
    with op.batch_alter_table("model_versions") as batch:
        batch.add_column(sa.Column("content_sha256", sa.String(64), nullable=True))
    versions = sa.table("model_versions", sa.column("id", sa.Integer), sa.column("sha256", sa.String),
                        sa.column("companions", sa.JSON), sa.column("content_sha256", sa.String))  # fmt: skip
    bind = op.get_bind()
    for row in bind.execute(sa.select(versions.c.id, versions.c.sha256, versions.c.companions)).all():
        digest = content_digest(row.sha256, dict(row.companions or {}))
        bind.execute(versions.update().where(versions.c.id == row.id).values(content_sha256=digest))
    with op.batch_alter_table("model_versions") as batch:
        batch.alter_column("content_sha256", existing_type=sa.String(64), nullable=False)
        batch.drop_constraint("uq_model_versions_model_sha256", type_="unique")
        batch.create_unique_constraint("uq_model_versions_model_content", ["model_id", "content_sha256"])


def downgrade() -> None:
    with op.batch_alter_table("model_versions") as batch:
        batch.drop_constraint("uq_model_versions_model_content", type_="unique")
        batch.create_unique_constraint("uq_model_versions_model_sha256", ["model_id", "sha256"])
        batch.drop_column("content_sha256")
