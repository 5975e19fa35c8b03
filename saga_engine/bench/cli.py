"""``saga-engine bench ...``: the benchmark subcommands (registered by ``saga_engine.cli``).

Each prints its figures as it measures them and, with ``--json``, ends with one JSON object that
holds every printed figure and the targets. Exit status 0 when the run was correct (nothing lost,
duplicated or left unfinished: timing targets are reported, never enforced), 1 otherwise.
"""

from __future__ import annotations

import argparse
import signal
from typing import Any

from saga_engine.bench import env

#: ``RelayConfig.on_sent``'s choices, spelled out: importing the relay would slow every command's
#: start (a unit test holds the two lists together).
ON_SENT = ["auto", "mark", "archive", "delete"]


def register(commands: Any) -> None:
    parser = commands.add_parser("bench", help="measure throughput, latency and memory")
    sub = parser.add_subparsers(title="benchmarks", metavar="BENCH", required=True)
    _relay(sub)
    _saga(sub)
    _latency(sub)
    _memory(sub)
    _pass(sub)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--db",
        default=env.DEFAULT_DB,
        metavar="URL",
        help="database server to benchmark on: a scratch database is created there and dropped "
        f"afterwards (default {env.DEFAULT_DB}, or $SAGA_BENCH_DB)",
    )
    parser.add_argument(
        "--broker",
        default=env.TANSU,
        metavar="URL",
        help="kafka://host:port, or 'tansu' (the default) to start a private tansu broker; "
        "'tansu?option=value' passes kafka transport options",
    )
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    parser.add_argument("--keep-db", action="store_true", help="keep the scratch database")


def _relay(sub: Any) -> None:
    parser = sub.add_parser("relay", help="outbox -> Kafka throughput vs raw producer and database")
    _common(parser)
    parser.add_argument(
        "--messages", type=int, default=100_000, help="messages per round (default %(default)s)"
    )
    parser.add_argument(
        "--relays", type=int, default=2, help="relay processes (K, default %(default)s)"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=500,
        help="rows a relay claims per pass (default %(default)s)",
    )
    parser.add_argument(
        "--per-transaction", type=int, default=10, help="messages per write (default %(default)s)"
    )
    parser.add_argument(
        "--per-key",
        type=int,
        default=1,
        help="consecutive messages sharing a partition key (default %(default)s)",
    )
    parser.add_argument(
        "--payload-bytes",
        type=int,
        default=200,
        help="size of a message's JSON payload (default %(default)s)",
    )
    parser.add_argument(
        "--partitions", type=int, default=8, help="partitions of the topic (default %(default)s)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="broker ceiling and relay runs, back to back; the ratio is their median (default %(default)s)",
    )
    parser.add_argument(
        "--log-acks",
        action="store_true",
        help="log the offsets of every acknowledged batch, to explain a loss (costs relay CPU)",
    )
    parser.add_argument(
        "--profile", metavar="DIR", help="profile each relay with pyinstrument, reports in DIR"
    )
    parser.add_argument(
        "--on-sent",
        default="auto",
        choices=ON_SENT,
        help="what the relay does with acknowledged rows (RelayConfig.on_sent; default auto: "
        "archive on PostgreSQL, else mark)",
    )
    _setup_sql(parser)
    parser.set_defaults(run=run_relay)


def _setup_sql(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--setup-sql",
        action="append",
        default=[],
        metavar="SQL",
        help="run in the scratch database before measuring (e.g. to try an index); repeatable",
    )


def run_relay(args: argparse.Namespace) -> int:
    from saga_engine.bench import relay

    options = relay.Options(
        db=args.db,
        broker=args.broker,
        messages=args.messages,
        relays=args.relays,
        batch_size=args.batch_size,
        per_transaction=args.per_transaction,
        per_key=args.per_key,
        payload_bytes=args.payload_bytes,
        partitions=args.partitions,
        rounds=args.rounds,
        log_acks=args.log_acks,
        keep_db=args.keep_db,
        profile=_profile_dir(args.profile),
        setup_sql=tuple(args.setup_sql),
        on_sent=args.on_sent,
    )
    return _run("relay", args, lambda report: relay.run(options, report))


def _saga(sub: Any) -> None:
    parser = sub.add_parser("saga", help="the order saga on K workers (and Temporal, the peer)")
    _common(parser)
    parser.add_argument(
        "--sagas", type=int, default=1000, help="orders placed (default %(default)s)"
    )
    parser.add_argument(
        "--workers", type=int, default=2, help="worker processes (K, default %(default)s)"
    )
    parser.add_argument(
        "--layout",
        choices=["services", "replicas"],
        default="services",
        help="services (default): the first worker runs the orchestrator, relay, deadlines and "
        "cleanup, the others the participants; replicas: every worker runs every role",
    )
    parser.add_argument(
        "--compensate",
        type=float,
        default=0.1,
        help="share of the orders declined at payment, which compensate (default %(default)s)",
    )
    parser.add_argument(
        "--rate",
        type=float,
        metavar="SAGAS_PER_S",
        help="place the orders at this rate (default: back to back, for throughput)",
    )
    parser.add_argument(
        "--placers",
        type=int,
        default=8,
        help="sessions placing orders side by side when back to back (default %(default)s)",
    )
    parser.add_argument(
        "--saga",
        choices=["full", "outline"],
        default="full",
        help="full: the example with its business data (default); outline: the peer's four "
        "steps with no business work, as the peer's activities",
    )
    parser.add_argument(
        "--app", metavar="MODULE:OBJECT", help="the workers' app (default: the --saga's own)"
    )
    parser.add_argument("--peer", choices=["temporal"], help="also run the peer in this run")
    parser.add_argument(
        "--peer-sagas", type=int, default=500, help="sagas the peer runs (default %(default)s)"
    )
    parser.add_argument(
        "--peer-script",
        metavar="PATH",
        help="run this peer script (args: N host:port) instead of saga_engine.bench.temporal_peer",
    )
    _setup_sql(parser)
    parser.set_defaults(run=run_saga)


