"""The name of the MySQL/MariaDB migration lock."""

from __future__ import annotations

from saga_engine import migrate


def test_the_lock_names_its_database() -> None:
    assert migrate.mysql_lock_name("orders") == "saga_engine_migrations.orders"
    assert migrate.mysql_lock_name("orders") != migrate.mysql_lock_name("payments")


def test_a_long_database_name_is_shortened_to_a_digest_within_the_limit() -> None:
    long_a, long_b = "a" * 64, "a" * 63 + "b"
    name_a, name_b = migrate.mysql_lock_name(long_a), migrate.mysql_lock_name(long_b)
    assert len(name_a) <= migrate.MYSQL_LOCK_NAME_MAX
    assert len(name_b) <= migrate.MYSQL_LOCK_NAME_MAX
    assert name_a != name_b
