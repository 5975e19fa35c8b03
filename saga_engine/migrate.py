"""Schema creation and upgrades (Alembic migrations packaged in ``saga_engine/migrations``)."""

from __future__ import annotations

from saga_engine import db, schema


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the database at ``url`` to ``revision``."""
    engine = db.create_engine(url)
    try:
        db.check_connection(engine)
        schema.metadata.create_all(engine)
    finally:
        engine.dispose()
