"""Envelopes on the wire, typed payloads, the registry and message ids (no services)."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from datetime import UTC, datetime
from decimal import Decimal

import pydantic
import pytest

from saga_engine import errors, ids
from saga_engine.messages import Envelope, Message, MessageRegistry, wire_bytes


class ReserveStock(Message):
    order_id: str
    quantity: int
    price: Decimal


class Renamed(Message):
    message_type = "inventory.StockReleased.v2"
    order_id: str


def test_envelope_defaults_a_time_ordered_id_and_an_aware_timestamp() -> None:
    envelope = Envelope(message_type="X", destination="d", partition_key="k")
    assert uuid.UUID(envelope.message_id).version == 7
    assert envelope.created_at.tzinfo is not None
    assert abs((datetime.now(UTC) - envelope.created_at).total_seconds()) < 5
    with pytest.raises(pydantic.ValidationError):
        envelope.destination = "elsewhere"  # type: ignore[misc]  # frozen


def test_envelope_of_a_typed_message() -> None:
    message = ReserveStock(order_id="o-1", quantity=2, price=Decimal("9.90"))
    envelope = Envelope.of(message, destination="inventory", partition_key="o-1", tenant_id="t1")
    assert envelope.message_type == "ReserveStock"
    assert envelope.payload == {"order_id": "o-1", "quantity": 2, "price": "9.90"}
    assert envelope.tenant_id == "t1"
    assert Envelope.of(Renamed(order_id="o"), destination="d", partition_key="o").message_type == (
        "inventory.StockReleased.v2"
    )
    with pytest.raises(pydantic.ValidationError):
        ReserveStock(order_id="o", quantity=1, price=Decimal(1), surprise=True)  # type: ignore[call-arg]


def test_wire_round_trip() -> None:
    envelope = Envelope(
        message_type="OrderCreated",
        destination="orders.events",
        partition_key="o-1",
        correlation_id="saga-1",
        causation_id="m-0",
        headers={"trace": "abc"},
        payload={"order_id": "o-1", "note": "Grüße, 订单", "items": [{"sku": "a", "n": 2}]},
    )
    assert Envelope.from_wire(envelope.to_wire()) == envelope


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"not json",
        b"\xff\xfe\x00",
        b"[1, 2]",
        b'{"message_type": "X"}',
        b'{"message_type": "X", "destination": "d", "partition_key": "k", "payload": [1]}',
        json.dumps(
            {"message_type": "X", "destination": "d", "partition_key": "k", "message_id": "x" * 65}
        ).encode(),
    ],
    ids=["empty", "text", "not-utf8", "array", "missing-fields", "payload-array", "long-id"],
)
def test_bad_bytes_raise_decode_error(raw: bytes) -> None:
    with pytest.raises(errors.DecodeError, match="validation error") as caught:
        Envelope.from_wire(raw)
    assert isinstance(caught.value, errors.SagaEngineError)


def test_wire_bytes_splices_the_stored_headers_and_payload() -> None:
    payload = {"order_id": "o-1", "note": "naïve", "n": [1, 2.5, None]}
    headers = {"saga_id": "s-1", "step": "reserve"}
    raw = wire_bytes(
        {"message_type": "X", "destination": "d", "partition_key": "k", "message_id": "m-1"},
        json.dumps(headers),
        json.dumps(payload, ensure_ascii=False),
    )
    decoded = Envelope.from_wire(raw)
    assert (decoded.message_id, decoded.payload, decoded.headers) == ("m-1", payload, headers)
    assert json.loads(raw)["payload"] == payload


def test_registry_decodes_known_types_and_rejects_the_rest() -> None:
    registry = MessageRegistry()
    registry.register(ReserveStock)
    registry.register(ReserveStock)  # the same class again is fine
    assert "ReserveStock" in registry and "Renamed" not in registry
    message = ReserveStock(order_id="o-1", quantity=1, price=Decimal("1.5"))
    envelope = Envelope.of(message, destination="inventory", partition_key="o-1")
    assert registry.decode(envelope) == message

    with pytest.raises(errors.DecodeError, match="unknown message type 'Nope'"):
        registry.decode(envelope.model_copy(update={"message_type": "Nope"}))
    wrong = envelope.model_copy(update={"payload": {"order_id": "o-1", "quantity": "many"}})
    with pytest.raises(errors.DecodeError, match="payload does not match ReserveStock"):
        registry.decode(wrong)

    class ReserveStockAgain(Message):
        message_type = "ReserveStock"

    with pytest.raises(errors.DefinitionError, match="declared twice"):
        registry.register(ReserveStockAgain)


# -- ids ----------------------------------------------------------------------------------------


def test_uuid7_ids_are_unique_and_monotonic() -> None:
    generated = [ids.new_id() for _ in range(20_000)]
    assert len(set(generated)) == len(generated)
    assert generated == sorted(generated)  # the string order is the time order
    first = uuid.UUID(generated[0])
    assert (first.version, first.variant) == (7, uuid.RFC_4122)
    assert abs((first.int >> 80) - time.time_ns() // 1_000_000) < 10_000
    assert all(len(i) == 36 for i in generated[:10])


def test_uuid7_stays_monotonic_within_one_millisecond_and_when_the_clock_steps_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ids, "_last_ms", ids._last_ms)  # restored afterwards
    monkeypatch.setattr(ids, "_counter", ids._counter)
    frozen = time.time_ns() + 1_000_000_000
    monkeypatch.setattr(ids.time, "time_ns", lambda: frozen)
    same_ms = [ids.uuid7() for _ in range(5000)]  # more than the 12-bit counter holds
    monkeypatch.setattr(ids.time, "time_ns", lambda: frozen - 60_000_000_000)  # a minute back
    stepped_back = [ids.uuid7() for _ in range(10)]
    generated = same_ms + stepped_back
    assert [u.int for u in generated] == sorted(u.int for u in generated)
    assert len({u.int for u in generated}) == len(generated)


def test_a_forked_child_never_repeats_its_parents_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """Random bits are drawn a block at a time: a child must not reuse the parent's block."""
    monkeypatch.setattr(ids, "_last_ms", ids._last_ms)  # restored afterwards
    monkeypatch.setattr(ids, "_counter", ids._counter)
    frozen = time.time_ns() + 2_000_000_000  # one millisecond for both, and the same counter
    monkeypatch.setattr(ids.time, "time_ns", lambda: frozen)
    ids.new_id()  # the parent holds a block of random bytes now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent, and out
        os.write(write, " ".join(ids.new_id() for _ in range(5)).encode())
        os._exit(0)
    os.close(write)
    parent = {ids.new_id() for _ in range(5)}
    with os.fdopen(read) as pipe:
        child = set(pipe.read().split())
    assert os.waitpid(pid, 0)[1] == 0
    assert len(child) == 5 and not parent & child


def test_uuid7_is_unique_across_threads() -> None:
    results: list[list[str]] = [[] for _ in range(4)]

    def make(slot: int) -> None:
        results[slot] = [ids.new_id() for _ in range(3000)]

    threads = [threading.Thread(target=make, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    everything = [i for chunk in results for i in chunk]
    assert len(set(everything)) == 12_000
    assert all(chunk == sorted(chunk) for chunk in results)
