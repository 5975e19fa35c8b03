"""Publishing a relay batch to Kafka in one produce request per broker.

``KafkaProducer.send`` costs kafka-python about 60 µs of CPU per record (partitioner, accumulator,
a future per record, locks), against about 5 µs to encode the record itself. A relay always holds
a whole batch and waits for all of it, so :class:`BatchProducer` does for a batch, once, what the
client does per record: it picks each message's partition with the Java client's murmur2
partitioner (a key lands where any Kafka producer would put it), encodes one record batch per
partition, sends one ``ProduceRequest`` with ``acks=all`` to each partition leader, and waits
for the responses.

**One fate per key.** A broker appends a partition's record batch whole or not at all, and every
message of one key goes to the same partition, so within one call all messages of a key succeed
or fail together. A partition whose messages do not fit one record batch is sent in rounds, the
next chunk only after the previous one was acknowledged; when a chunk fails, the rest of its
partition is reported failed without being sent. Hence a later message of a key is never
acknowledged while an earlier one of the same call failed, and the relay can hand over a whole
batch in one call (``KafkaTransport.atomic_publish``).

The producer is not idempotent: a request that timed out may have been appended, and the relay
publishes it again. That is the outbox's at-least-once contract; the consumers' inbox drops the
duplicate. All network work happens in the calling thread, inside :meth:`BatchProducer.publish`;
there is no background thread to leak or to retry behind the relay's back.

**Its own connections for produce requests.** kafka-python's client bootstraps, negotiates the
protocol version and keeps the cluster's metadata; the produce requests go over a plain blocking
socket per leader (:class:`_Link`), framed, encoded and decoded by kafka-python's protocol classes.
Through the client's event loop (tasks, futures, selector registrations on every request) a
publish of one message cost 0.42-0.54 ms of CPU on the development machine; through a link it
costs 0.27-0.28 ms. At a steady rate nearly every relay pass sends one request, and that CPU was a
third of the pass's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import socket
import struct
import time
import warnings
from collections.abc import Sequence
from typing import Any

from saga_engine.transport.base import OutgoingMessage, PublishResult

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", r"(read|open)_text is deprecated", DeprecationWarning)
    import kafka.errors as kafka_errors
    from kafka.net.compat import KafkaNetClient
    from kafka.protocol.parser import KafkaProtocol
    from kafka.protocol.producer import ProduceRequest
    from kafka.record.util import calc_crc32c
    from kafka.structs import TopicPartition

#: At DEBUG, one JSON line per acknowledged record batch: topic, partition, the base offset the
#: broker assigned and the message ids in offset order (``bench relay`` checks a broker with it).
ack_log = logging.getLogger(__name__ + ".acks")

#: A record batch stays below Kafka's default message.max.bytes (1 MiB) with room to spare.
MAX_BATCH_BYTES = 512 * 1024
#: The largest record accepted: Kafka's default max.request.size (and message.max.bytes, about).
MAX_RECORD_BYTES = 1024 * 1024
_RECORD_OVERHEAD = 64  # record and batch headers, generously
#: v9 is the newest produce version that names topics (v13 wants topic ids); magic 2 needs v3+.
_PRODUCE_MAX_VERSION = 9
_ACKS_ALL = -1
#: How often a publish lets the client's event loop run, which refreshes the cluster's metadata
#: when it is older than the client's ``metadata_max_age_ms`` (partitions added to a topic).
CLIENT_POLL_INTERVAL_S = 1.0
#: One read of an answer: a produce response is a few hundred bytes per partition.
_RECEIVE_BYTES = 65536

#: Broker answers that concern the records themselves: retrying the same bytes cannot help.
_RECORD_ERRORS: tuple[type[BaseException], ...] = (
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordListTooLargeError,
    kafka_errors.InvalidTopicError,
    kafka_errors.InvalidRecordError,
    kafka_errors.CorruptRecordError,
    kafka_errors.TopicAuthorizationFailedError,
)


@dataclasses.dataclass
class _Chunk:
    """Consecutive messages of one partition, encoded as one record batch."""

    partition: TopicPartition
    indexes: list[int]  # positions in the publish call
    records: bytes


@dataclasses.dataclass(frozen=True)
class _Outcome:
    """How one chunk went: acknowledged (no error), or why not."""

    error: str | None = None
    unreachable: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None

    def of(self, message_id: str) -> PublishResult:
        return PublishResult(message_id, self.error, unreachable=self.unreachable)

    @classmethod
    def down(cls, error: str) -> _Outcome:
        """The broker did not answer for this chunk: not the messages' fault."""
        return cls(error, unreachable=True)

    @classmethod
    def of_response(cls, part: Any) -> _Outcome:
        if part.error_code == 0:
            return _ACKED
        error_class = kafka_errors.for_code(part.error_code)
        detail = getattr(part, "error_message", None) or error_class.__name__
        record_error = issubclass(error_class, _RECORD_ERRORS)
        return cls(f"{error_class.__name__}: {detail}", unreachable=not record_error)


