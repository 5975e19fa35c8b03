"""Relays as real OS processes: four in parallel deliver everything once, keep per-key order under
random failures, stop cleanly on SIGTERM, and lose nothing when one is killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from saga_engine import db, schema
from saga_engine.messages import Envelope
from saga_engine.outbox import OutboxWriter
from saga_engine.outbox.relay import Relay, RelayConfig
from saga_engine.transport.sql import SqlTransport

t = schema.outbox
q = schema.transport_messages
SENT = schema.OutboxStatus.SENT
BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]

#: A relay process with a transport double in front of the SQL transport; prints "ready" once its
#: SIGTERM handler is installed and its published count when it stops.
RELAY_SCRIPT = r"""
import random, signal, sys, threading, time
from saga_engine import db
from saga_engine.outbox.relay import Relay, RelayConfig
from saga_engine.transport.base import PublishResult
from saga_engine.transport.sql import SqlTransport

url, mode, batch_size, claim, lease = sys.argv[1:6]
on_sent = sys.argv[6] if len(sys.argv) > 6 else "auto"


class SlowTransportDouble(SqlTransport):
    # Publishes, then waits before reporting: a kill lands between publish and mark.
    def publish(self, messages, timeout):
        results = super().publish(messages, timeout)
        time.sleep(0.5)
        return results


class FlakyTransportDouble(SqlTransport):
    # Loses ~10% before the broker and ~10% of the acks after it: ~20% reported failed.
    rng = random.Random()
    atomic_publish = False  # unlike the SQL transport it wraps, it fails messages one by one

    def publish(self, messages, timeout):
        kept = [m for m in messages if self.rng.random() >= 0.1]
        done = super().publish(kept, timeout) if kept else []
        ok = {r.message_id for r in done if r.ok and self.rng.random() >= 0.1}
        return [PublishResult(m.message_id, None if m.message_id in ok else "flaky (double)")
                for m in messages]


engine = db.create_engine(url, pool_size=2)
transport = {"slow": SlowTransportDouble, "flaky": FlakyTransportDouble}[mode](engine)
config = RelayConfig(batch_size=int(batch_size), poll_interval=0.05, backoff_base=0.005,
                     backoff_cap=0.05, max_retries=1000, claim=claim, lease_seconds=float(lease),
                     on_sent=on_sent)
