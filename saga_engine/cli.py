"""saga-engine: run, start, inspect and benchmark sagas on the transactional outbox.

Every subcommand turns configuration and connection problems into one line on stderr and exit
status 2, with passwords hidden; only a bug shows a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from saga_engine import db, errors

DEFAULT_DB = "sqlite:///saga-engine.sqlite3"
Command = Callable[[argparse.Namespace], int]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # The state machine library narrates every transition at INFO; the engine logs what matters.
    logging.getLogger("transitions").setLevel(max(logging.WARNING, logging.root.level))
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        return int(args.run(args))
    except errors.SagaEngineError as error:
        print(f"saga-engine: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="saga-engine", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--log-level", default="warning", choices=["debug", "info", "warning", "error"]
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    for register in REGISTRY:
        register(commands)
    return parser


def add_db(parser: argparse.ArgumentParser, default: str | None = DEFAULT_DB) -> None:
    parser.add_argument(
        "--db", default=default, metavar="URL", help=f"SQLAlchemy database URL (default {default})"
    )


def add_broker(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--broker",
        default="sql://",
        metavar="URL",
        help="sql:// (a table of --db, the default) or kafka://host:port",
    )


#: The engine's tables each kind of command reads and writes (all are made by ``db upgrade``).
OUTBOX_TABLES = ("outbox_messages", "outbox_history")
CONSUMER_TABLES = (*OUTBOX_TABLES, "inbox_messages", "inbox_duplicates", "dead_letters")
SAGA_TABLES = (*CONSUMER_TABLES, "saga_instances")


def open_engine(url: str, pool_size: int = 5, tables: Sequence[str] = OUTBOX_TABLES) -> Any:
    engine = db.create_engine(url, pool_size=pool_size)
    db.check_connection(engine)
    require_tables(engine, tables)
    return engine


def require_tables(engine: Any, tables: Sequence[str]) -> None:
    """A database without the engine's schema is a configuration problem, not a traceback."""
    import sqlalchemy as sa

    try:
        present = set(sa.inspect(engine).get_table_names())
    except sa.exc.DBAPIError as error:
        raise errors.DatabaseUnavailable(
            f"cannot read the tables of {db.redact(engine.url)}: {_first_line(error.orig or error)}"
        ) from None
    missing = [name for name in tables if name not in present]
    if missing:
        raise errors.ConfigurationError(
            f"database {db.redact(engine.url)} lacks the table(s) {', '.join(missing)}: run "
            "`saga-engine db upgrade --db URL` (and the app's own migrations) first"
        )


def app_tables(metadata: Sequence[Any]) -> tuple[str, ...]:
    """The tables an app or participant declares (its own migrations create them)."""
    return tuple(name for md in metadata if md is not None for name in md.tables)


