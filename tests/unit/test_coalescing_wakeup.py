"""The worker's relay wake-ups: commits a few ms apart share one relay pass."""

from __future__ import annotations

import threading
import time

from saga_engine.worker import CoalescingWakeup


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
