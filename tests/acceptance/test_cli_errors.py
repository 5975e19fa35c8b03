"""Every way a user can misconfigure ``saga-engine`` ends the same way: exit status 2, exactly one
line on stderr starting with ``saga-engine: error:``, no traceback, and never a password."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from saga_engine import db
from saga_engine.testing.tansu import free_port
from sagas import order_fulfilment
from sagas.app import app as shop

SCRIPT = Path(sys.executable).with_name("saga-engine")
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "saga_engine.cli"]
REPO = Path(__file__).resolve().parents[2]
PASSWORD = "s3cret"
APP = "sagas.app:app"
ORDER = {
    "order_id": "order-1",
    "customer_id": "alice",
    "lines": [{"sku": "SKU-TEA", "quantity": 1}],
    "amount": 450,
}

#: Each command that opens a database, with the arguments it needs besides --db.
DB_COMMANDS = {
    "status": ["status"],
    "start": ["start", "order_fulfilment", "--app", APP, "--data", json.dumps(ORDER)],
    "worker": ["worker", "--app", APP],
    "relay": ["relay"],
    "cleanup": ["cleanup"],
    "outbox signals": ["outbox", "signals"],
    "outbox requeue": ["outbox", "requeue"],
}


def saga_engine(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*COMMAND, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output, output
    assert PASSWORD not in output, output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("saga-engine: error: "), result.stderr
    return lines[0]


def closed_port_url() -> str:
    """A PostgreSQL URL with a password, to a loopback port nothing listens on."""
    return f"postgresql+psycopg://postgres:{PASSWORD}@127.0.0.1:{free_port()}/shop"


def with_password(url: str) -> str:
    """``url`` with a password added; the test server trusts loopback, so it is ignored."""
    return sa.make_url(url).set(password=PASSWORD).render_as_string(hide_password=False)


@pytest.fixture
def shop_url(pg_url: str) -> Iterator[str]:
    """A PostgreSQL database with the engine's and the example shop's tables, by a URL with a
    password."""
    engine = db.create_engine(pg_url)
    try:
        shop.create_tables(engine)
        order_fulfilment.seed(engine, orders=1)
    finally:
        engine.dispose()
    yield with_password(pg_url)


# -- database URLs -----------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["status", "start", "worker"])
def test_bad_database_url(command: str) -> None:
    url = f"postgresql+psycopg://postgres:{PASSWORD}@127.0.0.1:notaport/shop"

    line = assert_one_line_error(saga_engine(*DB_COMMANDS[command], "--db", url))

    assert "database URL" in line


@pytest.mark.parametrize("url", ["not a url", "nosuchdriver+x://h/db"])
def test_unparsable_or_unsupported_database_url(url: str) -> None:
    line = assert_one_line_error(saga_engine("status", "--db", url))

    assert "URL" in line or "driver" in line


@pytest.mark.parametrize("command", ["status", "start", "worker", "relay", "outbox requeue"])
def test_unreachable_database_hides_the_password(command: str) -> None:
    line = assert_one_line_error(saga_engine(*DB_COMMANDS[command], "--db", closed_port_url()))

    assert "cannot reach database" in line and "postgres:***@127.0.0.1" in line


@pytest.mark.postgres
def test_unreachable_participant_database_hides_the_password(shop_url: str) -> None:
    participant_db = f"inventory={closed_port_url()}"

    result = saga_engine(
        "worker", "--app", APP, "--db", shop_url, "--participant-db", participant_db
    )

    assert "cannot reach database" in assert_one_line_error(result)


@pytest.mark.sqlite
@pytest.mark.parametrize("command", ["status", "worker"])
def test_database_without_the_schema(command: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'empty.sqlite3'}"

    line = assert_one_line_error(saga_engine(*DB_COMMANDS[command], "--db", url))

    assert "outbox_messages" in line and "db upgrade" in line


# -- the app -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "spec", "expected"),
    [
        ("worker", "nope.mod:app", "no module named 'nope'"),
        ("worker", "sagas.app:nothing", "not a saga_engine App"),
        ("worker", "sagas.app", "expected MODULE:OBJECT"),
        ("start", "nope.mod:app", "no module named 'nope'"),
        ("status", "sagas.app:nothing", "not a saga_engine App"),
    ],
)
def test_bad_app(command: str, spec: str, expected: str, tmp_path: Path) -> None:
    args = {
        "worker": ["worker", "--app", spec],
        "start": ["start", "order_fulfilment", "--app", spec, "--data", json.dumps(ORDER)],
        "status": ["status", "--app", spec],
    }[command]

    line = assert_one_line_error(saga_engine(*args, "--db", closed_port_url(), cwd=tmp_path))

    assert expected in line


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ("--batch-size", "batch_size and first_poll_batch must be at least 1"),
        ("--first-poll-batch", "batch_size and first_poll_batch must be at least 1"),
        ("--poll-interval", "poll_interval and ack_timeout must be positive"),
    ],
)
def test_relay_tuning_that_makes_no_sense(option: str, expected: str, tmp_path: Path) -> None:
    database = tmp_path / "never-created.sqlite3"
    result = saga_engine("relay", "--db", f"sqlite:///{database}", option, "0")

    assert expected in assert_one_line_error(result)
    assert not database.exists()  # refused before it opened anything


def test_unknown_saga_type() -> None:
    result = saga_engine("start", "no_such_saga", "--app", APP, "--data", "{}")

    line = assert_one_line_error(result)
    assert "unknown saga type 'no_such_saga'" in line and "order_fulfilment" in line


@pytest.mark.parametrize("data", ["{bad", '{"order_id": "x",'])
def test_invalid_data_json(data: str) -> None:
    result = saga_engine("start", "order_fulfilment", "--app", APP, "--data", data)

    assert "Invalid JSON" in assert_one_line_error(result)


@pytest.mark.parametrize(
    ("data", "where"),
    [
        ([], "data"),
        ({**ORDER, "amount": -5}, "amount"),
        ({**ORDER, "lines": [{"sku": "SKU-TEA"}]}, "lines.0.quantity"),
    ],
)
def test_data_of_the_wrong_schema(data: object, where: str) -> None:
    result = saga_engine(
        "start", "order_fulfilment", "--app", APP, "--data", json.dumps(data), "--db", "x://"
    )

    line = assert_one_line_error(result)
    assert line.startswith(f"saga-engine: error: --data is not valid OrderData: {where}: ")


@pytest.mark.postgres
def test_starting_the_same_order_twice(shop_url: str) -> None:
    args = [
        "start",
        "order_fulfilment",
        "--app",
        APP,
        "--data",
        json.dumps(ORDER),
        "--db",
        shop_url,
    ]
    first = saga_engine(*args)
    assert first.returncode == 0, first.stderr

    line = assert_one_line_error(saga_engine(*args))

    assert "conflicts" in line


# -- passwords in normal output ----------------------------------------------------------------


@pytest.mark.postgres
def test_status_never_shows_the_password(shop_url: str) -> None:
    started = saga_engine(
        "start", "order_fulfilment", "--app", APP, "--data", json.dumps(ORDER), "--db", shop_url
    )
    assert started.returncode == 0, started.stderr

    text = saga_engine("status", "--db", shop_url)
    as_json = saga_engine("status", "--app", APP, "--db", shop_url, "--json")

    for result in (text, as_json):
        assert result.returncode == 0, result.stderr
        assert PASSWORD not in result.stdout + result.stderr
    assert "postgres:***@127.0.0.1:5432" in text.stdout
    assert "order_fulfilment" in text.stdout
    report = json.loads(as_json.stdout.splitlines()[-1])
    assert report["sagas"] == {"order_fulfilment": {"reserve_inventory": 1}}


@pytest.mark.postgres
def test_worker_logs_never_show_the_password(shop_url: str, tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        worker = subprocess.Popen(
            [*COMMAND, "--log-level", "debug", "worker", "--app", APP, "--db", shop_url],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            # "worker started" is logged once the SIGTERM handler is in place.
            deadline = time.monotonic() + 30
            while "worker started" not in log.read_text() and time.monotonic() < deadline:
                assert worker.poll() is None, log.read_text()
                time.sleep(0.1)
            time.sleep(1.0)  # its loops and relays run, connected
            worker.send_signal(signal.SIGTERM)
            status = worker.wait(30)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()

    output = log.read_text()
    assert status == 0, output
    assert "worker started" in output and "postgres:***@" in output
    assert PASSWORD not in output
