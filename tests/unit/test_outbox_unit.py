"""Outbox pieces without servers: backoff, the payload limit, the wire form of an outbox row, claim
strategy choice, and the in-memory transport (a unit-test double) itself.

Rows are written to an in-memory SQLite database: the writer and ``to_outgoing`` work on real rows.
"""

from __future__ import annotations

import json
import random
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from saga_engine import clock, errors, schema
from saga_engine.messages import Envelope
from saga_engine.outbox import DEFAULT_MAX_PAYLOAD_BYTES, OutboxWriter
from saga_engine.outbox import claim as claims
from saga_engine.outbox.notify import Wakeup
from saga_engine.outbox.relay import ON_SENT, RelayConfig, to_outgoing
from saga_engine.transport.base import OutgoingMessage
from saga_engine.transport.memory import MemoryTransport

NOW = datetime(2030, 1, 1, 12, 0, 0)


class ClockDouble:
    def now(self) -> datetime:
        return NOW


def envelope(**payload: object) -> Envelope:
    return Envelope(
        message_type="OrderCreated",
        destination="orders.events",
        partition_key="o-1",
        aggregate_type="Order",
        aggregate_id="o-1",
        correlation_id="saga-1",
        causation_id="m-0",
        tenant_id="acme",
        headers={"traceparent": "00-abc-01"},
        payload=payload,
    )


def outbox_count(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(sa.select(sa.func.count()).select_from(schema.outbox)) or 0)


# -- backoff ------------------------------------------------------------------------------------


@pytest.mark.parametrize("retry", range(12))
def test_backoff_is_capped_exponential_within_the_jitter(retry: int) -> None:
    config = RelayConfig(backoff_base=0.5, backoff_cap=60.0, jitter=0.2)
    rng = random.Random(retry)
    expected = min(60.0, 0.5 * 2**retry)
    delays = [config.backoff(retry, rng) for _ in range(500)]
    assert all(expected * 0.8 <= d <= expected * 1.2 for d in delays)
    assert min(delays) < expected * 0.85 and max(delays) > expected * 1.15  # jitter is spread
    assert RelayConfig(backoff_base=0.5, backoff_cap=60.0, jitter=0).backoff(retry, rng) == expected


def test_backoff_survives_absurd_retry_counts() -> None:
    config = RelayConfig(backoff_base=1.0, backoff_cap=300.0, jitter=0)
    assert config.backoff(5000, random.Random(0)) == 300.0