_ACKED = _Outcome()
_FOLLOWS_REFUSED = _Outcome.down("not sent: an earlier message of its key was refused")


class BatchProducer:
    """Produces whole batches with ``acks=all``; one result per message, in order."""

    def __init__(
        self,
        bootstrap_servers: Sequence[str],
        *,
        client_id: str,
        request_timeout_ms: int,
        bootstrap_timeout_ms: int,
    ) -> None:
        self.request_timeout_ms = request_timeout_ms
        self._message_ids: list[str] = []  # of the call in hand, only while acks are logged
        self._client: Any = KafkaNetClient(
            bootstrap_servers=list(bootstrap_servers),
            client_id=client_id,
            request_timeout_ms=request_timeout_ms,
            # The transport replaces a client that lost its broker, so no long reconnect waits.
            reconnect_backoff_max_ms=1000,
        )
        self.client_id = client_id
        self._links: dict[Any, _Link] = {}
        self._client_polled = time.monotonic()
        try:
            self._client.get_broker_version(timeout_ms=bootstrap_timeout_ms)
            self._produce_version: int = self._client.api_version(
                ProduceRequest, max_version=_PRODUCE_MAX_VERSION
            )
        except BaseException:
            self._client.close()
            raise

    def publish(self, messages: Sequence[OutgoingMessage], deadline: float) -> list[PublishResult]:
        """Publish ``messages`` and wait until ``deadline`` (``time.monotonic``) for the acks."""
        results: list[PublishResult | None] = [None] * len(messages)
        if time.monotonic() - self._client_polled >= CLIENT_POLL_INTERVAL_S:
            self._client.poll(timeout_ms=0)
            self._client_polled = time.monotonic()
        self._message_ids = (
            [m.message_id for m in messages] if ack_log.isEnabledFor(logging.DEBUG) else []
        )
        rounds = self._chunks(messages, deadline, results)
        for chunks in _rounds(rounds):
            outcomes = self._send_round(chunks, deadline)
            for chunk in chunks:
                outcome = outcomes[chunk.partition]
                # The rest of a failed partition stays unsent: it must not overtake this chunk.
                later = [] if outcome.ok else rounds.pop(chunk.partition, [])
                for member in [chunk, *later]:
                    for i in member.indexes:
                        results[i] = outcome.of(messages[i].message_id)
        return [
            r or PublishResult(m.message_id, "not sent")
            for r, m in zip(results, messages, strict=True)
        ]

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
        self._client.close()

    # -- partitioning and encoding ----------------------------------------------------------

    def _chunks(
        self,
        messages: Sequence[OutgoingMessage],
        deadline: float,
        results: list[PublishResult | None],
    ) -> dict[TopicPartition, list[_Chunk]]:
        """Each partition's messages as record batches, in call order; fills in the results of
        messages whose topic has no metadata."""
        partitions = self._partitions({m.destination for m in messages}, deadline)
        grouped: dict[TopicPartition, list[int]] = {}
        refused: set[tuple[str, str]] = set()  # (topic, key) with a message refused in this call
        for i, message in enumerate(messages):
            of_topic = partitions[message.destination]
            key = (message.destination, message.partition_key)
            refusal = (
                _FOLLOWS_REFUSED
                if key in refused
                else (of_topic if isinstance(of_topic, _Outcome) else _size_check(message))
            )
            if refusal is not None:
                # Later messages of the key must not overtake this one: they are refused too.
                refused.add(key)
                results[i] = refusal.of(message.message_id)
                continue
            assert isinstance(of_topic, list)
            index = _partition_index(message.partition_key, len(of_topic))
            grouped.setdefault(TopicPartition(message.destination, of_topic[index]), []).append(i)
        timestamp = int(time.time() * 1000)
        return {tp: _encode(tp, indexes, messages, timestamp) for tp, indexes in grouped.items()}

    def _partitions(self, topics: set[str], deadline: float) -> dict[str, list[int] | _Outcome]:
        """Sorted partition ids per topic (fetching metadata for new topics), or why there are
        none."""
        return {topic: self._partitions_of(topic, deadline) for topic in topics}

    def _partitions_of(self, topic: str, deadline: float) -> list[int] | _Outcome:
        cluster = self._client.cluster
        if cluster.partitions_for_topic(topic) is None:
            try:
                future = cluster.add_topic(topic)
            except (TypeError, ValueError) as exc:  # not a valid topic name
                return _Outcome(f"InvalidTopicError: {exc}")
            while not future.is_done and time.monotonic() < deadline:
                self._client.poll(timeout_ms=_remaining_ms(deadline), future=future)
        known = cluster.partitions_for_topic(topic)
        if not known:
            return _Outcome.down(f"no metadata for topic {topic!r} in time")
        return sorted(known)

    # -- sending ----------------------------------------------------------------------------

    def _send_round(self, chunks: list[_Chunk], deadline: float) -> dict[TopicPartition, _Outcome]:
        """Send one chunk per partition, one request per leader, all at once; each outcome."""
        outcomes: dict[TopicPartition, _Outcome] = {}
        by_leader: dict[Any, list[_Chunk]] = {}
        for chunk in chunks:
            leader = self._client.cluster.leader_for_partition(chunk.partition)
            if leader is None or leader == -1:
                outcomes[chunk.partition] = _Outcome.down(f"no leader for {_name(chunk.partition)}")
            else:
                by_leader.setdefault(leader, []).append(chunk)
        # Every request is written before any answer is read: the leaders work side by side.
        sent = [
            (node, group, self._send(node, group, deadline)) for node, group in by_leader.items()
        ]
        for node, group, failure in sent:
            if failure is None:
                outcomes.update(self._await(node, group, deadline))
            else:
                outcomes.update((c.partition, failure) for c in group)
        if any(o.unreachable for o in outcomes.values()):
            self._client.cluster.request_update()  # a leader may have moved, or come back
        return outcomes

    def _send(self, node: Any, chunks: list[_Chunk], deadline: float) -> _Outcome | None:
        """Write the produce request of ``chunks`` to ``node``; why not, if it could not be."""
        link = self._link(node)
        if link is None:
            return _Outcome.down(f"no address for broker {node} in the cluster's metadata")
        topic_data: dict[str, list[Any]] = {}
        for chunk in chunks:
            partition = ProduceRequest.TopicProduceData.PartitionProduceData(
                index=chunk.partition.partition, records=chunk.records
            )
            topic_data.setdefault(chunk.partition.topic, []).append(partition)
        request = ProduceRequest(
            transactional_id=None,
            acks=_ACKS_ALL,
            timeout_ms=min(self.request_timeout_ms, _remaining_ms(deadline)),
            topic_data=[
                ProduceRequest.TopicProduceData(name=topic, partition_data=partitions)
                for topic, partitions in topic_data.items()
            ],
        )
        request.API_VERSION = self._produce_version
        try:
            link.send(request, deadline)
        except (OSError, kafka_errors.KafkaError) as exc:
            return self._lost(node, exc)
        return None

    def _await(
        self, node: Any, chunks: list[_Chunk], deadline: float
    ) -> dict[TopicPartition, _Outcome]:
        """Each chunk's outcome from the produce response of ``node`` (or from its absence)."""
        try:
            response = self._links[node].receive(deadline)
        except (OSError, kafka_errors.KafkaError) as exc:
            lost = self._lost(node, exc)
            return {c.partition: lost for c in chunks}
        answers = {
            TopicPartition(topic.name, part.index): _Outcome.of_response(part)
            for topic in response.responses
            for part in topic.partition_responses
        }
        missing = _Outcome.down("the broker's response left this partition out")
        if ack_log.isEnabledFor(logging.DEBUG):
            _log_acks(response, chunks, self._message_ids)
        return {c.partition: answers.get(c.partition, missing) for c in chunks}

    def _link(self, node: Any) -> _Link | None:
        link = self._links.get(node)
        if link is None:
            broker = self._client.cluster.broker_metadata(node)
            if broker is None:
                return None
            link = self._links[node] = _Link((broker.host, broker.port), self.client_id)
        return link

    def _lost(self, node: Any, exc: BaseException) -> _Outcome:
        """Close the link to ``node`` after ``exc``: whatever it had in flight is unknown."""
        self._links.pop(node).close()
        if isinstance(exc, TimeoutError):
            return _Outcome.down("not acknowledged before the publish timeout")
        return _Outcome.down(_describe(exc))


