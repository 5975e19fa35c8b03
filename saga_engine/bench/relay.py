"""``saga-engine bench relay``: outbox -> Kafka throughput, beside its two ceilings, in one run.

1. Write N messages through ``OutboxWriter.add_many`` in transactions of ``--per-transaction``.
2. Database ceiling: K processes claim batches with ``FOR UPDATE SKIP LOCKED`` and mark them SENT
   (or archive or delete them, as ``--on-sent`` says), nothing else (no broker, no order guard, no
   message building). The rows are then reset.
3. The engine's relay with a transport that acknowledges at once: the relay's own cost without a
   broker. Reset again.
4. Broker ceiling: kafka-python producing the same N messages (same keys and bytes) straight to
   Kafka with acks=all, from K processes and from one.
5. The engine's relay (``Relay``, as ``saga-engine relay`` runs it) in K processes to Kafka; then a
   consumer reads the topic back and counts every message id: delivered, lost, duplicated, and
   whether each key's messages arrived in order.

Steps 4 and 5 make one round, repeated ``--rounds`` times (each on reset rows, to a topic of its
own). On a shared machine either rate moves by tens of percent from one run to the next, so the
ratio printed is the median of the rounds' ratios, each taken from two runs back to back, the
producer first in one round and the relay first in the next; lost, duplicated and reordered
messages are summed over all rounds.

Each phase starts its K processes first and lets them go together once connected and warm, so a
rate is N / (time of the last acknowledgement - go); for the relays that is when the last pass
committed its marks, as each relay process notes it. Between phases the outbox is emptied and the
same N rows (kept in a copy, ``bench_outbox_copy``) are put back as they were written, so every
phase works on the same table of the same N rows, whether the relays mark the rows SENT, archive or
delete them (``--on-sent``).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import math
import shutil
import statistics
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Engine

from saga_engine import errors, schema
from saga_engine.bench import env
from saga_engine.bench.procs import Phase, Result
from saga_engine.bench.report import Report, percentile
from saga_engine.outbox.relay import ON_SENT, on_sent_for, to_outgoing

t = schema.outbox
TARGET_RATIO = 0.85
#: The rows as written, put back before every phase.
COPY = "bench_outbox_copy"
#: What the database ceiling does with a claimed batch, by ``--on-sent``.
_SETTLED = {"mark": "mark SENT", "archive": "move to outbox_history", "delete": "delete"}


@dataclasses.dataclass
class Options:
    db: str
    broker: str = env.TANSU
    #: Long enough for both sides to reach their steady rate (see docs/benchmarks.md, Method).
    messages: int = 100_000
    relays: int = 2
    batch_size: int = 500
    per_transaction: int = 10
    per_key: int = 1
    payload_bytes: int = 200
    partitions: int = 8
    timeout: float = 300.0
    keep_db: bool = False
    profile: str | None = None
    #: Times the broker ceiling and the relay run, alternately: the ratio is their median.
    rounds: int = 5
    #: The relays log every acknowledged record batch (its offsets), so that a loss can be traced
    #: to where the broker said the messages went. Costs relay CPU: off for measuring.
    log_acks: bool = False
    #: Statements run in the scratch database after writing (e.g. to try an index).
    setup_sql: tuple[str, ...] = ()
    #: ``RelayConfig.on_sent`` of the relays, and what the database ceiling does with its rows.
    on_sent: str = "auto"

    def __post_init__(self) -> None:
        if min(self.messages, self.relays, self.batch_size, self.per_transaction) < 1:
            raise errors.ConfigurationError("--messages, --relays, --batch-size must be >= 1")
        if not 1 <= self.rounds <= 9:
            raise errors.ConfigurationError("--rounds must be between 1 and 9")
        if self.on_sent not in ON_SENT:
            raise errors.ConfigurationError(f"--on-sent must be one of {', '.join(ON_SENT)}")
        if self.per_key < 1 or self.partitions < 1:
            raise errors.ConfigurationError("--per-key and --partitions must be >= 1")


@dataclasses.dataclass
class PhaseRun:
    t0: datetime
    results: list[Result]
    busy: float
    broker_cpu: float


def run(options: Options, report: Report) -> bool:
    """Run every phase; True when nothing was lost, duplicated or reordered."""
    with env.world(options.db, options.broker, keep_db=options.keep_db) as (url, engine, broker):
        # "auto" decided once for this database, so every phase settles its rows the same way.
        options = dataclasses.replace(options, on_sent=on_sent_for(engine, options.on_sent))
        bench = Bench(options, report, url, engine, broker)
        try:
            return bench.run()
        finally:
            shutil.rmtree(bench.ack_dir, ignore_errors=True)


class Bench:
    def __init__(
        self, options: Options, report: Report, url: str, engine: Engine, broker: env.Broker
    ) -> None:
        self.o = options
        self.report = report
        self.url = url
        self.engine = engine
        self.broker = broker
        run_id = uuid.uuid4().hex[:8]
        #: One topic per round (names of one length: every round's messages have the same bytes).
        self.topics = [f"bench.relay.{run_id}.r{i}" for i in range(options.rounds)]
        self.topic = self.topics[0]
        self.raw_topic = f"bench.relay.{run_id}.raw"
        #: The relays' acknowledgement logs, read only to explain a loss.
        self.ack_dir = Path(tempfile.mkdtemp(prefix="saga-bench-acks-"))

    def run(self) -> bool:
        o, report = self.o, self.report
        self._create_topics()
        report.section(f"relay benchmark: {o.messages:,} messages, {o.relays} relay process(es)")
        report.figure("messages", o.messages, "messages")
        report.figure("relays", o.relays, "relay processes (K)")
        report.figure("batch_size", o.batch_size, "relay batch size")
        report.figure("partitions", o.partitions, "topic partitions")
        report.figure("messages_per_key", o.per_key, "consecutive messages per key")
        report.figure("kafka_crc32c", _crc32c(), "kafka-python's CRC32C")
        report.figure("on_sent", o.on_sent, "acknowledged rows are (on_sent)")
        self._write()
        ceiling_db = self._db_ceiling()
        self._reset()
        null_relay = self._relay_phase("null_relay", broker=None)
        rounds = [self._round(i) for i in range(o.rounds)]
        healthy = self._totals(rounds)
        relay, raw, raw_one = (statistics.median(r[k] for r in rounds) for k in _ROUND_RATES)
        report.section(f"ratios (medians of {o.rounds} round(s))")
        report.figure("relay_rate", relay, "relay rate", "msg/s")
        report.figure(
            "raw_producer_rate", raw, f"raw producer rate ({o.relays} processes)", "msg/s"
        )
        report.figure("raw_producer_1_rate", raw_one, "raw producer rate (1 process)", "msg/s")
        ratio = report.figure(
            "relay_vs_raw_producer",
            statistics.median(r["relay"] / r["raw"] for r in rounds),
            f"relay / raw producer ({o.relays} processes each)",
            "x",
        )
        report.figure(
            "relay_vs_raw_producer_1",
            statistics.median(r["relay"] / r["raw_one"] for r in rounds),
            "relay / raw producer (1 process)",
            "x",
        )
        report.ratio("relay_vs_db_ceiling", relay, ceiling_db, "relay / database claim-and-mark")
        report.ratio("relay_vs_null_relay", relay, null_relay, "relay / relay without broker")
        report.ratio(
            "null_relay_vs_db_ceiling", null_relay, ceiling_db, "relay without broker / database"
        )
        report.target("relay_ratio", ratio >= TARGET_RATIO, f"relay >= {TARGET_RATIO} x raw")
        report.target("lost", report.data["lost"] == 0, "lost == 0")
        report.target("duplicates", report.data["duplicates"] == 0, "duplicates == 0")
        return healthy

    # -- phases -------------------------------------------------------------------------------

    def _round(self, index: int) -> dict[str, Any]:
        """The broker ceiling and the relay back to back, on freshly reset rows bound for this
        round's topic, then the one-process producer; the round's rates and what its read-back
        found.

        The two phases of the ratio run one after the other, in turns first: the host's speed
        drifts by tens of percent within a minute, and a drift then favours neither side.
        """
        o, topic = self.o, self.topics[index]
        self.report.section(f"round {index + 1} of {o.rounds}: topic {topic}")
        self._reset(destination=topic)
        if index % 2 == 0:
            raw = self._raw_producer("raw_producer", o.relays)
            relay = self._relay_phase("relay", broker=self.broker.url, topic=topic)
        else:
            relay = self._relay_phase("relay", broker=self.broker.url, topic=topic)
            raw = self._raw_producer("raw_producer", o.relays)
        raw_one = self._raw_producer("raw_producer_1", 1) if o.relays > 1 else raw
        lost, duplicates, order_violations = self._verify(topic)
        # Named per round: one key for all would leave the last round's in the JSON, easily
        # mistaken for the ratio (the median, ``relay_vs_raw_producer``).
        self.report.ratio(
            f"round_{index + 1}_ratio", relay, raw, "this round: relay / raw producer"
        )
        return {
            "relay": relay,
            "raw": raw,
            "raw_one": raw_one,
            "lost": lost,
            "duplicates": duplicates,
            "order_violations": order_violations,
        }

    def _totals(self, rounds: list[dict[str, Any]]) -> bool:
        """Lost, duplicated and reordered messages over all rounds; True when all are zero."""
        report = self.report
        report.section(f"read-back over {len(rounds)} round(s)")
        report.data["rounds"] = rounds
        totals = {
            key: report.figure(key, sum(r[key] for r in rounds), label)
            for key, label in (
                ("lost", "lost"),
                ("duplicates", "duplicates"),
                ("order_violations", "per-key order violations"),
            )
        }
        return not any(totals.values())

    def _create_topics(self) -> None:
        from saga_engine.transport.kafka import KafkaTransport

        kafka = KafkaTransport([self.broker.bootstrap], partitions=self.o.partitions)
        try:
            kafka.ensure_channels([*self.topics, self.raw_topic])
        finally:
            kafka.close()

    def _write(self) -> None:
        o, report = self.o, self.report
        report.section(f"1. write through OutboxWriter.add_many ({o.relays} process(es))")
        spec = {
            "db": self.url,
            "topic": self.topic,
            "messages": o.messages,
            "children": o.relays,
            "per_transaction": o.per_transaction,
            "per_key": o.per_key,
            "payload_bytes": o.payload_bytes,
        }
        run = self._phase("bulk_writer", [spec] * o.relays)
        end = max(datetime.fromisoformat(r["end"]) for r in run.results)
        durations = [d for r in run.results for d in r["durations"]]
        report.figure("per_transaction", o.per_transaction, "messages per transaction")
        report.figure("write_rate", o.messages / _seconds(end - run.t0), "written", "msg/s")
        report.figure("write_tx_p50_ms", 1000 * percentile(durations, 0.5), "transaction p50", "ms")
        report.figure(
            "write_tx_p99_ms", 1000 * percentile(durations, 0.99), "transaction p99", "ms"
        )
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(*_row_columns()).order_by(t.c.id).limit(1000)).all()
        sizes = [len(to_outgoing(row).value) for row in rows]
        report.figure("wire_bytes", sum(sizes) / len(sizes), "mean message size on the wire", "B")
        env.run_setup_sql(self.engine, o.setup_sql, report.note)
        with self.engine.begin() as conn:
            conn.execute(sa.text(f"CREATE TABLE {COPY} AS SELECT * FROM {t.name}"))
        env.vacuum(self.engine, t.name)

    def _db_ceiling(self) -> float:
        done = _SETTLED[self.o.on_sent]
        self.report.section(f"2. database ceiling: SKIP LOCKED claim + {done}, no broker")
        spec = {"db": self.url, "batch_size": self.o.batch_size, "on_sent": self.o.on_sent}
        run = self._phase("claim_mark", [spec] * self.o.relays)
        return self._rates_from_passes("db_claim_mark", run)

    def _relay_phase(self, key: str, broker: str | None, topic: str | None = None) -> float:
        o = self.o
        title = "the engine's relay to Kafka" if broker else "the engine's relay, null transport"
        self.report.section(f"{'5' if broker else '3'}. {title}")
        specs = [
            {
                "db": self.url,
                "broker": broker,
                "batch_size": o.batch_size,
                "poll_interval": 0.5,
                "on_sent": o.on_sent,
                "warmup_topic": topic if broker else None,
                "ack_log": str(self.ack_dir / f"acks-{i}.jsonl") if broker and o.log_acks else None,
                "profile": f"{o.profile}/{key}-{i}.txt" if o.profile else None,
            }
            for i in range(o.relays)
        ]
        run = self._phase("relay", specs)
        rate = self._rates_from_passes(key, run)
        published = sum(r["published"] for r in run.results)
        batches = sum(r["batches"] for r in run.results) or 1
        self.report.figure(f"{key}_mean_batch", published / batches, "mean rows per batch")
        self.report.figure(
            f"{key}_errors", sum(r["errors"] + r["retried"] for r in run.results), "failed passes"
        )
        return rate

    def _raw_producer(self, key: str, children: int) -> float:
        self.report.section(f"4. broker ceiling: kafka-python, acks=all, {children} process(es)")
        spec = {
            "db": self.url,
            "children": children,
            "topic": self.raw_topic,
            "bootstrap": self.broker.bootstrap,
            "source": COPY,
        }
        run = self._phase("producer", [spec] * children)
        end = max(datetime.fromisoformat(r["end"]) for r in run.results)
        failed = sum(r["failed"] for r in run.results)
        rate = self.report.figure(
            f"{key}_rate", self.o.messages / _seconds(end - run.t0), "rate", "msg/s"
        )
        self.report.figure(f"{key}_failed", failed, "not acknowledged")
        self._cpu_figures(key, run)
        return float(rate)

    def _phase(self, kind: str, specs: list[dict[str, Any]]) -> PhaseRun:
        phase = Phase(kind, specs)
        phase.start()
        try:
            broker_cpu = self.broker.cpu_seconds()
            cpu = env.MachineCpu()
            t0 = phase.go()
            if not phase.wait_progress(self.o.messages, self.o.timeout):
                raise errors.SagaEngineError(
                    f"{kind}: only {phase.progress()} of {self.o.messages} done after {self.o.timeout} s"
                )
            busy = cpu.busy()
            broker_cpu = self.broker.cpu_seconds() - broker_cpu
            return PhaseRun(t0, phase.finish(), busy, broker_cpu)
        finally:
            phase.kill()

    def _rates_from_passes(self, key: str, run: PhaseRun) -> float:
        """Rate and drain times of a phase from its passes: (commit time, rows) as each process
        noted them. A row's wait is from go to the commit of the pass that published it."""
        waits = sorted(
            (_seconds(datetime.fromisoformat(at) - run.t0), rows)
            for result in run.results
            for at, rows in result["passes"]
        )
        done = sum(rows for _, rows in waits)
        rate = self.report.figure(f"{key}_rate", done / waits[-1][0], "rate", "msg/s")
        for q in (50, 99):
            self.report.figure(
                f"{key}_drain_p{q}_ms",
                1000 * _weighted_percentile(waits, q / 100),
                f"go -> SENT p{q} (backlog)",
                "ms",
            )
        self._cpu_figures(key, run)
        return float(rate)

    def _cpu_figures(self, key: str, run: PhaseRun) -> None:
        cpu = sum(r["cpu_s"] for r in run.results)
        self.report.figure(f"{key}_cpu_s", cpu, "CPU of its processes", "s")
        self.report.figure(f"{key}_per_cpu_s", self.o.messages / cpu, "messages per CPU second")
        if not math.isnan(run.broker_cpu):
            self.report.figure(f"{key}_broker_cpu_s", run.broker_cpu, "CPU of the broker", "s")
        self.report.figure(f"{key}_machine_busy", 100 * run.busy, "machine CPU busy", "%")

    def _reset(self, destination: str | None = None) -> None:
        """Put the written rows back, PENDING, bound for ``destination`` if given."""
        copy = sa.table(COPY, sa.column("destination"))
        empty = "DELETE FROM" if self.engine.dialect.name == "sqlite" else "TRUNCATE TABLE"
        with self.engine.begin() as conn:
            if destination is not None:
                conn.execute(sa.update(copy).values(destination=destination))
            conn.execute(sa.text(f"{empty} {t.name}"))
            conn.execute(sa.text(f"{empty} {schema.outbox_history.name}"))  # on_sent="archive"
            conn.execute(sa.text(f"INSERT INTO {t.name} SELECT * FROM {COPY}"))
        env.vacuum(self.engine, t.name)
        env.vacuum(self.engine, schema.outbox_history.name)

    # -- verification -----------------------------------------------------------------------

    def _verify(self, topic: str) -> tuple[int, int, int]:
        """Read ``topic`` back; this round's lost, duplicated and reordered messages."""
        report = self.report
        report.section("consumer: read the topic back, count by message id")
        copy = sa.table(COPY, sa.column("message_id"), sa.column("id"))
        with self.engine.connect() as conn:
            ids = dict(conn.execute(sa.select(copy.c.message_id, copy.c.id)).all())
        where: dict[tuple[int, int], str] | None = {} if self.o.log_acks else None
        counts, order_violations, foreign = self._consume(topic, ids, where)
        if where is not None:
            acked, _ = self._acks(topic)
            report.figure(
                "acked_where_read",
                sum(1 for m, at in acked.items() if where.get(at) == m),
                "acknowledged messages read back at their acknowledged offset",
            )
        missing = [m for m in ids if not counts[m]]
        report.figure("first_read_missing", len(missing), "missing after the first read")
        if missing:
            counts, order_violations, foreign = self._reread(topic, ids, missing, counts)
        delivered = sum(1 for m in ids if counts[m])
        lost = report.figure("lost", len(ids) - delivered, "lost")
        dups = report.figure(
            "duplicates", sum(n - 1 for m, n in counts.items() if n > 1 and m in ids), "duplicates"
        )
        report.figure("delivered", delivered, "delivered (distinct message ids)")
        report.figure("order_violations", order_violations, "per-key order violations")
        report.figure("foreign", foreign, "other records on the topic (warm-ups)")
        return lost, dups, order_violations

    def _reread(
        self,
        topic: str,
        ids: dict[str, int],
        missing: list[str],
        first: collections.Counter[str],
    ) -> tuple[collections.Counter[str], int, int]:
        """Read the topic once more with a fresh consumer, and say where the missing rows stand:
        a message the second read finds was on the topic all along (the first read stopped
        early); one that neither read finds is lost."""
        with self.engine.connect() as conn:
            statuses = conn.execute(
                sa.select(t.c.status, sa.func.count())
                .where(t.c.message_id.in_(missing))
                .group_by(t.c.status)
            ).all()
        shown = ", ".join(f"{status}: {n}" for status, n in statuses)
        self.report.note(f"{len(missing)} message ids missing after the first read ({shown})")
        where: dict[tuple[int, int], str] = {}
        second = self._consume(topic, ids, where)
        found = sum(1 for m in missing if second[0][m])
        self.report.note(f"a second read with a fresh consumer found {found} of them")
        self._explain(topic, [m for m in missing if not second[0][m]], where)
        merged = first | second[0]  # per id the larger count: a read never invents a record
        return merged, second[1], second[2]

    def _explain(self, topic: str, lost: list[str], where: dict[tuple[int, int], str]) -> None:
        """Where the broker said each lost message went, from the relays' acknowledgement logs
        (partition and offset of every acknowledged record batch), against what it serves."""
        if not self.o.log_acks:
            self.report.note("run with --log-acks to see where the broker put them")
            return
        acked, overlaps = self._acks(topic)
        kinds: collections.Counter[str] = collections.Counter()
        last_read: dict[int, int] = {}
        for p, o in where:
            last_read[p] = max(last_read.get(p, -1), o)
        for message_id in lost:
            if message_id not in acked:
                kinds["never acknowledged by the broker"] += 1
                continue
            at = acked[message_id]
            if at in where:
                kinds["its offset holds another record"] += 1
            elif at[1] > last_read.get(at[0], -1):
                kinds["acknowledged past the last offset the broker serves"] += 1
            else:
                kinds["acknowledged at an offset the broker skips"] += 1
        self.report.note(f"acknowledged batches given overlapping offsets: {overlaps}")
        for partition in sorted({acked[m][0] for m in lost if m in acked}):
            read = sorted(o for p, o in where if p == partition)
            gaps = [(a + 1, b - 1) for a, b in itertools.pairwise(read) if b != a + 1]
            offsets = sorted(acked[m][1] for m in lost if m in acked and acked[m][0] == partition)
            self.report.note(
                f"partition {partition}: lost messages acknowledged at offsets {offsets[0]}-"
                f"{offsets[-1]}; read offsets {read[0] if read else '-'}-{read[-1] if read else '-'}"
                f" ({len(read)} records), missing ranges {gaps[:5]}"
            )
        for kind, n in kinds.most_common():
            self.report.note(f"lost, {kind}: {n}")

    def _acks(self, topic: str) -> tuple[dict[str, tuple[int, int]], int]:
        """From the relays' acknowledgement logs: (partition, offset) the broker gave each message
        of ``topic``, and how many acknowledged batches overlap an earlier one's offsets."""
        acked: dict[str, tuple[int, int]] = {}
        ranges: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
        for path in sorted(self.ack_dir.glob("acks-*.jsonl")):
            for line in path.read_text().splitlines():
                ack = json.loads(line)
                if ack["topic"] != topic:
                    continue
                base, count = ack["base_offset"], len(ack["ids"])
                ranges[ack["partition"]].append((base, base + count))
                for i, message_id in enumerate(ack["ids"]):
                    acked.setdefault(message_id, (ack["partition"], base + i))
        overlaps = sum(
            1
            for spans in ranges.values()
            for (_, end), (start, _) in itertools.pairwise(sorted(spans))
            if start < end
        )
        return acked, overlaps

    def _consume(
        self, topic: str, ids: dict[str, int], where: dict[tuple[int, int], str] | None = None
    ) -> tuple[collections.Counter[str], int, int]:
        kafka: Any = env.kafka_module()
        consumer = kafka.KafkaConsumer(
            bootstrap_servers=[self.broker.bootstrap],
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
        )
        try:
            partitions = [
                kafka.TopicPartition(topic, p)
                for p in sorted(consumer.partitions_for_topic(topic) or ())
            ]
            consumer.assign(partitions)
            # Offset 0, not seek_to_beginning: the topic is new, and tansu has answered "earliest"
            # with the offset after a partition's first record batch, which hid that batch.
            for partition in partitions:
                consumer.seek(partition, 0)
            return _count(consumer, ids, where)
        finally:
            consumer.close()


