"""Alembic environment of saga-engine's own migrations.

Run them through :mod:`saga_engine.migrate` (``saga-engine db upgrade``, or
``python -m saga_engine.migrate``), which configures Alembic in code and hands this script an open
connection in ``config.attributes["connection"]`` (or, for ``sql``, a URL in
``config.attributes["url"]`` to render the DDL offline).
"""

from __future__ import annotations

from alembic import context

from saga_engine import migrate

config = context.config


def run_offline() -> None:
    url = config.attributes["url"]
    context.configure(
        url=url,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        **migrate.context_options(url.get_backend_name()),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is None:
        raise RuntimeError("run saga-engine's migrations through saga_engine.migrate")
    context.configure(connection=connection, **migrate.context_options(connection.dialect.name))
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
