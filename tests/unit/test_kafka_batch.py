"""The batch producer's pure parts: the partitioner, the record batches, the record-size refusal,
the ack log, and how a link tells an open idle connection from one the broker closed."""

from __future__ import annotations

import json
import socket
import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

from saga_engine.transport.base import OutgoingMessage
from saga_engine.transport.kafka_batch import (
    MAX_BATCH_BYTES,
    MAX_RECORD_BYTES,
    _encode,
    _open,
    _partition_index,
    _size_check,
    murmur2,
    partition_for,
)

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", r"(read|open)_text is deprecated", DeprecationWarning)
    from kafka.partitioner.default import murmur2 as kafka_murmur2
    from kafka.record.memory_records import MemoryRecords, MemoryRecordsBuilder
    from kafka.structs import TopicPartition


@given(st.binary(max_size=80))
def test_murmur2_matches_kafka_pythons_copy_of_the_java_client(data: bytes) -> None:
    assert murmur2(data) == kafka_murmur2(data)


def test_murmur2_known_values_of_the_java_client() -> None:
    # org.apache.kafka.common.utils.UtilsTest.testMurmur2 (signed there; unsigned here).
    cases = {b"21": -973932308, b"foobar": -790332482, b"a-little-bit-long-string": -985981536}
    for data, signed in cases.items():
        assert murmur2(data) == signed & 0xFFFFFFFF


@given(st.binary(max_size=40), st.integers(min_value=1, max_value=64))
def test_partition_index_is_in_range_and_follows_the_default_partitioner(
    key: bytes, count: int
) -> None:
    index = partition_for(key, count)
    assert 0 <= index < count
    assert index == (kafka_murmur2(key) & 0x7FFFFFFF) % count


@given(st.text(max_size=40), st.integers(min_value=1, max_value=64))
def test_the_remembered_partition_of_a_key_is_the_partitioners_every_time(
    key: str, count: int
) -> None:
    expected = (kafka_murmur2(key.encode()) & 0x7FFFFFFF) % count
    assert _partition_index(key, count) == expected
    assert _partition_index(key, count) == expected  # from the cache this time


def test_a_record_larger_than_a_produce_request_is_refused_before_sending() -> None:
    small = OutgoingMessage("m1", "t", "k", b"x" * 1000)
    large = OutgoingMessage("m2", "t", "k", b"x" * (MAX_RECORD_BYTES + 1))
    assert _size_check(small) is None
    refusal = _size_check(large)
    assert refusal is not None and not refusal.ok and not refusal.unreachable
    assert "MessageSizeTooLarge" in str(refusal.error)


def test_acknowledged_batches_are_logged_with_their_offsets_at_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The line ``bench relay --log-acks`` reads: the broker's base offset, ids in offset order."""
    from types import SimpleNamespace

    from kafka.structs import TopicPartition

    from saga_engine.transport import kafka_batch

    response_double = SimpleNamespace(
        responses=[
            SimpleNamespace(
                name="t",
                partition_responses=[
                    SimpleNamespace(index=0, error_code=0, base_offset=5),
                    SimpleNamespace(index=1, error_code=6, base_offset=-1),  # refused: not logged
                ],
            )
        ]
    )
    chunks = [
        kafka_batch._Chunk(TopicPartition("t", 0), [2, 0], b""),
        kafka_batch._Chunk(TopicPartition("t", 1), [1], b""),
    ]
    with caplog.at_level("DEBUG", logger=kafka_batch.ack_log.name):
        kafka_batch._log_acks(response_double, chunks, ["a", "b", "c"])
    lines = [json.loads(r.getMessage()) for r in caplog.records]
    assert lines == [{"topic": "t", "partition": 0, "base_offset": 5, "ids": ["c", "a"]}]


# -- record batches ---------------------------------------------------------------------------

HEADERS = st.lists(st.tuples(st.text(max_size=12), st.binary(max_size=20)), max_size=3)
MESSAGES = st.lists(
    st.builds(
        lambda n, key, value, headers: OutgoingMessage(f"m{n}", "t", key, value, tuple(headers)),
        st.integers(),
        st.text(max_size=30),
        st.binary(max_size=300),
        HEADERS,
    ),
    min_size=1,
    max_size=40,
)


def builder_batches(messages: list[OutgoingMessage], timestamp: int, limit: int) -> list[bytes]:
    """kafka-python's MemoryRecordsBuilder, filled the way its producer fills one."""
    batches, builder = [], MemoryRecordsBuilder(magic=2, compression_type=0, batch_size=limit)
    for m in messages:
        args = (timestamp, m.partition_key.encode(), m.value, list(m.headers))
        if builder.append(*args) is None:
            builder.close()
            batches.append(bytes(builder.buffer()))
            builder = MemoryRecordsBuilder(magic=2, compression_type=0, batch_size=limit)
            builder.append(*args)
    builder.close()
    return [*batches, bytes(builder.buffer())]


@given(MESSAGES, st.integers(min_value=0, max_value=2**41))
def test_record_batches_are_the_bytes_kafka_pythons_builder_writes(
    messages: list[OutgoingMessage], timestamp: int
) -> None:
    chunks = _encode(TopicPartition("t", 0), list(range(len(messages))), messages, timestamp)
    assert [c.records for c in chunks] == builder_batches(messages, timestamp, MAX_BATCH_BYTES)
    assert [i for c in chunks for i in c.indexes] == list(range(len(messages)))


def test_a_partition_over_the_batch_limit_is_split_where_the_builder_splits_it() -> None:
    value = b"v" * 100_000  # 512 KiB holds five of these, not six
    messages = [OutgoingMessage(f"m{i}", "t", f"k{i}", value) for i in range(12)]
    chunks = _encode(TopicPartition("t", 3), list(range(12)), messages, 1_700_000_000_000)
    assert [c.indexes for c in chunks] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11]]
    assert [c.records for c in chunks] == builder_batches(
        messages, 1_700_000_000_000, MAX_BATCH_BYTES
    )
    for chunk in chunks:  # and a reader takes them back, CRC and all
        batch = MemoryRecords(chunk.records).next_batch()
        assert batch.validate_crc()
        records = list(batch)
        assert [r.key for r in records] == [
            messages[i].partition_key.encode() for i in chunk.indexes
        ]
        assert [r.offset for r in records] == list(range(len(chunk.indexes)))
        assert all(r.value == value and r.timestamp == 1_700_000_000_000 for r in records)


# -- idle connections ---------------------------------------------------------------------------


def test_an_idle_connection_is_open_until_its_peer_closes_it_or_says_something_unasked() -> None:
    ours, brokers = socket.socketpair()
    with ours, brokers:
        assert _open(ours)
        assert _open(ours)  # looking did not consume anything
        brokers.sendall(b"x")  # no request is in flight: bytes now mean a confused connection
        assert not _open(ours)
    closed, peer = socket.socketpair()
    with closed:
        peer.close()
        assert not _open(closed)