def transport_tables(broker_url: str | None) -> tuple[str, ...]:
    """The sql:// transport carries messages in a table of the database."""
    from urllib.parse import urlsplit

    return ("transport_messages",) if urlsplit(broker_url or "sql://").scheme == "sql" else ()


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT: the loop finishes the batch in hand, then returns."""
    stop = threading.Event()

    def _handler(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)
    return stop


def print_json(value: object) -> None:
    print(json.dumps(value, default=str, sort_keys=True))


# -- db -----------------------------------------------------------------------------------------


def register_db(commands: Any) -> None:
    parser = commands.add_parser("db", help="create or upgrade the schema")
    sub = parser.add_subparsers(title="db commands", metavar="ACTION", required=True)
    upgrade = sub.add_parser("upgrade", help="create or upgrade every table the engine uses")
    add_db(upgrade)
    upgrade.add_argument("--revision", default="head")
    upgrade.set_defaults(run=run_db_upgrade)


def run_db_upgrade(args: argparse.Namespace) -> int:
    from saga_engine import migrate

    revision = migrate.upgrade(args.db, args.revision)
    print(f"database {db.redact(args.db)} is at revision {revision}")
    return 0


# -- relay, cleanup, outbox -----------------------------------------------------------------------


def register_relay(commands: Any) -> None:
    parser = commands.add_parser("relay", help="deliver outbox messages to the broker")
    add_db(parser)
    add_broker(parser)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument(
        "--first-poll-batch",
        type=int,
        default=100,
        metavar="N",
        help="rows the first claim of a poll takes, the oldest; full claims double it up to "
        "--batch-size",
    )
    parser.add_argument("--poll-interval", type=float, default=0.5, metavar="SECONDS")
    parser.add_argument("--ack-timeout", type=float, default=5.0, metavar="SECONDS")
    parser.add_argument("--max-retries", type=int, default=10)
    parser.add_argument("--claim", default="auto", choices=["auto", "skip_locked", "optimistic"])
    parser.add_argument(
        "--on-sent",
        default="auto",
        choices=["auto", "mark", "archive", "delete"],
        help="move acknowledged rows to outbox_history (archive), keep them as SENT until "
        "cleanup (mark), or delete them at once; auto (the default) archives on PostgreSQL "
        "and marks elsewhere",
    )
    parser.set_defaults(run=run_relay)


def relay_config(args: argparse.Namespace) -> Any:
    from saga_engine.outbox.relay import RelayConfig

    try:
        return RelayConfig(
            batch_size=args.batch_size,
            first_poll_batch=args.first_poll_batch,
            poll_interval=args.poll_interval,
            ack_timeout=args.ack_timeout,
            max_retries=args.max_retries,
            claim=args.claim,
            on_sent=args.on_sent,
        )
    except ValueError as error:
        raise errors.ConfigurationError(str(error)) from None


def run_relay(args: argparse.Namespace) -> int:
    from saga_engine import transport
    from saga_engine.outbox.relay import Relay

    config = relay_config(args)
    engine = open_engine(args.db, config.pool_size, OUTBOX_TABLES + transport_tables(args.broker))
    broker = transport.from_url(args.broker, engine=engine)
    relay = Relay.for_database(args.db, broker, config)
    stop = stop_on_signals()
    logging.getLogger(__name__).info("relay started on %s", db.redact(args.db))
    relay.run(stop)
    broker.close()
    print_json({"relay": "stopped", **relay.stats.__dict__})
    return 0


def register_cleanup(commands: Any) -> None:
    parser = commands.add_parser(
        "cleanup",
        help="delete (or archive) old SENT outbox rows; prune the inbox, ended sagas, dead letters",
    )
    add_db(parser)
    add_retention(parser)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--archive", action="store_true", help="copy to outbox_history first")
    parser.set_defaults(run=run_cleanup)


#: The inbox's default retention, spelled out: importing saga_engine.inbox (and so the schema)
#: here would slow every command's start by some 40 ms. A unit test holds it to
#: ``inbox.INBOX_RETENTION``.
INBOX_RETENTION_DAYS = 30.0
#: The same for delivered messages (``cleanup.RETENTION`` and ``cleanup.HISTORY_RETENTION``).
RETENTION_DAYS = 7.0


def add_retention(parser: argparse.ArgumentParser) -> None:
    """How long the cleanup (the command, or the worker's role) keeps what it prunes."""
    group = parser.add_argument_group("retention (days; fractions allowed)")
    group.add_argument(
        "--retention-days",
        type=float,
        default=RETENTION_DAYS,
        metavar="DAYS",
        help=f"SENT outbox rows (default {RETENTION_DAYS:g})",
    )
    group.add_argument(
        "--inbox-retention-days",
        type=float,
        metavar="DAYS",
        help=f"inbox entries (default {INBOX_RETENTION_DAYS:g}); longer than any log a consumer "
        "may replay",
    )
    group.add_argument("--keep-inbox", action="store_true", help="leave the inbox alone")
    group.add_argument(
        "--saga-retention-days",
        type=float,
        metavar="DAYS",
        help="sagas that ended (default: keep them); running sagas are never pruned",
    )
    group.add_argument(
        "--history-retention-days",
        type=float,
        metavar="DAYS",
        help="rows in outbox_history, archived by relays (by default on PostgreSQL) or by "
        f"cleanup --archive, counted from their archiving (default {RETENTION_DAYS:g})",
    )
    group.add_argument("--keep-history", action="store_true", help="leave outbox_history alone")
    group.add_argument(
        "--dead-letter-retention-days",
        type=float,
        metavar="DAYS",
        help="dead letters (default: keep them until an operator deletes them)",
    )


@dataclasses.dataclass(frozen=True)
class Retention:
    """The retentions of :func:`add_retention`'s options; None keeps everything."""

    outbox: timedelta
    inbox: timedelta | None
    sagas: timedelta | None
    dead_letters: timedelta | None
    history: timedelta | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Retention:
        if args.retention_days < 0:
            raise errors.ConfigurationError("--retention-days must not be negative")
        inbox_days = args.inbox_retention_days
        if inbox_days is None:
            inbox_days = INBOX_RETENTION_DAYS
        # Zero would prune every inbox entry at once, while they still guard against redelivery.
        inbox_hint = " (use --keep-inbox to keep every entry)"
        history_days = args.history_retention_days
        if history_days is None:
            history_days = RETENTION_DAYS
        return cls(
            outbox=timedelta(days=args.retention_days),
            inbox=None
            if args.keep_inbox
            else _days("--inbox-retention-days", inbox_days, inbox_hint),
            sagas=_days("--saga-retention-days", args.saga_retention_days),
            dead_letters=_days("--dead-letter-retention-days", args.dead_letter_retention_days),
            history=None if args.keep_history else _days("--history-retention-days", history_days),
        )


def _days(option: str, days: float | None, hint: str = "") -> timedelta | None:
    """``days`` as a retention; None (not given) keeps everything."""
    if days is None:
        return None
    if days <= 0:
        raise errors.ConfigurationError(f"{option} must be positive{hint}")
    return timedelta(days=days)


def run_cleanup(args: argparse.Namespace) -> int:
    from saga_engine import deadletter, inbox, store
    from saga_engine.outbox.cleanup import cleanup, prune_history

    retention = Retention.from_args(args)
    tables: tuple[str, ...] = OUTBOX_TABLES
    if retention.inbox is not None:
        tables = (*tables, "inbox_messages", "inbox_duplicates")
    if retention.dead_letters is not None:
        tables = (*tables, "dead_letters")
    engine = open_engine(args.db, tables=tables)
    result = cleanup(
        engine, retention=retention.outbox, batch_size=args.batch_size, archive=args.archive
    )
    report: dict[str, int] = dict(result.__dict__)
    if retention.history is not None:
        report["history"] = prune_history(
            engine, retention=retention.history, batch_size=args.batch_size
        )
    if retention.inbox is not None:
        pruned = inbox.prune(engine, retention=retention.inbox, batch_size=args.batch_size)
        report |= {"inbox": pruned.inbox, "inbox_duplicates": pruned.duplicates}
    # Only the orchestrator's database holds sagas: a participant's has none to prune.
    if retention.sagas is not None and _has_table(engine, "saga_instances"):
        report["sagas"] = store.prune_ended(
            engine, retention=retention.sagas, batch_size=args.batch_size
        )
    if retention.dead_letters is not None:
        report["dead_letters"] = deadletter.prune(
            engine, retention=retention.dead_letters, batch_size=args.batch_size
        )
    print_json(report)
    return 0


def _has_table(engine: Any, name: str) -> bool:
    import sqlalchemy as sa

    return bool(sa.inspect(engine).has_table(name))


def register_outbox(commands: Any) -> None:
    parser = commands.add_parser("outbox", help="inspect the outbox or re-queue FAILED rows")
    sub = parser.add_subparsers(title="outbox commands", metavar="ACTION", required=True)
    signals = sub.add_parser("signals", help="backlog, failures, delivery latency (JSON)")
    add_db(signals)
    signals.set_defaults(run=run_outbox_signals)
    requeue = sub.add_parser("requeue", help="put FAILED messages back to PENDING")
    add_db(requeue)
    requeue.add_argument("message_ids", nargs="*", help="only these (default: every FAILED row)")
    requeue.set_defaults(run=run_outbox_requeue)


def run_outbox_signals(args: argparse.Namespace) -> int:
    from saga_engine.outbox import admin

    print_json(admin.signals(open_engine(args.db)).as_dict())
    return 0


def run_outbox_requeue(args: argparse.Namespace) -> int:
    from saga_engine.outbox import admin

    count = admin.requeue_failed(open_engine(args.db), args.message_ids or None)
    print_json({"requeued": count})
    return 0


# -- the saga engine ------------------------------------------------------------------------------


def add_app(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument(
        "--app",
        required=required,
        metavar="MODULE:OBJECT",
        help="the saga_engine.App to run, e.g. sagas.app:app",
    )


def load_app(spec: str) -> Any:
    from saga_engine import app

    sys.path.insert(0, ".")  # like `python -m`: modules of the current directory are importable
    return app.load(spec)


def parse_participant_dbs(values: Sequence[str]) -> dict[str, str]:
    out = {}
    for value in values:
        name, sep, url = value.partition("=")
        if not sep or not name or not url:
            raise errors.ConfigurationError(f"--participant-db {value!r}: expected NAME=URL")
        out[name] = url
    return out


#: The worker's roles, spelled out: importing saga_engine.worker here would load the whole engine
#: (some 180 ms) for every command. A unit test holds them to ``worker.ROLES``.
WORKER_ROLES = "orchestrator,participants,relay,deadlines,cleanup"


def register_worker(commands: Any) -> None:
    parser = commands.add_parser(
        "worker", help="run orchestrators, participants, relays, deadlines"
    )
    add_app(parser)
    add_db(parser)
    add_broker(parser)
    parser.add_argument(
        "--roles",
        default=WORKER_ROLES,
        help=f"comma-separated subset of {WORKER_ROLES} (default: all)",
    )
    parser.add_argument(
        "--participants",
        default=None,
        metavar="NAMES",
        help="comma-separated participants to run (default: all of the app's)",
    )
    parser.add_argument(
        "--participant-db",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="a participant's own database (repeatable)",
    )
    add_retention(parser)
    parser.set_defaults(run=run_worker)


def run_worker(args: argparse.Namespace) -> int:
    from saga_engine.worker import Worker, WorkerOptions

    app = load_app(args.app)
    retention = Retention.from_args(args)
    options = WorkerOptions(
        db_url=args.db,
        broker_url=args.broker,
        roles=[r.strip() for r in args.roles.split(",") if r.strip()],
        participants=args.participants.split(",") if args.participants else None,
        participant_dbs=parse_participant_dbs(args.participant_db),
        retention=retention.outbox,
        inbox_retention=retention.inbox,
        saga_retention=retention.sagas,
        dead_letter_retention=retention.dead_letters,
        history_retention=retention.history,
    )
    worker = Worker(app, options)
    # Every database the worker will use, connected and checked now rather than by a loop that
    # would only log the same error for ever.
    main_tables: tuple[str, ...] = SAGA_TABLES if app.sagas else CONSUMER_TABLES
    main_tables += transport_tables(args.broker) + app_tables(app.metadata)
    require_tables(worker.main_engine, main_tables)
    for name in worker.participant_names:
        own = app_tables([app.participants[name].metadata])
        require_tables(worker.engine(worker.participant_db(name)), CONSUMER_TABLES + own)
    stop = stop_on_signals()
    logging.getLogger(__name__).info("worker started: %s on %s", app, db.redact(args.db))
    worker.run(stop)
    return 1 if worker.crashed else 0  # non-zero lets a supervisor restart a broken worker


def register_start(commands: Any) -> None:
    parser = commands.add_parser("start", help="start sagas (prints their ids)")
    parser.add_argument("saga_type")
    add_app(parser)
    add_db(parser)
    parser.add_argument("--data", required=True, metavar="JSON", help="the saga data as JSON")
    parser.add_argument("--count", type=int, default=1, help="start this many (one transaction)")
    parser.set_defaults(run=run_start)


def run_start(args: argparse.Namespace) -> int:
    import pydantic

    app = load_app(args.app)
    saga = app.saga(args.saga_type)
    try:
        data = saga.data_type.model_validate_json(args.data)
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "data"
        raise errors.ConfigurationError(
            f"--data is not valid {saga.data_type.__name__}: {where}: {first['msg']}"
        ) from None
    if args.count < 1:
        raise errors.ConfigurationError("--count must be at least 1")
    import sqlalchemy as sa

    engine = open_engine(args.db, tables=(*SAGA_TABLES, *app_tables(app.metadata)))
    try:
        with engine.begin() as conn:
            ids = [app.start(conn, saga, data) for _ in range(args.count)]
    except sa.exc.IntegrityError as error:
        # Bad input, e.g. an order id that exists already: nothing was started.
        raise errors.ConfigurationError(
            f"--data conflicts with what is stored: {_first_line(error.orig or error)}"
        ) from None
    print("\n".join(ids))
    return 0


def register_status(commands: Any) -> None:
    parser = commands.add_parser("status", help="sagas by state, outbox, duplicates, dead letters")
    add_app(parser, required=False)
    add_db(parser)
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    parser.set_defaults(run=run_status)


def run_status(args: argparse.Namespace) -> int:
    from saga_engine import status

    if args.app:
        load_app(args.app)
    report = status.collect(open_engine(args.db, tables=SAGA_TABLES))
    if args.json:
        print_json(report)
    else:
        print(status.render(report, db.redact(args.db)))
    return 0


def register_diagram(commands: Any) -> None:
    parser = commands.add_parser("diagram", help="draw every saga's state machine (Mermaid, SVG)")
    add_app(parser)
    parser.add_argument("--out", default="diagrams", metavar="DIR")
    parser.set_defaults(run=run_diagram)


def run_diagram(args: argparse.Namespace) -> int:
    from pathlib import Path

    from saga_engine import diagram

    for path in diagram.write(load_app(args.app), Path(args.out)):
        print(path)
    return 0


def register_demo(commands: Any) -> None:
    parser = commands.add_parser("demo", help="run the order saga N times with injected failures")
    parser.add_argument("--sagas", type=int, default=100)
    parser.add_argument("--fail-rate", type=float, default=0.1)
    parser.add_argument(
        "--db",
        default=None,
        metavar="URL",
        help="a dedicated database (its demo tables are recreated; default: a "
        "temporary SQLite file)",
    )
    add_broker(parser)
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    parser.set_defaults(run=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from saga_engine import demo

    if args.sagas < 1 or not 0 <= args.fail_rate <= 1:
        raise errors.ConfigurationError("--sagas must be >= 1 and --fail-rate within 0..1")
    result = demo.run_demo(
        sagas=args.sagas,
        fail_rate=args.fail_rate,
        db_url=args.db,
        broker_url=args.broker,
        as_json=args.json,
    )
    healthy = result["invariants_ok"] and not result["failed"] and not result["stuck"]
    return 0 if healthy else 1


def register_bench(commands: Any) -> None:
    from saga_engine.bench import cli as bench_cli

    bench_cli.register(commands)


REGISTRY: list[Callable[[Any], None]] = [
    register_demo,
    register_worker,
    register_start,
    register_status,
    register_diagram,
    register_relay,
    register_cleanup,
    register_outbox,
    register_db,
    register_bench,
]

if __name__ == "__main__":
    raise SystemExit(main())
