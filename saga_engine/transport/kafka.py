"""Kafka transport, through kafka-python (3.x).

``kafka://host:port[,host:port...][?option=value&...]``. Options: ``partitions`` (for topics this
transport creates, default 8), ``replication_factor`` (default 1), ``client_id``,
``max_poll_interval_ms``, ``session_timeout_ms``, ``request_timeout_ms`` and
``fetch_max_wait_ms`` (default 200: how long a fetch may wait for data).

Publishing goes through :class:`~saga_engine.transport.kafka_batch.BatchProducer`: a relay batch
leaves as one record batch per partition (``acks=all``), and every message gets its own result, so
the relay marks exactly the acknowledged rows. The key is the partition key, so one aggregate's
messages stay in one partition, in order, and share their fate within a publish call.

Consuming is at least once: offsets are committed only when the caller says its effects are
committed, and ``release`` seeks back so given-back messages come again. Offsets a broker skipped
are read again (``kafka_gaps``).

A kafka-python 3.0 client whose bootstrap fails leaves its IO thread running, so clients are only
built after a TCP probe finds a broker.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any
from urllib.parse import SplitResult, parse_qs

from saga_engine import errors
from saga_engine.transport.base import (
    Consumer,
    Delivery,
    OutgoingMessage,
    PublishResult,
    Transport,
)
from saga_engine.transport.kafka_batch import BatchProducer
from saga_engine.transport.kafka_gaps import GapGuard

with warnings.catch_warnings():
    # kafka-python 3.0 reads its protocol schemas with importlib.resources.read_text/open_text,
    # deprecated since Python 3.11. The warning is about their code, and under ``-W error`` (or
    # pytest's filterwarnings=error) it would make merely importing this module fail.
    warnings.filterwarnings("ignore", r"(read|open)_text is deprecated", DeprecationWarning)
    import kafka
    import kafka.errors as kafka_errors

log = logging.getLogger(__name__)

DEFAULT_PORT = 9092
OPTIONS = (
    "partitions",
    "replication_factor",
    "client_id",
    "max_poll_interval_ms",
    "session_timeout_ms",
    "request_timeout_ms",
    "fetch_max_wait_ms",
)
#: How long the broker may hold a fetch that finds no data. Kafka answers a waiting fetch as soon
#: as data arrives, so there this only sets how often an idle consumer asks (Kafka's clients use
#: 500 ms). A broker that holds the fetch for the whole wait (tansu) adds most of it to every hop:
#: kafka-python sends a consumer's next fetch as soon as it hands over a batch, when nothing new
#: can be there yet. 200 ms took an outline saga's p50 from about 1.1 to 0.7 s on tansu and gave
#: 4 % more sagas a second; shorter waits gave no more there, and lost throughput on a busier host,
#: as each consumer applies more, smaller batches (docs/benchmarks.md, change 47).
FETCH_MAX_WAIT_MS = 200


class KafkaTransport(Transport):
    """Publishes to and consumes from Kafka (or a Kafka-protocol broker such as tansu)."""

    name = "kafka"
    #: All messages of a key go to one partition, and a partition's record batch is appended
    #: whole or not at all (kafka_batch), so a call's messages of one key share their fate.
    atomic_publish = True

    def __init__(
        self,
        bootstrap_servers: str | Sequence[str],
        *,
        partitions: int = 8,
        replication_factor: int = 1,
        client_id: str = "saga-engine",
        max_poll_interval_ms: int = 300_000,
        session_timeout_ms: int | None = None,
        request_timeout_ms: int = 30_000,
        fetch_max_wait_ms: int = FETCH_MAX_WAIT_MS,
    ) -> None:
        if isinstance(bootstrap_servers, str):
            bootstrap_servers = bootstrap_servers.split(",")
        self.bootstrap_servers = tuple(s.strip() for s in bootstrap_servers if s.strip())
        if not self.bootstrap_servers:
            raise errors.ConfigurationError("the kafka transport needs at least one host:port")
        self.partitions = partitions
        self.replication_factor = replication_factor
        self.client_id = client_id
        self.max_poll_interval_ms = max_poll_interval_ms
        # Kafka's own defaults keep the session timeout below the poll interval; 10 s is well
        # inside a broker's allowed range (6 s to 30 min by default) and detects a dead member
        # quickly. Group joins on tansu wait about half of it, so tests lower the poll interval.
        self.session_timeout_ms = session_timeout_ms or min(10_000, max_poll_interval_ms)
        self.request_timeout_ms = request_timeout_ms
        self.fetch_max_wait_ms = fetch_max_wait_ms
        self._producer: BatchProducer | None = None
        # One publish at a time: a failed publish replaces the producer, which must not happen
        # under another thread's sends; batching makes the serialisation cheap.
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, parts: SplitResult) -> KafkaTransport:
        """Build from ``kafka://host:port[,host:port...][?option=value...]``."""
        if parts.path not in ("", "/"):
            raise errors.ConfigurationError(f"kafka URL must not have a path: {parts.geturl()!r}")
        query = _single_values(parts.query)
        unknown = sorted(set(query) - set(OPTIONS))
        if unknown:
            raise errors.ConfigurationError(
                f"unknown kafka:// option {unknown[0]!r} (known: {', '.join(OPTIONS)})"
            )
        return cls(
            _servers(parts.netloc),
            partitions=_positive_int(query, "partitions", 8),
            replication_factor=_positive_int(query, "replication_factor", 1),
            client_id=query.get("client_id") or "saga-engine",
            max_poll_interval_ms=_positive_int(query, "max_poll_interval_ms", 300_000),
            session_timeout_ms=_positive_int(query, "session_timeout_ms", 0) or None,
            request_timeout_ms=_positive_int(query, "request_timeout_ms", 30_000),
            fetch_max_wait_ms=_positive_int(query, "fetch_max_wait_ms", FETCH_MAX_WAIT_MS),
        )

    # -- publishing -------------------------------------------------------------------------

    def publish(self, messages: Sequence[OutgoingMessage], timeout: float) -> list[PublishResult]:
        if not messages:
            return []
        deadline = time.monotonic() + timeout
        with self._lock:
            producer, error = self._ensure_producer(deadline)
            if producer is None:
                return [PublishResult(m.message_id, error, unreachable=True) for m in messages]
            results = producer.publish(messages, deadline)
            if any(r.unreachable for r in results):
                # A broker that went away, restarted or moved a leader: a fresh client starts
                # from a new bootstrap and fresh metadata instead of a reconnect backoff.
                self._retire_producer()
        return results

    def _ensure_producer(self, deadline: float) -> tuple[BatchProducer | None, str]:
        if self._producer is not None:
            return self._producer, ""
        try:
            self._probe(deadline)
            self._producer = BatchProducer(
                self.bootstrap_servers,
                client_id=self.client_id,
                request_timeout_ms=self.request_timeout_ms,
                bootstrap_timeout_ms=_remaining_ms(deadline),
            )
        except errors.TransportError as exc:
            return None, str(exc)
        except (kafka_errors.KafkaError, OSError) as exc:
            return None, f"cannot connect a producer to {self._servers_text}: {_describe(exc)}"
        return self._producer, ""

    def _retire_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.close()

    # -- channels and consumers -------------------------------------------------------------

    def ensure_channels(self, channels: Sequence[str]) -> None:
        """Create missing topics with ``partitions`` partitions; existing ones stay as they are."""
        names = list(dict.fromkeys(channels))
        if not names:
            return
        spec = {"num_partitions": self.partitions, "replication_factor": self.replication_factor}
        admin = self._admin()
        try:
            response = admin.create_topics(
                {name: dict(spec) for name in names}, raise_errors=False, wait_for_metadata=True
            )
        except kafka_errors.KafkaError as exc:
            raise errors.TransportError(f"cannot create topics {names}: {_describe(exc)}") from exc
        finally:
            admin.close()
        _check_created(response)

    def _admin(self) -> Any:
        return self._connect(
            kafka.KafkaAdminClient,
            "an admin client",
            bootstrap_servers=list(self.bootstrap_servers),
            client_id=self.client_id,
            request_timeout_ms=self.request_timeout_ms,
            bootstrap_timeout_ms=self.request_timeout_ms,
        )

    def _connect(self, factory: Any, what: str, **config: Any) -> Any:
        """``factory(**config)`` once a broker answers TCP; kafka errors become TransportError."""
        self._probe(time.monotonic() + self.request_timeout_ms / 1000)
        try:
            return factory(**config)
        except kafka_errors.KafkaError as exc:
            raise errors.TransportError(
                f"cannot connect {what} to kafka at {self._servers_text}: {_describe(exc)}"
            ) from exc

    def consumer(self, group: str, channels: Sequence[str]) -> Consumer:
        topics = list(dict.fromkeys(channels))
        # Subscribing to a missing topic makes the broker create it with its own default partition
        # count (4 on tansu, 1 on Kafka); creating it first gives it ours.
        self.ensure_channels(topics)
        client = self._connect(kafka.KafkaConsumer, "a consumer", **self._consumer_config(group))
        consumer = KafkaGroupConsumer(client)
        try:
            client.subscribe(topics=topics, listener=_Reassigned(consumer.gaps))
        except (kafka_errors.KafkaError, TypeError, ValueError) as exc:
            client.close(autocommit=False, timeout_ms=0)
            raise errors.TransportError(f"cannot subscribe to {topics}: {_describe(exc)}") from exc
        return consumer

    def _consumer_config(self, group: str) -> dict[str, Any]:
        return {
            "bootstrap_servers": list(self.bootstrap_servers),
            "client_id": self.client_id,
            "group_id": group,
            # Offsets move only when the caller commits, after its own transaction committed.
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",
            "max_poll_interval_ms": self.max_poll_interval_ms,
            "session_timeout_ms": self.session_timeout_ms,
            # Kafka's rule of thumb: three heartbeats per session timeout.
            "heartbeat_interval_ms": max(1, self.session_timeout_ms // 3),
            "request_timeout_ms": self.request_timeout_ms,
            "bootstrap_timeout_ms": self.request_timeout_ms,
            "fetch_max_wait_ms": self.fetch_max_wait_ms,
        }

    def close(self) -> None:
        with self._lock:
            self._retire_producer()

    # -- helpers ----------------------------------------------------------------------------

    @property
    def _servers_text(self) -> str:
        return ",".join(self.bootstrap_servers)

    def _probe(self, deadline: float) -> None:
        """Raise TransportError unless some bootstrap server accepts a TCP connection."""
        failures = []
        for server in self.bootstrap_servers:
            host, _, port = server.rpartition(":")
            address = (host.strip("[]"), int(port))  # [::1]:9092 is an IPv6 host
            try:
                with socket.create_connection(address, timeout=_probe_timeout(deadline)):
                    return
            except OSError as exc:
                failures.append(f"{server}: {exc.strerror or exc}")
        raise errors.TransportError(f"kafka broker unreachable ({'; '.join(failures)})")


class KafkaGroupConsumer(Consumer):
    """A kafka-python consumer in a group; tokens are ``(TopicPartition, offset)``.

    A poll delivers a partition's records only while their offsets follow each other; where the
    broker skipped some, it seeks back and reads them again (see ``kafka_gaps``).
    """

    def __init__(self, client: Any) -> None:
        self._client = client
        self.gaps = GapGuard()

    def poll(self, max_messages: int, timeout: float) -> list[Delivery]:
        if max_messages < 1:
            return []
        try:
            batches = self._client.poll(timeout_ms=int(timeout * 1000), max_records=max_messages)
        except kafka_errors.KafkaError as exc:
            raise errors.TransportError(f"kafka poll failed: {_describe(exc)}") from exc
        deliveries = []
        for partition, records in batches.items():
            taken, skipped_from = self.gaps.take(partition, records)
            if skipped_from is not None:
                self._client.seek(partition, skipped_from)
            deliveries += [_delivery(record) for record in taken]
        return deliveries

    def commit(self, deliveries: Sequence[Delivery]) -> None:
        # The committed offset is the next one to read: one past the highest delivered.
        offsets = {
            partition: kafka.OffsetAndMetadata(offset + 1, "", -1)
            for partition, offset in _per_partition(deliveries, max).items()
        }
        if not offsets:
            return
        try:
            self._client.commit(offsets=offsets)
        except kafka_errors.KafkaError as exc:
            # Typically a rebalance took the partition away: the new owner gets these again,
            # which the inbox deduplicates.
            raise errors.TransportError(f"kafka commit failed: {_describe(exc)}") from exc

    def release(self, deliveries: Sequence[Delivery]) -> None:
        """Seek back so everything from the lowest released offset of each partition comes again."""
        assigned = self._client.assignment()
        for partition, offset in _per_partition(deliveries, min).items():
            # A partition that moved to another member will be read there from its committed
            # offset, which is at or before these.
            if partition in assigned:
                self._client.seek(partition, offset)
                self.gaps.rewound(partition, offset)

    def close(self) -> None:
        try:
            # Leaving the group promptly lets the others take over its partitions now, not after
            # the session timeout; the bound keeps close() from hanging on a dead broker.
            self._client.close(autocommit=False, timeout_ms=5000)
        except kafka_errors.KafkaError as exc:
            log.warning("kafka consumer did not close cleanly: %s", _describe(exc))


# -- consuming helpers ---------------------------------------------------------------------


class _Reassigned(kafka.ConsumerRebalanceListener):  # type: ignore[misc]
    """Forgets the expected offsets of partitions a rebalance moved: a partition assigned anew
    goes on from the group's committed offset, which says nothing about a gap."""

    def __init__(self, gaps: GapGuard) -> None:
        self.gaps = gaps

    def on_partitions_revoked(self, revoked: Any) -> None:
        self.gaps.forget(revoked)

    def on_partitions_assigned(self, assigned: Any) -> None:
        self.gaps.forget(assigned)


def _delivery(record: Any) -> Delivery:
    key = record.key.decode("utf-8", "replace") if record.key is not None else ""
    return Delivery(
        channel=record.topic,
        partition_key=key,
        value=record.value if record.value is not None else b"",
        token=(kafka.TopicPartition(record.topic, record.partition), record.offset),
    )


def _per_partition(deliveries: Sequence[Delivery], pick: Any) -> dict[Any, int]:
    """The ``pick`` (min or max) offset per partition among ``deliveries``."""
    offsets: dict[Any, int] = {}
    for delivery in deliveries:
        partition, offset = _token(delivery)
        offsets[partition] = pick(offset, offsets.get(partition, offset))
    return offsets


def _token(delivery: Delivery) -> tuple[Any, int]:
    token = delivery.token
    if not (isinstance(token, tuple) and len(token) == 2):
        raise errors.TransportError(f"not a kafka delivery token: {token!r}")
    return token[0], int(token[1])


# -- configuration helpers -----------------------------------------------------------------


def _single_values(query: str) -> dict[str, str]:
    values = parse_qs(query, keep_blank_values=True)
    repeated = sorted(name for name, given in values.items() if len(given) > 1)
    if repeated:
        raise errors.ConfigurationError(f"kafka:// option {repeated[0]!r} is given twice")
    return {name: given[0] for name, given in values.items()}


def _servers(netloc: str) -> list[str]:
    servers = [_server(item.strip()) for item in netloc.split(",") if item.strip()]
    if not servers:
        raise errors.ConfigurationError("kafka URL needs a host: kafka://host:port[,host:port]")
    return servers


def _server(item: str) -> str:
    host, sep, port = item.rpartition(":")
    if not sep:
        host, port = item, str(DEFAULT_PORT)
    if not host or "@" in host:
        raise errors.ConfigurationError(f"kafka URL has a bad host {item!r}: expected host:port")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise errors.ConfigurationError(f"kafka URL has a bad port in {item!r}")
    return f"{host}:{int(port)}"


def _positive_int(query: dict[str, str], name: str, default: int) -> int:
    if name not in query:
        return default
    text = query[name]
    if not text.isdigit() or int(text) < 1:
        raise errors.ConfigurationError(
            f"kafka:// option {name} must be a positive integer, not {text!r}"
        )
    return int(text)


def _check_created(response: dict[str, Any]) -> None:
    for topic in response.get("topics", []):
        error = kafka_errors.for_code(topic["error_code"])
        if error is kafka_errors.NoError or issubclass(error, kafka_errors.TopicAlreadyExistsError):
            continue
        detail = topic.get("error_message") or error.__name__
        raise errors.TransportError(f"cannot create topic {topic['name']!r}: {detail}")


def _remaining_ms(deadline: float) -> int:
    return max(1, int((deadline - time.monotonic()) * 1000))


def _probe_timeout(deadline: float) -> float:
    return min(2.0, max(0.1, deadline - time.monotonic()))


def _describe(exc: BaseException) -> str:
    text, name = str(exc), type(exc).__name__
    if text in ("", "None", name):
        return name
    return text if text.startswith(name) else f"{name}: {text}"