class _Link:
    """A connection to one broker for produce requests, driven by the publishing thread.

    One request at a time per link: :meth:`send` writes it, :meth:`receive` reads its answer.
    kafka-python's :class:`KafkaProtocol` frames, numbers and decodes them. After an error the
    link is closed and not used again (:meth:`BatchProducer._lost`): a request may then have been
    appended or not, which the relay answers by publishing again.
    """

    def __init__(self, address: tuple[str, int], client_id: str) -> None:
        self.address = address
        self.client_id = client_id
        self._socket: socket.socket | None = None
        self._protocol = KafkaProtocol(client_id=client_id)

    def send(self, request: Any, deadline: float) -> None:
        sock = self._connected(deadline)
        self._protocol.send_request(request)
        sock.settimeout(_remaining_s(deadline))
        sock.sendall(self._protocol.send_bytes())

    def receive(self, deadline: float) -> Any:
        """The answer to the request :meth:`send` wrote, by ``deadline``."""
        sock = self._socket
        if sock is None:
            raise ConnectionError("no request in flight")
        while True:
            sock.settimeout(_remaining_s(deadline))
            data = sock.recv(_RECEIVE_BYTES)
            if not data:
                raise ConnectionError("the broker closed the connection")
            responses = self._protocol.receive_bytes(data)
            if responses:
                return responses[0][1]

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def _connected(self, deadline: float) -> socket.socket:
        if self._socket is not None and not _open(self._socket):
            self.close()  # closed by the broker while idle: nothing was in flight, so reconnect
        if self._socket is None:
            sock = socket.create_connection(self.address, timeout=_remaining_s(deadline))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socket, self._protocol = sock, KafkaProtocol(client_id=self.client_id)
        return self._socket


