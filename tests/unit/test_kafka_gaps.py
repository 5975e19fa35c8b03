"""GapGuard: a partition's records are delivered only while their offsets follow each other."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import pytest

from saga_engine.transport.kafka_gaps import GapGuard

P = ("orders.replies", 0)
Q = ("orders.replies", 1)


class RecordDouble(NamedTuple):
    offset: int


class ClockDouble:
    """Seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def records(*offsets: int) -> list[RecordDouble]:
    return [RecordDouble(offset) for offset in offsets]


def offsets(taken: Sequence[RecordDouble]) -> list[int]:
    return [record.offset for record in taken]


def guard(patience: float = 1.0) -> tuple[GapGuard, ClockDouble]:
    clock = ClockDouble()
    return GapGuard(patience=patience, clock=clock), clock


def test_a_partitions_first_records_and_consecutive_ones_are_delivered_whole() -> None:
    gaps, _ = guard()
    # Nothing is known of a partition before its first records: they start where the group says.
    assert gaps.take(P, records(40, 41, 42)) == (records(40, 41, 42), None)
    assert gaps.take(P, records(43, 44)) == (records(43, 44), None)
    assert gaps.take(P, []) == ([], None)
    assert gaps.take(Q, records(7)) == (records(7), None)  # each partition on its own


def test_a_gap_inside_a_poll_delivers_what_precedes_it_and_seeks_back_to_it() -> None:
    gaps, _ = guard()
    gaps.take(P, records(0, 1))
    taken, seek = gaps.take(P, records(2, 3, 7, 8))
    assert offsets(taken) == [2, 3]
    assert seek == 4
    # Read again once the broker stored the batch: the gap fills and reading goes on.
    assert gaps.take(P, records(4, 5, 6, 7, 8)) == (records(4, 5, 6, 7, 8), None)
    assert gaps.take(P, records(9)) == (records(9), None)


def test_a_gap_at_the_start_of_a_poll_delivers_nothing_of_that_partition() -> None:
    gaps, _ = guard()
    gaps.take(P, records(10, 11))
    assert gaps.take(P, records(15, 16)) == ([], 12)
    assert gaps.take(Q, records(3)) == (records(3), None)  # other partitions are not held up


def test_a_gap_is_read_again_until_the_patience_runs_out_then_taken_as_real(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gaps, clock = guard(patience=1.0)
    gaps.take(P, records(0))
    with caplog.at_level(logging.INFO, logger="saga_engine.transport.kafka_gaps"):
        assert gaps.take(P, records(3, 4)) == ([], 1)
        clock.now += 0.6
        assert gaps.take(P, records(3, 4)) == ([], 1)
        clock.now += 0.6
        assert gaps.take(P, records(3, 4)) == (records(3, 4), None)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "offsets 1 to 2 did not arrive in 1.0 s" in warnings[0].getMessage()
    # The next gap gets its own patience.
    clock.now += 5
    assert gaps.take(P, records(6)) == ([], 5)
    clock.now += 0.5
    assert gaps.take(P, records(5, 6)) == (records(5, 6), None)


def test_a_rebalance_forgets_and_a_release_rewinds_the_offset_expected() -> None:
    gaps, _ = guard()
    gaps.take(P, records(0, 1, 2))
    gaps.forget([P])
    # Assigned anew: it goes on from the committed offset, whatever that is.
    assert gaps.take(P, records(9)) == (records(9), None)
    gaps.rewound(P, 4)  # the consumer sought back to 4 to deliver it again
    assert gaps.take(P, records(4, 5)) == (records(4, 5), None)
    assert gaps.take(P, records(8)) == ([], 6)
