"""Relay wake-ups: commits a few ms apart share one relay pass, and a busy relay mutes NOTIFYs."""

from __future__ import annotations

import threading
import time

import pytest

from saga_engine.outbox import pacing
from saga_engine.outbox.pacing import CoalescingWakeup, Pace


def test_an_idle_relay_is_woken_at_once() -> None:
    wakeup = CoalescingWakeup(min_interval=0.5)
    wakeup.notify()
    began = time.monotonic()
    assert wakeup.wait(5.0) is True
    assert time.monotonic() - began < 0.25


def test_a_wake_up_soon_after_a_pass_waits_out_the_interval_and_folds_later_ones_in() -> None:
    wakeup = CoalescingWakeup(min_interval=0.3)
    wakeup.notify()
    assert wakeup.wait(5.0)  # a pass starts now
    wakeup.notify()
    began = time.monotonic()
    threading.Timer(0.1, wakeup.notify).start()  # arrives during the linger
    assert wakeup.wait(5.0) is True
    assert 0.25 <= time.monotonic() - began < 1.0
    # The wake-up of the linger was covered by that pass: nothing is pending now.
    assert wakeup.wait(0.05) is False


def test_a_stop_during_the_linger_is_not_a_wake_up() -> None:
    wakeup = CoalescingWakeup(min_interval=2.0)
    wakeup.notify()
    assert wakeup.wait(5.0)
    stop = threading.Event()
    wakeup.notify()
    threading.Timer(0.1, stop.set).start()
    began = time.monotonic()
    assert wakeup.wait(5.0, stop) is False
    assert time.monotonic() - began < 1.0


# -- the mute: a relay under load passes on its own timer -----------------------------------------


class MuteDouble:
    """A test double of ``pacing.Mute``: records what the wake-up asked, answers as told."""

    def __init__(self, *, on: bool = True, writers_done: bool = True) -> None:
        self.answers = {"on": on, "writers_done": writers_done}
        self.calls: list[str] = []
        self.fail = False

    def on(self) -> bool:
        return self._ask("on")

    def off(self) -> None:
        self._ask("off")

    def writers_done(self) -> bool:
        return self._ask("writers_done")

    def close(self) -> None:
        self.calls.append("close")

    def _ask(self, what: str) -> bool:
        self.calls.append(what)
        if self.fail:
            raise OSError("server closed the connection")
        return self.answers.get(what, True)


def muted_wakeup(mute: MuteDouble, min_interval: float = 0.05) -> CoalescingWakeup:
    wakeup = CoalescingWakeup(min_interval=min_interval)
    wakeup._mute = mute  # type: ignore[assignment]
    return wakeup


def pace_of(wakeup: CoalescingWakeup) -> Pace:
    return wakeup.pace  # read through a call: mypy narrows an attribute between asserts


def busy(wakeup: CoalescingWakeup, claimed: int = 10) -> None:
    """A pass whose wake-up came within ``min_interval`` of the previous pass, then found rows."""
    wakeup.notify()
    wakeup.wait(1.0)
    wakeup.notify()
    wakeup.wait(1.0)  # lingered
    wakeup.after_pass(claimed)


def test_wake_ups_faster_than_the_interval_and_rows_found_take_the_mute() -> None:
    mute = MuteDouble()
    wakeup = muted_wakeup(mute)
    busy(wakeup)
    assert wakeup.pace is Pace.TIMED
    assert mute.calls == ["on"]


def test_a_relay_without_an_interval_mutes_when_wake_ups_come_during_its_passes() -> None:
    """A standalone relay (``min_interval`` 0): a wake-up already pending when the relay waits
    came while its pass ran; with rows found, it mutes and passes straight after one another."""
    mute = MuteDouble()
    wakeup = muted_wakeup(mute, min_interval=0.0)
    threading.Timer(0.05, wakeup.notify).start()
    assert wakeup.wait(1.0)  # came while it waited: an idle relay
    wakeup.after_pass(5)
    assert wakeup.pace is Pace.NOTIFIED and mute.calls == []

    wakeup.notify()  # during the pass
    began = time.monotonic()
    assert wakeup.wait(1.0)
    wakeup.after_pass(5)
    assert pace_of(wakeup) is Pace.TIMED and mute.calls == ["on"]
    assert wakeup.wait(1.0) is True  # the timer: the next pass at once, without a NOTIFY
    assert time.monotonic() - began < 0.1


def test_a_lone_wake_up_or_an_empty_pass_keeps_waiting_for_notifies() -> None:
    mute = MuteDouble()
    wakeup = muted_wakeup(mute)
    threading.Timer(0.1, wakeup.notify).start()
    assert wakeup.wait(1.0)
    wakeup.after_pass(5)  # found rows, but its wake-up came while the relay waited, long idle
    busy(wakeup, claimed=0)  # came quickly, found nothing
    assert wakeup.pace is Pace.NOTIFIED
    assert mute.calls == []