def _open(sock: socket.socket) -> bool:
    """Whether an idle connection is still open and silent, without waiting.

    A broker closes connections idle for longer than its ``connections.max.idle.ms`` (10 minutes by
    default). A request written into such a socket would be reported unreachable; found here, the
    link reconnects instead. Bytes nobody asked for mean the connection is not in a known state.
    """
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)  # returns b"" once closed, or the unasked-for bytes
    except BlockingIOError:
        return True  # nothing to read: open
    except OSError:
        return False
    return False


def _log_acks(response: Any, chunks: list[_Chunk], message_ids: Sequence[str]) -> None:
    bases = {
        TopicPartition(topic.name, part.index): part.base_offset
        for topic in response.responses
        for part in topic.partition_responses
        if part.error_code == 0
    }
    for chunk in chunks:
        if chunk.partition in bases:
            line = {
                "topic": chunk.partition.topic,
                "partition": chunk.partition.partition,
                "base_offset": bases[chunk.partition],
                "ids": [message_ids[i] for i in chunk.indexes],
            }
            ack_log.debug("%s", json.dumps(line))


def _size_check(message: OutgoingMessage) -> _Outcome | None:
    """Refuse a record no broker would take (kafka-python's producer checks the same)."""
    size = len(message.value) + len(message.partition_key) + _RECORD_OVERHEAD
    size += sum(len(name) + len(value) for name, value in message.headers)
    if size <= MAX_RECORD_BYTES:
        return None
    return _Outcome(
        f"MessageSizeTooLargeError: the message is about {size} bytes, more than the"
        f" {MAX_RECORD_BYTES} bytes of a produce request"
    )


