"""``saga-engine bench`` as users run it: functional smoke tests, never a timing assertion.

A tiny relay run through every phase (write, database ceiling, relay without broker, raw producer,
relay to Kafka, read-back) must end with one parseable JSON line in which nothing was lost or
duplicated; a small saga run at an offered rate must end every saga as planned. How fast either
went is the benchmark's business, not the test's.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

SCRIPT = Path(sys.executable).with_name("saga-engine")
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "saga_engine.cli"]

pytestmark = [pytest.mark.postgres, pytest.mark.kafka, pytest.mark.slow]


def bench(cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``saga-engine bench ARGS`` as a user runs it, its output captured."""
    return subprocess.run(
        [*COMMAND, "bench", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.parametrize(("on_sent", "rounds"), [("mark", 3), ("archive", 1), ("delete", 1)])
def test_bench_relay_json_reports_no_loss(
    pg_url: str, kafka_url: str, tmp_path: Path, on_sent: str, rounds: int
) -> None:
    # --log-acks: should anything go missing, the output says where the broker said it put it.
    sizes = ["--messages", "300", "--relays", "2", "--batch-size", "100", "--log-acks"]
    modes = ["--on-sent", on_sent, "--rounds", str(rounds)]
    result = bench(
        tmp_path, "relay", "--db", pg_url, "--broker", kafka_url, *sizes, *modes, "--json"
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["bench"] == "relay"
    assert figures["on_sent"] == on_sent
    assert figures["acked_where_read"] == 300  # every ack's offset holds its message
    assert figures["messages"] == 300
    assert figures["lost"] == 0
    assert figures["duplicates"] == 0
    assert figures["delivered"] == 300
    assert figures["order_violations"] == 0
    # the ceiling and the relay, alternated; every round read back
    assert len(figures["rounds"]) == rounds
    assert all(r["lost"] == r["duplicates"] == 0 and r["relay"] > 0 for r in figures["rounds"])
    for rate in ("db_claim_mark_rate", "null_relay_rate", "raw_producer_rate", "relay_rate"):
        assert figures[rate] > 0, rate
    # the printed ratio is the median of the rounds' own, each under its round's name
    ratios = [figures[f"round_{i}_ratio"] for i in range(1, rounds + 1)]
    assert ratios == pytest.approx([r["relay"] / r["raw"] for r in figures["rounds"]], abs=1e-3)
    assert figures["relay_vs_raw_producer"] == pytest.approx(statistics.median(ratios), abs=1e-3)
    assert set(figures["targets"]) == {"relay_ratio", "lost", "duplicates"}


def test_bench_rejects_a_broker_it_cannot_measure(pg_url: str, tmp_path: Path) -> None:
    result = bench(tmp_path, "relay", "--db", pg_url, "--broker", "sql://", "--messages", "10")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().startswith("saga-engine: error: ")


def small_saga_run(
    cwd: Path, db_url: str, kafka_url: str, *options: str
) -> tuple[dict[str, Any], str]:
    """``bench saga`` of 20 sagas on one worker with ``options``: its JSON figures and its whole
    output, once it exited 0."""
    sizes = ["--sagas", "20", "--workers", "1"]
    result = bench(cwd, "saga", "--db", db_url, "--broker", kafka_url, *sizes, *options, "--json")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    figures: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return figures, result.stdout


def test_bench_saga_at_an_offered_rate_ends_every_saga(
    pg_url: str, kafka_url: str, tmp_path: Path
) -> None:
    figures, _ = small_saga_run(tmp_path, pg_url, kafka_url, "--rate", "10")
    assert figures["offered_rate"] == 10
    assert figures["placers"] == 1  # a schedule is kept by one session
    assert figures["completed"] + figures["compensated"] == 20
    assert figures["compensated"] == 2  # one order in ten is declined at payment
    assert figures["unfinished"] == figures["failed"] == figures["invariant_violations"] == 0
    # 20 orders at 10/s take about 2 s to place: the sagas cannot have ended sooner
    assert figures["elapsed_s"] >= 1.9


def test_bench_saga_outline_runs_the_peers_four_steps_through_the_engine(
    pg_url: str, kafka_url: str, tmp_path: Path
) -> None:
    setup = "ALTER TABLE saga_instances SET (fillfactor = 80)"  # how an experiment is tried
    # Two workers in the default layout: one runs the orchestrating roles, one the participants,
    # so every saga's commands and replies cross from one process to the other.
    figures, output = small_saga_run(
        tmp_path, pg_url, kafka_url, "--saga", "outline", "--workers", "2", "--setup-sql", setup
    )
    assert f"setup SQL: {setup}" in output
    assert figures["saga"] == "sagas.order_outline"
    assert (figures["workers"], figures["layout"]) == (2, "services")
    assert figures["placers"] == 8  # back to back: the orders are placed from 8 sessions
    assert (figures["completed"], figures["compensated"]) == (18, 2)
    assert figures["unfinished"] == figures["failed"] == figures["invariant_violations"] == 0
    # A completed saga sends two commands and gets two replies; a declined one also releases.
    assert figures["messages_per_saga"] == (18 * 4 + 2 * 6) / 20
    # Both processes' CPU is counted: the workers' and the bench's own, placing the orders.
    assert figures["worker_cpu_ms_per_saga"] > 0
    assert figures["placing_cpu_ms_per_saga"] > 0
    # The machine's CPU holds theirs and more: the database's and the broker's, which this run
    # did not start (so it cannot name its CPU, and counts it in the rest).
    assert "broker_cpu_ms_per_saga" not in figures
    assert figures["other_cpu_ms_per_saga"] > 0
    assert 0 < figures["machine_busy"] <= 100


@pytest.mark.parametrize("command", ["relay", "saga", "latency"])
def test_bench_setup_sql_the_database_refuses_is_a_one_line_error(
    pg_url: str, kafka_url: str, tmp_path: Path, command: str
) -> None:
    """The statement runs in the scratch database, whose tables are made by then: a column they
    lack is the database's answer, reported without a traceback."""
    sizes = {"relay": ["--messages", "10"], "saga": ["--sagas", "1"], "latency": ["--seconds", "1"]}
    statement = "SELECT no_such_column FROM outbox_messages"
    result = bench(
        tmp_path,
        command,
        *("--db", pg_url, "--broker", kafka_url, *sizes[command], "--setup-sql", statement),
    )
    assert result.returncode == 2, result.stdout + result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"saga-engine: error: --setup-sql {statement!r} failed: ")
    assert "no_such_column" in line


@pytest.mark.parametrize(
    ("options", "error"),
    [
        (["--rate", "0"], "--rate must be positive"),
        (["--placers", "0"], "--sagas, --workers, --peer-sagas and --placers must be >= 1"),
        (
            ["--rate", "10", "--peer", "temporal"],
            "--peer compares throughput, --rate measures latency at a load: choose one",
        ),
    ],
)
def test_bench_saga_refuses_a_rate_it_cannot_measure(
    pg_url: str, tmp_path: Path, options: list[str], error: str
) -> None:
    result = bench(tmp_path, "saga", "--db", pg_url, *options)
    assert result.returncode == 2
    assert result.stderr.strip() == f"saga-engine: error: {error}"


def test_bench_latency_delivers_every_message_in_both_modes(
    pg_url: str, kafka_url: str, tmp_path: Path
) -> None:
    sizes = ["--rate", "200", "--seconds", "1", "--writers", "1", "--threads", "2"]
    fast = ["--poll-interval", "0.2", "--overhead-samples", "20"]
    result = bench(
        tmp_path, "latency", "--db", pg_url, "--broker", kafka_url, *sizes, *fast, "--json"
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["bench"] == "latency"
    assert figures["overhead_samples"] == 20
    for mode in ("notify", "polling"):
        assert figures[f"{mode}_messages"] == 200  # 1 writer, 2 threads, 200 msg/s for 1 s
        assert figures[f"{mode}_not_sent"] == 0
        passes = figures[f"{mode}_relay_passes"]
        assert 1 <= passes <= 200
        assert figures[f"{mode}_messages_per_pass"] * passes == pytest.approx(200, rel=0.01)
        assert figures[f"{mode}_relay_cpu_ms_per_message"] > 0
        assert figures[f"{mode}_writer_cpu_ms_per_message"] > 0
        split = ("writer", "relay", "other")  # the broker is the caller's (--broker kafka://)
        assert f"{mode}_broker_cpu_ms_per_message" not in figures
        assert sum(figures[f"{mode}_{who}_cpu_ms_per_message"] for who in split) == pytest.approx(
            figures[f"{mode}_machine_cpu_ms_per_message"], abs=0.002
        )
        assert (
            0 < figures[f"{mode}_p50_ms"] <= figures[f"{mode}_p99_ms"] <= figures[f"{mode}_max_ms"]
        )
    # polling every 0.2 s with 1 s of writes: a handful of passes, each with many messages
    assert figures["polling_relay_passes"] < figures["notify_relay_passes"]
    targets = figures["targets"]
    assert set(targets) == {
        "notify_p50",
        "notify_p99",
        "polling_p99",
        "write_overhead",
        "offered_rate",
    }
    # 200 commits on a schedule of 200/s, the first at 0 s and the last at about 0.995 s
    lowest = min(figures["notify_achieved_rate"], figures["polling_achieved_rate"])
    assert targets["offered_rate"]["met"] is (lowest >= 0.99 * 200)


def test_bench_pass_times_every_step_of_each_size(
    pg_url: str, kafka_url: str, tmp_path: Path
) -> None:
    sizes = ["--rows", "1,20", "--passes", "5"]
    result = bench(tmp_path, "pass", "--db", pg_url, "--broker", kafka_url, *sizes, "--json")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["bench"] == "pass"
    assert figures["passes"] == 5
    for rows in (1, 20):
        steps = [figures[f"rows_{rows}_{step}_ms"] for step in ("claim", "publish", "mark")]
        assert all(step > 0 for step in steps)
        assert figures[f"rows_{rows}_guard_ms"] == 0  # on PostgreSQL the claim carries the guard
        assert sum(steps) < figures[f"rows_{rows}_pass_ms"] <= figures[f"rows_{rows}_pass_p99_ms"]
        cpu = figures[f"rows_{rows}_cpu_ms"]
        assert figures[f"rows_{rows}_cpu_ms_per_message"] == pytest.approx(cpu / rows, rel=0.01)
    assert figures["targets"] == {}  # a profile, not a target


def test_bench_pass_refuses_a_size_larger_than_a_batch(pg_url: str, tmp_path: Path) -> None:
    result = bench(tmp_path, "pass", "--db", pg_url, "--rows", "1,501")
    assert result.returncode == 2
    assert "--rows: sizes from 1 to 500" in result.stderr


def test_a_run_with_unfinished_sagas_says_where_each_stopped(pg_url: str) -> None:
    """The scratch database is dropped after a run, so what a stuck saga's messages did is printed
    first: here a command its participant received (participants record the command id in their
    inbox), and one that was sent and never reached a consumer's inbox."""
    from saga_engine import db, inbox, schema, store
    from saga_engine.bench.saga import unfinished_sagas
    from saga_engine.clock import SYSTEM
    from saga_engine.messages import Envelope
    from saga_engine.outbox import OutboxWriter

    def command(message_type: str) -> Envelope:
        return Envelope(
            message_type=message_type,
            destination="stock",
            partition_key="s-stuck",
            aggregate_id="s-stuck",
            headers={"command_id": f"cmd-{message_type}"},
        )

    received, lost = command("Reserve"), command("Release")
    engine = db.create_engine(pg_url)
    try:
        with engine.begin() as conn:
            for saga_id in ("s-stuck", "s-done"):
                saga = store.SagaInstance(
                    id=saga_id, saga_type="t", definition_version=1, state="reserve", data={}
                )
                store.insert(conn, saga, SYSTEM.now())
            sagas = schema.saga_instances
            conn.execute(
                sa.update(sagas).where(sagas.c.id == "s-done").values(ended_at=SYSTEM.now())
            )
            OutboxWriter().add_many(conn, [received, lost])
            sent = {"status": schema.OutboxStatus.SENT, "sent_at": SYSTEM.now()}
            conn.execute(sa.update(schema.outbox).values(**sent))
            assert inbox.Inbox().first_time(conn, "stock", "cmd-Reserve")

        lines = unfinished_sagas(engine, ["s-stuck", "s-done"])
    finally:
        engine.dispose()

    assert lines[0].startswith("saga s-stuck: reserve, attempt 0")
    assert len(lines) == 3  # the ended saga is left out
    assert f"outbox_messages Reserve {received.message_id}: status 1" in lines[1]
    assert lines[1].endswith("in the inbox of stock")
    assert f"outbox_messages Release {lost.message_id}: status 1" in lines[2]
    assert lines[2].endswith("in the inbox of no consumer")