@pytest.mark.parametrize(
    "bad",
    [
        {"batch_size": 0},
        {"first_poll_batch": 0},
        {"poll_interval": 0},
        {"ack_timeout": -1},
        {"max_retries": 0},
        {"on_sent": "keep"},
    ],
)
def test_relay_config_rejects_nonsense(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RelayConfig(**bad)  # type: ignore[arg-type]


def test_the_relay_commands_defaults_are_the_relays_own() -> None:
    # The parser spells the defaults out (importing the relay would slow every command's start).
    from saga_engine.cli import build_parser, relay_config

    assert relay_config(build_parser().parse_args(["relay"])) == RelayConfig()


@pytest.mark.parametrize("on_sent", ON_SENT)
def test_both_relay_commands_offer_every_on_sent_choice(on_sent: str) -> None:
    # The parsers spell the choices out (importing the relay would slow every command's start).
    from saga_engine.cli import build_parser

    for command in (["relay"], ["bench", "relay"], ["bench", "pass"]):
        args = build_parser().parse_args([*command, "--on-sent", on_sent])
        assert args.on_sent == on_sent


def test_the_worker_command_offers_every_role() -> None:
    from saga_engine.cli import WORKER_ROLES, build_parser
    from saga_engine.worker import ROLES

    assert ",".join(ROLES) == WORKER_ROLES
    assert build_parser().parse_args(["worker", "--app", "m:app"]).roles == ",".join(ROLES)


@pytest.mark.parametrize("command", ["cleanup", "worker"])
def test_the_cleanup_and_worker_commands_say_the_retentions_they_apply(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    # The parser spells the defaults out (importing the inbox would slow every command's start).
    from saga_engine.cli import Retention, build_parser
    from saga_engine.inbox import INBOX_RETENTION
    from saga_engine.worker import WorkerOptions

    argv = [command, "--app", "m:app"] if command == "worker" else [command]
    args = build_parser().parse_args(argv)
    assert (args.inbox_retention_days, args.saga_retention_days) == (None, None)  # the defaults
    worker = WorkerOptions(db_url="")
    assert Retention.from_args(args) == Retention(
        outbox=worker.retention,
        inbox=INBOX_RETENTION,
        sagas=None,
        dead_letters=None,
        history=worker.history_retention,
    )
    assert worker.history_retention == worker.retention  # delivered messages, wherever they are
    kept = Retention.from_args(build_parser().parse_args([*argv, "--keep-history"]))
    assert kept.history is None
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"inbox entries (default {INBOX_RETENTION / timedelta(days=1):g})" in help_text
    assert "sagas that ended (default: keep them)" in help_text
    days = worker.retention / timedelta(days=1)
    assert f"SENT outbox rows (default {days:g})" in help_text
    assert f"counted from their archiving (default {days:g})" in help_text


# -- the payload limit, at write time -----------------------------------------------------------


def test_payload_over_the_limit_is_refused_when_written(memory_db: sa.Engine) -> None:
    assert DEFAULT_MAX_PAYLOAD_BYTES == 1_048_576
    writer = OutboxWriter(max_payload_bytes=100)
    overhead = len(json.dumps({"x": ""}, separators=(",", ":")))
    with memory_db.begin() as conn:
        writer.add(conn, envelope(x="a" * (100 - overhead)))  # exactly at the limit
        with pytest.raises(errors.PayloadTooLarge, match="101 bytes, over the 100-byte limit"):
            writer.add(conn, envelope(x="a" * (101 - overhead)))
        # Bytes, not characters: 47 two-byte characters make 55 characters but 102 bytes.
        with pytest.raises(errors.PayloadTooLarge, match="102 bytes"):
            writer.add(conn, envelope(x="é" * 47))
        # One oversized message refuses the whole call: nothing of it reaches the table.
        with pytest.raises(errors.PayloadTooLarge):
            writer.add_many(conn, [envelope(x="ok"), envelope(x="a" * 200), envelope(x="ok")])
    assert outbox_count(memory_db) == 1


# -- an outbox row on the wire ------------------------------------------------------------------


def test_outbox_row_to_wire_and_back(memory_db: sa.Engine) -> None:
    original = envelope(order_id="o-1", note="Grüße, 订单", lines=[{"sku": "a", "n": 2}])
    with memory_db.begin() as conn:
        OutboxWriter(clock=ClockDouble()).add(conn, original)
        row = conn.execute(sa.select(*claims.ROW_COLUMNS)).one()

    outgoing = to_outgoing(row)
    decoded = Envelope.from_wire(outgoing.value)

    assert (outgoing.message_id, outgoing.destination, outgoing.partition_key) == (
        original.message_id,
        "orders.events",
        "o-1",
    )
    # Everything survives, but the timestamp: it is the outbox row's, in UTC.
    assert decoded == original.model_copy(update={"created_at": NOW.replace(tzinfo=UTC)})
    assert decoded.created_at.utcoffset() is not None


# -- claim strategy -----------------------------------------------------------------------------


def test_claim_strategy_choice(memory_db: sa.Engine) -> None:
    assert not claims.supports_skip_locked(memory_db)
    assert claims.strategy_for(memory_db).name == "optimistic"  # SQLite has no row locks
    assert claims.strategy_for(memory_db, "skip_locked").name == "skip_locked"
    with pytest.raises(ValueError, match="unknown claim strategy"):
        claims.strategy_for(memory_db, "magic")


def test_a_wakeup_wait_ends_soon_after_stop_even_with_a_long_timeout() -> None:
    """A SIGTERM handler only sets the stop event; a relay polling every 5 s must still stop."""
    wakeup, stop = Wakeup(None), threading.Event()
    timer = threading.Timer(0.05, stop.set)
    timer.start()
    started = time.monotonic()
    assert wakeup.wait(5.0, stop) is False
    assert time.monotonic() - started < 1.0
    timer.join()
    wakeup.notify()
    assert wakeup.wait(5.0) is True
    assert wakeup.wait(0.01) is False  # a wake-up is consumed by the wait it ends


def test_system_clock_is_naive_utc() -> None:
    now = clock.SYSTEM.now()
    assert now.tzinfo is None
    assert abs((datetime.now(UTC).replace(tzinfo=None) - now).total_seconds()) < 5


# -- MemoryTransport, the unit-test double ------------------------------------------------------


def message(n: int, channel: str = "a", key: str = "k") -> OutgoingMessage:
    return OutgoingMessage(f"m{n}", channel, key, f"v{n}".encode())


def test_memory_transport_publishes_and_fails_while_down() -> None:
    transport = MemoryTransport()
    results = transport.publish([message(1), message(2)], 1.0)
    assert [(r.message_id, r.ok) for r in results] == [("m1", True), ("m2", True)]
    transport.down = True
    down = transport.publish([message(3)], 1.0)
    assert [(r.message_id, r.ok, r.error) for r in down] == [
        ("m3", False, "memory transport is down")
    ]
    assert [m.message_id for m in transport.channels["a"]] == ["m1", "m2"]


def test_memory_consumer_positions_commit_release_and_groups() -> None:
    transport = MemoryTransport()
    transport.publish([message(n, "a" if n % 2 else "b") for n in range(1, 7)], 1.0)
    consumer = transport.consumer("billing", ["a", "b"])

    first = consumer.poll(4, 0.0)
    assert [d.value for d in first] == [b"v1", b"v3", b"v5", b"v2"]  # channel by channel
    assert (first[0].channel, first[0].partition_key) == ("a", "k")
    rest = consumer.poll(10, 0.0)
    assert [d.value for d in rest] == [b"v4", b"v6"]
    assert consumer.poll(10, 0.0) == []  # handed out, even though not committed

    consumer.commit(first[:2])
    consumer.release(first[2:3])  # v5 comes again
    assert [d.value for d in consumer.poll(10, 0.0)] == [b"v5"]

    again = transport.consumer("billing", ["a"])  # the group resumes after its commits
    assert [d.value for d in again.poll(10, 0.0)] == [b"v5"]
    other = transport.consumer("shipping", ["a"])  # another group reads from the start
    assert [d.value for d in other.poll(10, 0.0)] == [b"v1", b"v3", b"v5"]

    consumer.close()  # forgets what was handed out but not committed
    assert [d.value for d in consumer.poll(10, 0.0)] == [b"v5", b"v2", b"v4", b"v6"]
