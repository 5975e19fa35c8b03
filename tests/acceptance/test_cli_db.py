"""``saga-engine db upgrade`` as users run it: a real process, its exit status and its output."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from saga_engine import db, migrate, schema
from tests.conftest import unavailable
from tests.support import databases

SCRIPT = Path(sys.executable).with_name("saga-engine")
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "saga_engine.cli"]


def saga_engine(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*COMMAND, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("saga-engine: error: ")
    return lines[0]


@pytest.fixture(
    params=[
        pytest.param("sqlite", marks=pytest.mark.sqlite),
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("mariadb", marks=pytest.mark.mariadb),
    ]
)
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    reason = databases.server_error(request.param)
    if reason:
        unavailable(reason)
    with databases.fresh_database(request.param, tmp_path, create_schema=False) as url:
        yield url


def test_db_upgrade_creates_every_table(empty_url: str, tmp_path: Path) -> None:
    result = saga_engine("db", "upgrade", "--db", empty_url, cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    engine = db.create_engine(empty_url)
    try:
        assert set(schema.metadata.tables) <= set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()
    assert migrate.current(empty_url) == migrate.head()


@pytest.mark.sqlite
def test_db_upgrade_twice_succeeds_both_times(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'app.sqlite3'}"

    first = saga_engine("db", "upgrade", "--db", url, cwd=tmp_path)
    second = saga_engine("db", "upgrade", "--db", url, cwd=tmp_path)

    assert (first.returncode, second.returncode) == (0, 0), first.stderr + second.stderr
    assert first.stdout == second.stdout
    assert (tmp_path / "app.sqlite3").exists()


@pytest.mark.parametrize(
    "url", ["bogus://x", "not a url", "postgresql+psycopg://u:s3cret@127.0.0.1:notaport/x"]
)
def test_bad_url_is_one_line_and_exit_2(url: str, tmp_path: Path) -> None:
    result = saga_engine("db", "upgrade", "--db", url, cwd=tmp_path)

    line = assert_one_line_error(result)
    assert "URL" in line or "driver" in line
    assert "s3cret" not in result.stdout + result.stderr


def test_unreachable_database_hides_the_password(tmp_path: Path) -> None:
    url = "postgresql+psycopg://u:s3cret@127.0.0.1:1/x"

    result = saga_engine("db", "upgrade", "--db", url, cwd=tmp_path)

    line = assert_one_line_error(result)
    assert "s3cret" not in result.stdout + result.stderr
    assert "127.0.0.1" in line


@pytest.mark.sqlite
def test_unknown_revision_is_one_line_and_exit_2(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'app.sqlite3'}"

    result = saga_engine("db", "upgrade", "--db", url, "--revision", "9999", cwd=tmp_path)

    assert "9999" in assert_one_line_error(result)


@pytest.mark.sqlite
def test_database_created_by_create_all_is_adopted(tmp_path: Path) -> None:
    with databases.fresh_database("sqlite", tmp_path, create_schema=True) as url:
        result = saga_engine("db", "upgrade", "--db", url, cwd=tmp_path)

        assert result.returncode == 0, result.stderr
        assert migrate.current(url) == migrate.head()


@pytest.mark.sqlite
def test_partial_unversioned_database_is_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'app.sqlite3'}"
    engine = db.create_engine(url)
    try:
        schema.outbox.create(engine)
    finally:
        engine.dispose()

    line = assert_one_line_error(saga_engine("db", "upgrade", "--db", url, cwd=tmp_path))

    assert "outbox_messages" in line and "stamp" in line


@pytest.mark.sqlite
def test_migrate_module_reports_the_current_revision(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'app.sqlite3'}"
    assert saga_engine("db", "upgrade", "--db", url, cwd=tmp_path).returncode == 0

    result = subprocess.run(
        [sys.executable, "-m", "saga_engine.migrate", "current", "--db", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == migrate.head()
