"""The ``saga-engine`` command.

Every subcommand turns configuration and connection problems into one line on stderr and exit
status 2, with passwords hidden; only a bug shows a traceback.
"""

from __future__ import annotations

import argparse
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
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
    parser.add_argument("--log-level", default="warning",
                        choices=["debug", "info", "warning", "error"])
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    for register in REGISTRY:
        register(commands)
    return parser


def add_db(parser: argparse.ArgumentParser, default: str | None = DEFAULT_DB) -> None:
    parser.add_argument("--db", default=default, metavar="URL",
                        help=f"SQLAlchemy database URL (default {default})")


def add_broker(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--broker", default="sql://", metavar="URL",
                        help="sql:// (a table of --db, the default) or kafka://host:port")


def open_engine(url: str, pool_size: int = 5) -> Any:
    engine = db.create_engine(url, pool_size=pool_size)
    db.check_connection(engine)
    return engine


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

    migrate.upgrade(args.db, args.revision)
    print(f"database {db.redact(args.db)} is at {args.revision}")
    return 0


# -- relay, cleanup, outbox -----------------------------------------------------------------------


def register_relay(commands: Any) -> None:
    parser = commands.add_parser("relay", help="deliver outbox messages to the broker")
    add_db(parser)
    add_broker(parser)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--poll-interval", type=float, default=0.5, metavar="SECONDS")
    parser.add_argument("--ack-timeout", type=float, default=5.0, metavar="SECONDS")
    parser.add_argument("--max-retries", type=int, default=10)
    parser.add_argument("--claim", default="auto", choices=["auto", "skip_locked", "optimistic"])
    parser.set_defaults(run=run_relay)


def relay_config(args: argparse.Namespace) -> Any:
    from saga_engine.outbox.relay import RelayConfig

    try:
        return RelayConfig(batch_size=args.batch_size, poll_interval=args.poll_interval,
                           ack_timeout=args.ack_timeout, max_retries=args.max_retries,
                           claim=args.claim)
    except ValueError as error:
        raise errors.ConfigurationError(str(error)) from None


def run_relay(args: argparse.Namespace) -> int:
    from saga_engine import transport
    from saga_engine.outbox.relay import Relay

    config = relay_config(args)
    engine = open_engine(args.db, pool_size=config.pool_size)
    broker = transport.from_url(args.broker, engine=engine)
    relay = Relay.for_database(args.db, broker, config)
    stop = stop_on_signals()
    logging.getLogger(__name__).info("relay started on %s", db.redact(args.db))
    relay.run(stop)
    broker.close()
    print_json({"relay": "stopped", **relay.stats.__dict__})
    return 0


def register_cleanup(commands: Any) -> None:
    parser = commands.add_parser("cleanup", help="delete (or archive) old SENT outbox rows")
    add_db(parser)
    parser.add_argument("--retention-days", type=float, default=7.0)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--archive", action="store_true", help="copy to outbox_history first")
    parser.set_defaults(run=run_cleanup)


def run_cleanup(args: argparse.Namespace) -> int:
    from saga_engine.outbox.cleanup import cleanup

    engine = open_engine(args.db)
    result = cleanup(engine, retention=timedelta(days=args.retention_days),
                     batch_size=args.batch_size, archive=args.archive)
    print_json(result.__dict__)
    return 0


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


REGISTRY: list[Callable[[Any], None]] = [register_db, register_relay, register_cleanup,
                                         register_outbox]

if __name__ == "__main__":
    raise SystemExit(main())