relay = Relay.for_database(url, transport, config)
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
print("ready", flush=True)
relay.run(stop)
relay.engine.dispose()
engine.dispose()
print(relay.stats.published, flush=True)
"""


def envelope(key: str, n: int) -> Envelope:
    return Envelope(
        message_type="Tick", destination="ticks", partition_key=key, payload={"key": key, "n": n}
    )


def write(engine: sa.Engine, keys: int, per_key: int, per_tx: int = 100) -> dict[str, Envelope]:
    """``keys`` x ``per_key`` messages, interleaved across keys, ``per_tx`` per transaction."""
    messages = [envelope(f"k{i % keys}", i // keys) for i in range(keys * per_key)]
    writer = OutboxWriter()
    for start in range(0, len(messages), per_tx):
        with engine.begin() as conn:
            writer.add_many(conn, messages[start : start + per_tx])
    return {m.message_id: m for m in messages}


class Proc:
    """A child process whose output goes to files (no pipe to fill up), read on demand."""

    def __init__(self, args: list[str], tmp: Path, name: str) -> None:
        self.out, self.err = tmp / f"{name}.out", tmp / f"{name}.err"
        with self.out.open("wb") as out, self.err.open("wb") as err:
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            self.popen = subprocess.Popen(args, stdout=out, stderr=err, cwd=REPO, env=env)

    def output(self) -> str:
        return self.out.read_text()

    def errors(self) -> str:
        return self.err.read_text()


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


@contextmanager
def running(procs: list[Proc]) -> Iterator[list[Proc]]:
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.popen.poll() is None:
                proc.popen.kill()
            proc.popen.wait(10)


def stop_all(procs: list[Proc]) -> list[int]:
    for proc in procs:
        proc.popen.send_signal(signal.SIGTERM)
    return [proc.popen.wait(20) for proc in procs]


def sent(engine: sa.Engine) -> int:
    """Rows delivered: SENT in the outbox, or moved to the history (the default on_sent "auto"
    archives on PostgreSQL)."""
    with engine.connect() as conn:
        return sum(
            int(conn.scalar(sa.select(sa.func.count()).select_from(table).where(where)) or 0)
            for table, where in ((t, t.c.status == SENT), (schema.outbox_history, sa.true()))
        )


def unsent(engine: sa.Engine) -> int:
    """Rows still to deliver: neither SENT nor deleted."""
    with engine.connect() as conn:
        return int(conn.scalar(sa.select(sa.func.count()).select_from(t).where(t.c.status != SENT)))


def transported(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.scalars(sa.select(q.c.message_id).order_by(q.c.id)))


def assert_first_publications_in_key_order(
    delivered: list[str], messages: dict[str, Envelope]
) -> None:
    firsts: dict[str, list[int]] = defaultdict(list)
    for message_id in dict.fromkeys(delivered):
        message = messages[message_id]
        firsts[message.partition_key].append(message.payload["n"])
    assert all(ns == sorted(ns) for ns in firsts.values())


# -- 3. four relay processes, SIGTERM ----------------------------------------------------------

CASES = [
    pytest.param("pg_url", "auto", marks=pytest.mark.postgres, id="postgres-skip_locked"),
    pytest.param("mariadb_url", "skip_locked", marks=pytest.mark.mariadb, id="mariadb-skip_locked"),
    pytest.param("mariadb_url", "optimistic", marks=pytest.mark.mariadb, id="mariadb-optimistic"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("database", "claim"), CASES)
def test_four_relay_processes_deliver_every_message_once_and_stop_on_sigterm(
    request: pytest.FixtureRequest, tmp_path: Path, engines: list[object], database: str, claim: str
) -> None:
    url = request.getfixturevalue(database)
    engine = db.create_engine(url)
    engines.append(engine)
    command = [str(BIN / "saga-engine"), "--log-level", "info", "relay", "--db", url]
    command += ["--broker", "sql://", "--batch-size", "50", "--poll-interval", "0.1"]
    command += ["--claim", claim]
    procs = [Proc(command, tmp_path, f"relay{i}") for i in range(4)]
    with running(procs):
        for proc in procs:  # the SIGTERM handler is installed before this line is logged
            wait_for(lambda p=proc: "relay started" in p.errors(), 30, "relay start")
        started = time.monotonic()
        messages = write(engine, keys=600, per_key=5)
        wait_for(lambda: sent(engine) == len(messages), 90, "delivery")
        elapsed = time.monotonic() - started
        codes = stop_all(procs)

    assert codes == [0, 0, 0, 0], [p.errors()[-2000:] for p in procs]
    stats = [json.loads(p.output().strip().splitlines()[-1]) for p in procs]
    assert {s["relay"] for s in stats} == {"stopped"}
    published = [s["published"] for s in stats]
    print(f"{claim}: 3000 messages in {elapsed:.2f}s by 4 relays, published {published}")
    assert sum(published) == len(messages)
    assert sum(1 for n in published if n) >= 2  # they really shared the work
    delivered = transported(engine)
    assert len(delivered) == len(set(delivered)) == len(messages)  # no duplicate, none lost
    assert set(delivered) == set(messages)
    assert_first_publications_in_key_order(delivered, messages)


# -- 4. per-key order across processes with random failures ------------------------------------


@pytest.mark.slow
@pytest.mark.postgres
def test_per_key_order_holds_across_four_relay_processes_with_failures(
    pg_url: str, tmp_path: Path, engines: list[object]
) -> None:
    engine = db.create_engine(pg_url)
    engines.append(engine)
    command = [sys.executable, "-c", RELAY_SCRIPT, pg_url, "flaky", "20", "auto", "30"]
    procs = [Proc(command, tmp_path, f"flaky{i}") for i in range(4)]
    with running(procs):
        for proc in procs:
            wait_for(lambda p=proc: p.output().startswith("ready"), 30, "relay start")
        messages = write(engine, keys=150, per_key=6)
        wait_for(lambda: sent(engine) == len(messages), 90, "delivery")
        codes = stop_all(procs)

    assert codes == [0, 0, 0, 0], [p.errors()[-2000:] for p in procs]
    delivered = transported(engine)
    assert set(delivered) == set(messages)
    assert len(delivered) > len(messages)  # lost acks really caused re-sends
    # transport_messages ids follow the order in which publishes were acknowledged: a message's
    # first copy comes after the first copy of every earlier message of its key.
    assert_first_publications_in_key_order(delivered, messages)


# -- 5. SIGKILL mid-batch -----------------------------------------------------------------------

KILL_CASES = [
    pytest.param("pg_url", "auto", "mark", marks=pytest.mark.postgres, id="postgres-skip_locked"),
    pytest.param(
        "pg_url", "auto", "delete", marks=pytest.mark.postgres, id="postgres-skip_locked-delete"
    ),
    pytest.param(
        "pg_url", "auto", "archive", marks=pytest.mark.postgres, id="postgres-skip_locked-archive"
    ),
    pytest.param(
        "mariadb_url", "optimistic", "mark", marks=pytest.mark.mariadb, id="mariadb-optimistic"
    ),
    pytest.param(
        "mariadb_url",
        "optimistic",
        "archive",
        marks=pytest.mark.mariadb,
        id="mariadb-optimistic-archive",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("database", "claim", "on_sent"), KILL_CASES)
def test_a_relay_killed_mid_batch_loses_nothing(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    engines: list[object],
    database: str,
    claim: str,
    on_sent: str,
) -> None:
    url = request.getfixturevalue(database)
    engine = db.create_engine(url)
    engines.append(engine)
    batch = 50
    messages = write(engine, keys=400, per_key=1)
    command = [sys.executable, "-c", RELAY_SCRIPT, url, "slow", str(batch), claim, "1", on_sent]
    with running([Proc(command, tmp_path, "victim")]) as (victim,):
        # Two batches published: the first is marked, the second waits for its "ack".
        wait_for(lambda: len(transported(engine)) >= 2 * batch, 30, "two published batches")
        victim.popen.send_signal(signal.SIGKILL)
        assert victim.popen.wait(10) == -signal.SIGKILL
    marked_before = len(messages) - unsent(engine)  # SENT, archived, or deleted
    assert marked_before < len(transported(engine))  # published but never marked

    config = RelayConfig(batch_size=batch, claim=claim, on_sent=on_sent)
    relay = Relay(engine, SqlTransport(engine), config)
    # A lease the dead relay held runs out (1 s here); SKIP LOCKED rows are free at once.
    wait_for(lambda: relay.run_once().claimed == 0 and unsent(engine) == 0, 15, "redo")

    delivered = transported(engine)
    duplicates = len(delivered) - len(set(delivered))
    print(f"{claim}: marked {marked_before} before the kill, {duplicates} duplicates after it")
    assert set(delivered) == set(messages)  # every message arrived at least once
    assert duplicates <= batch  # at most the batch that was in flight
    if on_sent == "archive":  # each delivered row moved to the history once, none left behind
        with engine.connect() as conn:
            archived = list(conn.scalars(sa.select(schema.outbox_history.c.message_id)))
            assert conn.scalar(sa.select(sa.func.count()).select_from(t)) == 0
        assert sorted(archived) == sorted(messages)