def _encode(
    partition: TopicPartition,
    indexes: list[int],
    messages: Sequence[OutgoingMessage],
    timestamp: int,
) -> list[_Chunk]:
    """The messages at ``indexes``, as record batches of at most ``MAX_BATCH_BYTES``."""
    chunks: list[_Chunk] = []
    records: list[bytes] = []
    taken: list[int] = []
    size = _BATCH_HEADER.size
    for i in indexes:
        message = messages[i]
        key = message.partition_key.encode()
        record = _record(len(records), key, message)
        if records and size + len(record) > MAX_BATCH_BYTES:
            chunks.append(_Chunk(partition, taken, _batch(records, timestamp)))
            records, taken, size = [], [], _BATCH_HEADER.size
            record = _record(0, key, message)  # its offset delta starts the new batch
        records.append(record)
        taken.append(i)
        size += len(record)
    chunks.append(_Chunk(partition, taken, _batch(records, timestamp)))
    return chunks


# -- Kafka's record batch, format v2 (magic 2), uncompressed --------------------------------------
#
# Written here rather than through kafka-python's MemoryRecordsBuilder, whose append type-checks
# and varint-encodes every field in Python: 5.4 us per record, the relay's largest single cost
# after the database. The bytes are the same as the builder's (tests/unit/test_kafka_batch.py).

#: BaseOffset, Length, PartitionLeaderEpoch, Magic, CRC, Attributes, LastOffsetDelta,
#: FirstTimestamp, MaxTimestamp, ProducerId, ProducerEpoch, BaseSequence, record count.
_BATCH_HEADER = struct.Struct(">qiibIhiqqqhii")
_CRC_AT = struct.calcsize(">qiib")
_CRC_FROM = _CRC_AT + 4  # the CRC covers everything from the attributes on
_AFTER_LENGTH = struct.calcsize(">qi")
_NO_PRODUCER = -1  # producer id, epoch and base sequence of a non-idempotent producer


def _varint(value: int) -> bytes:
    """``value`` as Kafka's zig-zag varint."""
    zigzag = (value << 1) ^ (value >> 63)
    out = bytearray()
    while zigzag > 0x7F:
        out.append((zigzag & 0x7F) | 0x80)
        zigzag >>= 7
    out.append(zigzag)
    return bytes(out)


#: Every length and offset delta below 8192 (two bytes at most), encoded once.
_VARINTS = [_varint(n) for n in range(8192)]


def _length(n: int) -> bytes:
    return _VARINTS[n] if n < 8192 else _varint(n)