def test_a_relay_that_cannot_take_the_mute_or_does_not_lead_keeps_waiting_for_notifies() -> None:
    refused = muted_wakeup(MuteDouble(on=False))
    busy(refused)
    following = muted_wakeup(MuteDouble())
    following.lead, following._lead_held = "SELECT true", False
    busy(following)
    assert (refused.pace, following.pace) == (Pace.NOTIFIED, Pace.NOTIFIED)


def test_a_muted_relay_is_woken_by_its_timer_without_a_notify() -> None:
    wakeup = muted_wakeup(MuteDouble(), min_interval=0.2)
    busy(wakeup)
    began = time.monotonic()
    assert wakeup.wait(5.0) is True
    assert 0.1 <= time.monotonic() - began < 1.0


def test_an_empty_pass_lets_go_of_the_mute_and_waits_for_the_writers_that_saw_it() -> None:
    mute = MuteDouble(writers_done=False)
    wakeup = muted_wakeup(mute)
    busy(wakeup)
    wakeup.after_pass(0)
    assert wakeup.pace is Pace.UNMUTING  # still on the timer: a writer that saw it may commit
    assert mute.calls == ["on", "off", "writers_done"]

    mute.answers["writers_done"] = True
    wakeup.after_pass(0)
    assert pace_of(wakeup) is Pace.NOTIFIED
    # One more pass at once, for the rows of those writers.
    assert wakeup.wait(0.5) is True


def test_a_relay_without_an_interval_letting_go_passes_at_a_notify_or_the_unmuting_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not one empty pass after another while a writer that saw the mute stays open."""
    monkeypatch.setattr(pacing, "UNMUTING_POLL", 0.3)
    wakeup = muted_wakeup(MuteDouble(writers_done=False), min_interval=0.0)
    busy(wakeup)
    wakeup.after_pass(0)
    assert wakeup.pace is Pace.UNMUTING
    began = time.monotonic()
    assert wakeup.wait(5.0) is True  # no NOTIFY: the poll
    assert 0.25 <= time.monotonic() - began < 1.0

    wakeup.notify()  # a writer that did not see the mute
    began = time.monotonic()
    assert wakeup.wait(5.0) is True
    assert time.monotonic() - began < 0.2


def test_rows_found_while_letting_go_take_the_mute_again() -> None:
    mute = MuteDouble(writers_done=False)
    wakeup = muted_wakeup(mute)
    busy(wakeup)
    wakeup.after_pass(0)
    wakeup.after_pass(3)
    assert wakeup.pace is Pace.TIMED
    assert mute.calls == ["on", "off", "writers_done", "on"]


def test_writers_that_stay_open_are_waited_for_no_longer_than_the_patience(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pacing, "UNMUTE_PATIENCE", 0.1)
    wakeup = muted_wakeup(MuteDouble(writers_done=False))
    busy(wakeup)
    wakeup.after_pass(0)
    time.sleep(0.15)
    wakeup.after_pass(0)
    assert wakeup.pace is Pace.NOTIFIED


def test_a_failed_pass_or_a_lost_mute_connection_goes_back_to_notifies() -> None:
    failed = MuteDouble()
    wakeup = muted_wakeup(failed)
    busy(wakeup)
    wakeup.after_pass(None)
    assert wakeup.pace is Pace.NOTIFIED and failed.calls[-1] == "close"

    lost = MuteDouble()
    wakeup = muted_wakeup(lost)
    busy(wakeup)
    lost.fail = True
    wakeup.after_pass(0)  # off() raises: the session, and the mute with it, are gone
    assert wakeup.pace is Pace.NOTIFIED and lost.calls[-1] == "close"


def test_without_a_database_to_mute_the_pace_never_changes() -> None:
    wakeup = CoalescingWakeup(min_interval=0.05)  # no conninfo: no listener, no mute
    busy(wakeup)
    assert wakeup.pace is Pace.NOTIFIED


def test_a_relays_wake_up_listens_on_postgresql_only() -> None:
    # Built from the engine's URL, no connection made: PostgreSQL's for psycopg, with the password
    # (the listener logs in with it); elsewhere no listener, so no lead to try for either.
    import sqlalchemy as sa

    from saga_engine.outbox.notify import listen_conninfo
    from saga_engine.outbox.relay import relay_wakeup

    postgres = sa.create_engine("postgresql+psycopg://orders:secret@db.example:5433/shop")
    sqlite = sa.create_engine("sqlite://")
    try:
        assert listen_conninfo(postgres) == "postgresql://orders:secret@db.example:5433/shop"
        assert relay_wakeup(postgres).lead is not None
        wakeup = relay_wakeup(sqlite)
        assert (wakeup.conninfo, wakeup.lead) == (None, None)
    finally:
        postgres.dispose()
        sqlite.dispose()