def _count(
    consumer: Any, ids: dict[str, int], where: dict[tuple[int, int], str] | None = None
) -> tuple[collections.Counter[str], int, int]:
    """Count ``ids`` on the assigned partitions; ``where`` (if given) gets the message id found at
    each (partition, offset)."""
    counts: collections.Counter[str] = collections.Counter()
    last_of_key: dict[bytes, int] = {}
    seen = order_violations = foreign = 0
    idle_since = time.monotonic()
    while seen < len(ids) and time.monotonic() - idle_since < 5.0:
        batches = consumer.poll(timeout_ms=500, max_records=20_000)
        if batches:
            idle_since = time.monotonic()
        for records in batches.values():
            for record in records:
                message_id = json.loads(record.value).get("message_id", "")
                if where is not None:
                    where[record.partition, record.offset] = message_id
                row_id = ids.get(message_id)
                if row_id is None:
                    foreign += 1
                    continue
                counts[message_id] += 1
                seen += counts[message_id] == 1
                if row_id < last_of_key.get(record.key, -1):
                    order_violations += 1
                last_of_key[record.key] = max(row_id, last_of_key.get(record.key, -1))
    return counts, order_violations, foreign


#: The rates each round measures, in the order ``run`` takes their medians.
_ROUND_RATES = ("relay", "raw", "raw_one")


def _weighted_percentile(values: list[tuple[float, int]], q: float) -> float:
    """The ``q`` quantile of sorted (value, count) pairs, each value counted ``count`` times."""
    rank, seen = q * sum(n for _, n in values), 0
    for value, n in values:
        seen += n
        if seen >= rank:
            return value
    return values[-1][0]


def _crc32c() -> str:
    """Whether kafka-python found the ``crc32c`` C extension: it triples the producer's rate."""
    import importlib.util

    return "C extension" if importlib.util.find_spec("crc32c") else "pure Python"


def _row_columns() -> tuple[Any, ...]:
    from saga_engine.outbox.claim import ROW_COLUMNS

    return ROW_COLUMNS


def _seconds(delta: Any) -> float:
    return max(1e-9, float(delta.total_seconds()))
