"""How a relay is paced: wake-ups folded into one pass, and the outbox's mute.

A relay is woken by NOTIFYs (and a worker's relay by the worker's own commits too), and under load
those come far more often than passes are worth: a pass costs a claim, a broker round trip and a
mark whether it finds one row or fifty. :class:`CoalescingWakeup` starts passes at most once every
``min_interval`` (30 ms in a worker; none for a standalone relay, whose passes follow one another
at once). Once wake-ups come while the previous pass is still running or within that interval,
they say nothing new: the relay takes the outbox's :class:`Mute` and passes on its own timer (a
standalone relay: one pass straight after another), and the writers send no NOTIFY meanwhile. A
pass that finds nothing hands the outbox back to NOTIFYs.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from typing import Any

from saga_engine import schema
from saga_engine.outbox.notify import LEAD_SESSION, OUTBOX_CHANNEL, Wakeup

log = logging.getLogger(__name__)

#: Shown in pg_stat_activity for the connection that holds a relay's mute (:class:`Mute`).
MUTE_APPLICATION_NAME = "saga-engine-mute"
#: How long a relay that let go of the mute waits for the writers that saw it (:class:`Pace`)
#: before it waits for NOTIFYs anyway; a row such a writer commits later waits for the relay's
#: poll interval at most.
UNMUTE_PATIENCE = 1.0
#: While a relay lets go of the mute, its next pass starts at a NOTIFY (writers send them again)
#: or this long after the previous one began, whichever comes first, and never before its
#: ``min_interval``. For a relay with no interval it is also a floor: such a relay must not loop
#: over empty passes while a writer that saw the mute keeps its transaction open.
UNMUTING_POLL = 0.01

#: The least time between the starts of two relay passes that wake-ups start. Every consumer
#: commit (and, on PostgreSQL, every NOTIFY) wakes the relays; a pass costs a claim, a broker round
#: trip and a mark whether it finds one row or fifty, so the commits of a few ms share one pass.
#: 30 ms rather than 10: under load a worker's relay then makes a third of the passes, each of
#: three times the rows, and in five alternated pairs of outline saga runs two workers spent 5-21 %
#: less of the machine per saga (docs/benchmarks.md, change 43). Under load a hop may wait up to
#: the interval for its pass; a relay idle for longer than the interval still runs at once.
RELAY_WAKE_INTERVAL = 0.03


class Pace(enum.Enum):
    """How a relay is woken (:class:`CoalescingWakeup`)."""

    NOTIFIED = "notified"  # by NOTIFYs (and a worker's own commits)
    #: By a timer, every min_interval (with none, one pass straight after another); the relay
    #: holds the mute: writers send no NOTIFY.
    TIMED = "timed"
    #: By the timer still (with no min_interval: a NOTIFY or UNMUTING_POLL), until every writer
    #: that saw the mute has ended.
    UNMUTING = "unmuting"


class CoalescingWakeup(Wakeup):
    """A :class:`Wakeup` whose wake-ups start passes at most once every ``min_interval`` seconds.

    A relay woken less than ``min_interval`` after its previous pass began waits out the rest, so
    that the commits of that moment join one pass; wake-ups that arrive meanwhile are folded into
    that same pass instead of each causing one more. A relay that has been idle longer runs at
    once, so a lone message gains no latency.

    When a wake-up came while the previous pass ran, or had to wait like that, and the pass then
    found rows, the outbox is busy: the leading relay takes the outbox's :class:`Mute` and passes
    every ``min_interval`` on its own, as it would have with the NOTIFYs, and the writers stop
    sending them. With a ``min_interval`` of 0 (a standalone relay) that is one pass straight after
    another, as a NOTIFY that came during each pass would have started them. A pass that finds
    nothing ends it: the relay lets go of the mute, keeps to its timer until every writer that saw
    the mute has ended, passes once more and waits for NOTIFYs again.
    """

    def __init__(
        self,
        conninfo: str | None = None,
        channel: str = OUTBOX_CHANNEL,
        *,
        lead: str | None = None,
        min_interval: float = RELAY_WAKE_INTERVAL,
    ) -> None:
        super().__init__(conninfo, channel, lead=lead)
        self.min_interval = min_interval
        self._last_pass = float("-inf")
        #: The last wake-up came while the previous pass ran, or within ``min_interval`` of its
        #: start: the NOTIFYs come faster than passes (see :meth:`_pace_by`).
        self._busy = False
        self.pace = Pace.NOTIFIED
        self._unmuted_at = float("-inf")
        self._mute = Mute(conninfo) if conninfo is not None and channel == OUTBOX_CHANNEL else None

    def wait(self, timeout: float, stop: threading.Event | None = None) -> bool:
        if self.pace is not Pace.NOTIFIED:
            return self._wait_for_timer(timeout, stop)
        pending = self.pending  # it came while the previous pass ran
        woken = super().wait(timeout, stop)
        linger = self._until_slot() if woken else 0.0
        self._busy = woken and (pending or linger > 0)
        if linger > 0:
            woken = self._sleep(linger, stop)
            # Wake-ups of the linger are covered by the pass about to claim: their commits
            # came before it. A zero wait only clears them, so they start no extra pass.
            super().wait(0.0)
        self._last_pass = time.monotonic()
        return woken

    def _wait_for_timer(self, timeout: float, stop: threading.Event | None) -> bool:
        if self.pace is Pace.UNMUTING:
            # A NOTIFY, or UNMUTING_POLL after the previous pass began; then the slot as ever.
            poll = self._last_pass + UNMUTING_POLL - time.monotonic()
            super().wait(min(timeout, max(0.0, poll)), stop)
        woken = self._sleep(min(timeout, self._until_slot()), stop)
        super().wait(0.0)  # what was notified meanwhile is the timer's pass's to find
        self._last_pass = time.monotonic()
        return woken

    def _until_slot(self) -> float:
        """Seconds until ``min_interval`` after the previous pass began (negative: past it)."""
        return self._last_pass + self.min_interval - time.monotonic()

    @staticmethod
    def _sleep(seconds: float, stop: threading.Event | None) -> bool:
        """Sleep ``seconds`` or until ``stop``; True unless stopped."""
        if stop is None:
            time.sleep(max(0.0, seconds))
            return True
        return not stop.wait(max(0.0, seconds))

    def after_pass(self, claimed: int | None) -> None:
        if self._mute is None:
            return
        try:
            self._pace_by(claimed)
        except Exception as error:  # the database is away: its session, and the mute, end with it
            log.warning("relay mute lost (%s); waiting for NOTIFYs", str(error).splitlines()[:1])
            self._mute.close()
            self.pace = Pace.NOTIFIED

    def _pace_by(self, claimed: int | None) -> None:
        assert self._mute is not None
        if self.pace is Pace.NOTIFIED:
            if claimed and self._busy and self._leads() and self._mute.on():
                self.pace = Pace.TIMED
            return
        if claimed is None:  # a failed pass waits out the poll interval: not on the timer
            self._mute.close()
            self.pace = Pace.NOTIFIED
        elif self.pace is Pace.TIMED and not claimed:
            self._mute.off()
            self.pace, self._unmuted_at = Pace.UNMUTING, time.monotonic()
        elif self.pace is Pace.UNMUTING and claimed and self._mute.on():
            self.pace = Pace.TIMED
        if self.pace is Pace.UNMUTING and not claimed and self._writers_done():
            self.pace = Pace.NOTIFIED
            self.notify()  # one more pass: the rows of the writers that saw the mute are in

    def _writers_done(self) -> bool:
        """Every writer that saw the mute has ended, or one has kept its transaction open for
        longer than :data:`UNMUTE_PATIENCE` (its rows then wait for the poll interval at most)."""
        assert self._mute is not None
        waited = time.monotonic() - self._unmuted_at
        return self._mute.writers_done() or waited >= UNMUTE_PATIENCE

    def _leads(self) -> bool:
        """Only the leading relay mutes: a follower passes for no NOTIFY anyway, and the leader
        would get none while another relay held the mute."""
        return self.lead is None or self.leads

    def stop(self) -> None:
        super().stop()
        if self._mute is not None:
            self._mute.close()
        self.pace = Pace.NOTIFIED


class Mute:
    """A relay's hold on the outbox's NOTIFYs: an advisory lock that the outbox's trigger reads
    (``schema.MUTE_LOCK_SPACE``), on a connection of its own.

    While the lock is held, a writer's trigger finds it taken and sends no NOTIFY; the relay
    holding it must pass on a timer of its own. A relay that lets go of the mute must not go back
    to waiting for NOTIFYs until :meth:`writers_done`: a writer that found the mute held may
    still be about to commit, and only a pass after its commit sees its rows. Such a writer takes
    the writers' lock (``schema.WRITERS_LOCK_SPACE``, shared, until its transaction ends) and
    then looks at the mute again, sending its NOTIFY if it is free by then. So once the relay has
    let go of the mute and then held the writers' lock alone for a moment, every writer that
    stayed silent has ended, and every later one sends a NOTIFY.
    """

    def __init__(self, conninfo: str) -> None:
        self.conninfo = conninfo
        key = schema.OUTBOX_LOCK_KEY
        mute, writers = schema.MUTE_LOCK_SPACE, schema.WRITERS_LOCK_SPACE
        # NULL while the table does not exist: no mute.
        self._on = f"SELECT pg_try_advisory_lock({mute}, {key})"
        self._off = f"SELECT pg_advisory_unlock({mute}, {key})"
        self._writers_done = (
            f"SELECT CASE WHEN pg_try_advisory_lock({writers}, {key}) "
            f"THEN pg_advisory_unlock({writers}, {key}) ELSE false END"
        )
        self._conn: Any = None

    def on(self) -> bool:
        """Try to take the mute; False when a writer was looking at it just then."""
        return self._ask(self._on)

    def off(self) -> None:
        self._ask(self._off)

    def writers_done(self) -> bool:
        """Has every writer that may have seen the mute ended? (Ask after :meth:`off`.)"""
        return self._ask(self._writers_done)

    def close(self) -> None:
        """Close the connection, which lets go of the mute if it is held."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _ask(self, statement: str) -> bool:
        import psycopg

        if self._conn is None:
            self._conn = psycopg.connect(
                self.conninfo,
                autocommit=True,
                connect_timeout=5,
                application_name=MUTE_APPLICATION_NAME,
            )
            # A relay whose host vanishes must not keep the writers silent for hours.
            self._conn.execute(LEAD_SESSION)
        row = self._conn.execute(statement).fetchone()
        return bool(row and row[0])