def _record(offset_delta: int, key: bytes, message: OutgoingMessage) -> bytes:
    """One record: its length, then attributes 0, timestamp delta 0 (a batch has one timestamp),
    the offset delta, key, value and headers."""
    headers = message.headers
    body = b"".join(
        (
            b"\x00\x00",
            _length(offset_delta),
            _length(len(key)),
            key,
            _length(len(message.value)),
            message.value,
            _headers(headers) if headers else b"\x00",
        )
    )
    return _length(len(body)) + body


def _headers(headers: Sequence[tuple[str, bytes]]) -> bytes:
    parts = [_length(len(headers))]
    for name, value in headers:
        encoded = name.encode()
        parts += (_length(len(encoded)), encoded, _length(len(value)), value)
    return b"".join(parts)


def _batch(records: list[bytes], timestamp: int) -> bytes:
    buffer = bytearray(_BATCH_HEADER.size)
    buffer += b"".join(records)
    _BATCH_HEADER.pack_into(
        buffer,
        0,
        0,  # base offset: the broker assigns it
        len(buffer) - _AFTER_LENGTH,
        0,  # partition leader epoch: the broker's
        2,  # magic
        0,  # CRC, below
        0,  # attributes: no compression, not transactional, create time
        len(records) - 1,  # last offset delta
        timestamp,
        timestamp,
        _NO_PRODUCER,
        _NO_PRODUCER,
        _NO_PRODUCER,
        len(records),
    )
    struct.pack_into(">I", buffer, _CRC_AT, calc_crc32c(memoryview(buffer)[_CRC_FROM:]))
    return bytes(buffer)


def _rounds(chunks: dict[TopicPartition, list[_Chunk]]) -> Any:
    """Round i holds the i-th chunk of every partition still in ``chunks`` (failed ones leave)."""
    while chunks:
        yield [queue.pop(0) for queue in chunks.values()]
        for partition in [tp for tp, queue in chunks.items() if not queue]:
            del chunks[partition]


def _name(partition: TopicPartition) -> str:
    return f"{partition.topic}[{partition.partition}]"


def _remaining_ms(deadline: float) -> int:
    return max(1, int((deadline - time.monotonic()) * 1000))


def _remaining_s(deadline: float) -> float:
    """Seconds left before ``deadline``, at least a millisecond (a socket timeout of 0 would make
    it non-blocking rather than time out)."""
    return max(0.001, deadline - time.monotonic())


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "unknown error"
    text, name = str(exc), type(exc).__name__
    return name if text in ("", "None", name) else f"{name}: {text}"


# -- the Java client's partitioner ----------------------------------------------------------

_M = 0x5BD1E995
_MASK = 0xFFFFFFFF
_SEED = 0x9747B28C


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (``org.apache.kafka.common.utils.Utils.murmur2``), as an unsigned int32.

    kafka-python's copy does about 20 masked operations per byte; this one reads four bytes at a
    time and is several times faster, with the same results.
    """
    length = len(data)
    h = (_SEED ^ length) & _MASK
    words = length // 4
    for (k,) in struct.iter_unpack("<I", data[: words * 4]):
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = ((h * _M) & _MASK) ^ k
    tail = data[words * 4 :]
    if len(tail) == 3:
        h ^= tail[2] << 16
    if len(tail) >= 2:
        h ^= tail[1] << 8
    if tail:
        h ^= tail[0]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h


def partition_for(key: bytes, count: int) -> int:
    """The index (into the sorted partition ids) the default partitioner gives ``key``."""
    return (murmur2(key) & 0x7FFFFFFF) % count


@functools.lru_cache(maxsize=8192)
def _partition_index(key: str, count: int) -> int:
    """:func:`partition_for` of a partition key, remembered: a saga's commands and replies share
    its id as their key, so a worker's relay hashes each key four times or more within a second
    or two (murmur2 of a UUID takes 3.9 µs in Python; a cache hit 0.13)."""
    return partition_for(key.encode(), count)