def run_saga(args: argparse.Namespace) -> int:
    from saga_engine.bench import saga

    options = saga.Options(
        db=args.db,
        broker=args.broker,
        sagas=args.sagas,
        workers=args.workers,
        layout=args.layout,
        compensate=args.compensate,
        rate=args.rate,
        placers=args.placers,
        app=args.app or saga.SAGAS[args.saga][0],
        saga_module=saga.SAGAS[args.saga][1],
        peer=args.peer,
        peer_sagas=args.peer_sagas,
        peer_script=args.peer_script,
        keep_db=args.keep_db,
        setup_sql=tuple(args.setup_sql),
    )
    return _run("saga", args, lambda report: saga.run(options, report))


def _latency(sub: Any) -> None:
    parser = sub.add_parser("latency", help="commit -> ack at a fixed rate; NOTIFY vs polling")
    _common(parser)
    parser.add_argument(
        "--rate",
        type=float,
        default=1000.0,
        help="messages offered per second (default %(default)s)",
    )
    parser.add_argument(
        "--seconds", type=float, default=10.0, help="seconds of each mode (default %(default)s)"
    )
    parser.add_argument(
        "--writers", type=int, default=2, help="writer processes (default %(default)s)"
    )
    parser.add_argument(
        "--threads", type=int, default=4, help="writer threads per process (default %(default)s)"
    )
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=0.5,
        metavar="SECONDS",
        help="the relay's poll interval in both modes (default %(default)s)",
    )
    parser.add_argument(
        "--overhead-samples",
        type=int,
        default=2000,
        help="transactions per write-overhead arm (default %(default)s)",
    )
    _setup_sql(parser)
    parser.set_defaults(run=run_latency)


def run_latency(args: argparse.Namespace) -> int:
    from saga_engine.bench import latency

    options = latency.Options(
        db=args.db,
        broker=args.broker,
        rate=args.rate,
        seconds=args.seconds,
        writers=args.writers,
        threads=args.threads,
        poll_interval=args.poll_interval,
        overhead_samples=args.overhead_samples,
        keep_db=args.keep_db,
        setup_sql=tuple(args.setup_sql),
    )
    return _run("latency", args, lambda report: latency.run(options, report))


def _memory(sub: Any) -> None:
    parser = sub.add_parser("memory", help="RSS of a worker holding N in-flight sagas")
    _common(parser)
    parser.add_argument(
        "--sagas", type=int, default=10_000, help="sagas held in flight (default %(default)s)"
    )
    parser.add_argument(
        "--app",
        default="sagas.app:app",
        metavar="MODULE:OBJECT",
        help="the worker's app (default %(default)s)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="how long RSS is sampled after the last command was sent (default %(default)s)",
    )
    parser.set_defaults(run=run_memory)


def run_memory(args: argparse.Namespace) -> int:
    from saga_engine.bench import memory

    options = memory.Options(
        db=args.db,
        broker=args.broker,
        sagas=args.sagas,
        app=args.app,
        settle=args.settle,
        keep_db=args.keep_db,
    )
    return _run("memory", args, lambda report: memory.run(options, report))


def _pass(sub: Any) -> None:
    parser = sub.add_parser("pass", help="one relay pass, statement by statement, on its own")
    _common(parser)
    parser.add_argument(
        "--rows",
        type=_sizes,
        default=(1, 15, 300),
        metavar="N[,N...]",
        help="rows per pass, one run of passes for each (default 1,15,300)",
    )
    parser.add_argument(
        "--passes", type=int, default=200, help="timed passes per size (default %(default)s)"
    )
    parser.add_argument(
        "--on-sent",
        default="auto",
        choices=ON_SENT,
        help="what the relay does with acknowledged rows (default %(default)s, as in bench relay)",
    )
    parser.set_defaults(run=run_pass)


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of row counts: {text!r}") from None


def run_pass(args: argparse.Namespace) -> int:
    from saga_engine.bench import passes

    options = passes.Options(
        db=args.db,
        broker=args.broker,
        rows=args.rows,
        passes=args.passes,
        on_sent=args.on_sent,
        keep_db=args.keep_db,
    )
    return _run("pass", args, lambda report: passes.run(options, report))


def _run(name: str, args: argparse.Namespace, bench: Any) -> int:
    from saga_engine.bench.report import Report

    # A stop request must still run every cleanup (workers, scratch database, broker): turn
    # SIGTERM (and SIGINT, which a shell's background job ignores by default) into an exception.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    report = Report(name)
    healthy = bool(bench(report))
    if args.json:
        report.json_line()
    return 0 if healthy else 1


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _profile_dir(path: str | None) -> str | None:
    if path is None:
        return None
    import importlib.util
    from pathlib import Path

    from saga_engine import errors

    if importlib.util.find_spec("pyinstrument") is None:
        raise errors.ConfigurationError("--profile needs pyinstrument: pip install pyinstrument")

    Path(path).mkdir(parents=True, exist_ok=True)
    return str(Path(path).resolve())
