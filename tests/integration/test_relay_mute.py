"""The outbox's mute on PostgreSQL: writers send no NOTIFY while a relay passes on its own timer.

The trigger and the relay's side (``saga_engine.outbox.pacing``) against the real server: the
NOTIFY falls silent exactly while the mute is held, a relay that lets go of it waits for the
writers that saw it, and a relay under load (a worker's or a standalone one) takes it and gives
it back when idle without leaving a row to its poll interval.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from saga_engine import schema
from saga_engine.outbox import OutboxWriter
from saga_engine.outbox.pacing import CoalescingWakeup, Mute, Pace
from saga_engine.outbox.relay import Relay, RelayConfig
from saga_engine.transport.sql import SqlTransport
from tests.integration.test_relay import _wait_for, delivered, envelope, make_engine, write

pytestmark = pytest.mark.postgres


def conninfo(url: str) -> str:
    return sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def notified(listener: psycopg.Connection[Any], timeout: float) -> bool:
    return any(True for _ in listener.notifies(timeout=timeout, stop_after=1))


def mutes_held(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.scalar(
                sa.text(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
                    "AND classid = :space AND mode = 'ExclusiveLock' "
                    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                ),
                {"space": schema.MUTE_LOCK_SPACE},
            )
            or 0
        )


def test_writers_send_no_notify_while_the_mute_is_held(pg_url: str, engines: list[object]) -> None:
    engine = make_engine(pg_url, engines)
    mute = Mute(conninfo(pg_url))
    with psycopg.connect(conninfo(pg_url), autocommit=True) as listener:
        listener.execute('LISTEN "saga_engine_outbox"')
        write(engine, [envelope("before")])
        assert notified(listener, 5.0)

        assert mute.on()
        try:
            assert mutes_held(engine) == 1
            write(engine, [envelope("muted")])
            assert not notified(listener, 0.5)
        finally:
            mute.off()
        write(engine, [envelope("after")])
        assert notified(listener, 5.0)
    mute.close()


def test_a_relay_letting_go_of_the_mute_waits_for_the_writers_that_saw_it(
    pg_url: str, engines: list[object]
) -> None:
    engine = make_engine(pg_url, engines)
    mute = Mute(conninfo(pg_url))
    try:
        assert mute.writers_done()  # no writer at all
        assert mute.on()
        with engine.connect() as writer:
            tx = writer.begin()
            write_in(writer, "open while muted")
            mute.off()
            assert not mute.writers_done()  # its commit, and its row, are still to come
            tx.commit()
        assert mute.writers_done()
        # The mute is free again: a writer that looks now will notify.
        assert mute.on()
    finally:
        mute.close()
    assert mutes_held(engine) == 0  # closing the connection let go of it


def write_in(conn: sa.Connection, key: str) -> None:
    OutboxWriter().add_many(conn, [envelope(key)])


def test_a_mute_whose_session_ends_lets_writers_notify_again(
    pg_url: str, engines: list[object]
) -> None:
    engine = make_engine(pg_url, engines)
    mute = Mute(conninfo(pg_url))
    assert mute.on()
    with engine.connect() as conn:
        killed = conn.scalar(
            sa.text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = 'saga-engine-mute' AND datname = current_database()"
            )
        )
    assert killed
    with psycopg.connect(conninfo(pg_url), autocommit=True) as listener:
        listener.execute('LISTEN "saga_engine_outbox"')
        write(engine, [envelope("after the kill")])
        assert notified(listener, 5.0)
    with pytest.raises(psycopg.OperationalError):
        mute.off()
    mute.close()


@pytest.mark.parametrize(
    ("interval", "pause"), [(0.03, 0.005), (0.0, 0.0)], ids=["worker relay", "standalone relay"]
)
def test_a_relay_under_load_mutes_then_listens_again_and_loses_no_time(
    pg_url: str, engines: list[object], interval: float, pause: float
) -> None:
    """Writes 300 messages, ``pause`` apart (a standalone relay's passes keep up with writes 5 ms
    apart, so those come back to back): the relay takes the mute and passes on its timer (a
    worker's: every 30 ms; a standalone relay's: one pass after another); once they stop it lets
    go, and a lone message written later is delivered by its NOTIFY, not by the poll interval of
    5 s."""
    engine = make_engine(pg_url, engines)
    relay = Relay.for_database(
        pg_url, SqlTransport(engine), RelayConfig(poll_interval=5.0), wake_interval=interval
    )
    engines.append(relay.engine)
    wakeup = relay.wakeup
    assert isinstance(wakeup, CoalescingWakeup)
    relay.start()
    seen_muted, burst_over = threading.Event(), threading.Event()

    def watch() -> None:
        while not burst_over.is_set():
            if mutes_held(engine):
                seen_muted.set()
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    try:
        _wait_for(lambda: wakeup.leads, 5)
        watcher.start()
        for i in range(300):
            write(engine, [envelope(f"burst-{i}")])
            time.sleep(pause)
        burst_over.set()
        watcher.join()
        ids = [m.message_id for m in write(engine, [envelope("last of the burst")])]
        # Well within the poll interval: letting go of the mute leaves no row behind.
        _wait_for(
            lambda: (
                delivered(engine, *ids) == 1
                and wakeup.pace is Pace.NOTIFIED
                and not mutes_held(engine)
            ),
            3,
        )

        time.sleep(0.3)
        lone = envelope("lone")
        started = time.perf_counter()
        write(engine, [lone])
        _wait_for(lambda: delivered(engine, lone.message_id), 4)
        latency = time.perf_counter() - started
    finally:
        burst_over.set()
        relay.stop()
    assert seen_muted.is_set()
    assert latency < 1.0, f"lone message took {latency:.3f} s: left to the poll interval"
    assert relay.stats.errors == 0
