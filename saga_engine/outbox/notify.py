"""Wake-ups for relays and consumers: PostgreSQL LISTEN/NOTIFY as a hint, never as the truth.

An AFTER INSERT trigger on ``outbox_messages`` (and ``transport_messages``) sends a NOTIFY at
commit. A listener thread on its own autocommit connection waits for them and sets an event; the
relay waits on "notified OR poll interval OR stop". Notifications sent while the listener was
disconnected are lost, which is why polling stays: after every reconnect the listener wakes the relay
once so it looks for whatever arrived meanwhile. While a wake-up waits for its relay to take it,
the listener reads nothing more: the NOTIFYs of that time say nothing new, and are read together
once it is taken, so a busy relay's listener wakes about once per pass, not once per commit.

A NOTIFY reaches every listener, so with several relays on one outbox each wake-up would start a
pass in each of them, every pass carrying a share of the same few rows for the full cost of a claim,
a broker round trip and a mark. So relays' listeners also try for a *lead* (``lead``: a statement
taking a session-level advisory lock, which the listener's connection holds until it closes). The
relay whose listener leads runs the passes that wake-ups start; the others leave them to it
(``follower``) and pass on their poll timer only. As every commit's NOTIFY reaches the leader,
no row waits longer for it; a follower tries for the lead again at every liveness probe. A
follower does not listen meanwhile (UNLISTEN): each NOTIFY would wake its server session, its
listener thread and its relay for nothing, at every commit. When it takes the lead it listens
again and wakes its relay once, for whatever was committed while it did not listen.

Under load the NOTIFYs say nothing new, and they are not free: PostgreSQL serializes the commits
of every transaction that sent one and signals every listener at each. The leading relay then
passes on a timer of its own (a standalone relay: one pass straight after another) and holds the
outbox's *mute*, an advisory lock the outbox's trigger looks at: while it is held, writers send no
NOTIFY (``saga_engine.outbox.pacing``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from sqlalchemy import Engine

log = logging.getLogger(__name__)

OUTBOX_CHANNEL = "saga_engine_outbox"
TRANSPORT_CHANNEL = "saga_engine_transport"
LIVENESS_PROBE_SECONDS = 1.0
RECONNECT_DELAY_SECONDS = 1.0
#: How often a wait looks at its stop event: a signal handler only sets the event, it cannot
#: wake a thread blocked on another one, and a long poll interval must not delay shutdown.
STOP_CHECK_SECONDS = 0.1
#: Shown in pg_stat_activity, so operators (and tests) can tell the listener from pooled sessions.
APPLICATION_NAME = "saga-engine-listen"
#: Run by a listener that tries for the lead (and by a relay's mute, ``pacing.Mute``): the server
#: ends the session of a leader whose host vanished (no FIN, no RST) within about 30 s, instead of
#: after the system's TCP defaults (two hours of keepalive idle time, or some 15 minutes of
#: unanswered NOTIFYs), so the lead moves on (and the mute is let go).
#: Each setting only where the server has it (``tcp_user_timeout`` is new in PostgreSQL 12).
LEAD_SESSION = (
    "SELECT set_config(name, value, false) FROM (VALUES ('tcp_keepalives_idle', '10'), "
    "('tcp_keepalives_interval', '5'), ('tcp_keepalives_count', '3'), "
    "('tcp_user_timeout', '30000')) AS wanted (name, value) "
    "WHERE name IN (SELECT name FROM pg_settings)"
)


def listen_conninfo(engine: Engine) -> str | None:
    """The connection a wake-up on ``engine``'s database listens on: its URL for psycopg on
    PostgreSQL, None elsewhere (no NOTIFY: the wake-up is a plain in-process event)."""
    if engine.dialect.name != "postgresql":
        return None
    return engine.url.set(drivername="postgresql").render_as_string(hide_password=False)


class Wakeup:
    """An event set by NOTIFY (when listening) or by :meth:`notify`; waited on with a timeout."""

    def __init__(
        self, conninfo: str | None = None, channel: str = OUTBOX_CHANNEL, *, lead: str | None = None
    ) -> None:
        self.conninfo = conninfo
        self.channel = channel
        #: A statement that tries for a session-level lock and says whether it got it (see the
        #: module's docstring); None: this listener does not take part in leading (nor does a
        #: wake-up with no connection, which has no session to hold the lock in).
        self.lead = lead if conninfo is not None else None
        #: What the last try for the lead got: True (this one leads), False (another listener
        #: does), None (not tried on this connection yet, not connected, or no outbox table).
        self._lead_held: bool | None = None
        self._event = threading.Event()
        #: Set each time a waiter takes the wake-up, and by :meth:`stop` (see :meth:`_until_taken`).
        self._taken = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def follower(self) -> bool:
        """Another listener holds the lead: this one's wake-ups are left to it."""
        return self._lead_held is False

    @property
    def leads(self) -> bool:
        """This listener holds the lead."""
        return self._lead_held is True

    def notify(self) -> None:
        self._event.set()

    @property
    def pending(self) -> bool:
        """A wake-up is waiting to be taken."""
        return self._event.is_set()

    def after_pass(self, claimed: int | None) -> None:
        """Told by the relay after each pass how many rows it claimed (None: the pass failed).
        A plain wake-up has no use for it; a ``pacing.CoalescingWakeup`` paces its relay by it."""

    def wait(self, timeout: float, stop: threading.Event | None = None) -> bool:
        """Wait for a wake-up, the timeout or ``stop``; True if woken."""
        deadline = time.monotonic() + timeout
        woken = False
        while not woken and not (stop is not None and stop.is_set()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            woken = self._event.wait(
                remaining if stop is None else min(remaining, STOP_CHECK_SECONDS)
            )
        self._event.clear()
        self._taken.set()
        return woken and not (stop is not None and stop.is_set())

    def start(self) -> None:
        if self.conninfo is None or self._thread is not None:
            return
        self._stopping.clear()
        self._thread = threading.Thread(
            target=self._listen_forever, name="saga-engine-listen", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._event.set()
        self._taken.set()  # a listener waiting for its wake-up to be taken stops waiting
        if self._thread is not None:
            self._thread.join(LIVENESS_PROBE_SECONDS + 1)
            self._thread = None

    def _listen_forever(self) -> None:
        while not self._stopping.is_set():
            try:
                self._listen_once()
            except Exception as error:  # the listener must outlive any database trouble
                log.warning(
                    "LISTEN %s lost (%s); reconnecting",
                    self.channel,
                    str(error).strip().splitlines()[:1],
                )
            self._stopping.wait(RECONNECT_DELAY_SECONDS)

    def _listen_once(self) -> None:
        import psycopg

        assert self.conninfo is not None
        with psycopg.connect(
            self.conninfo, autocommit=True, connect_timeout=5, application_name=APPLICATION_NAME
        ) as conn:
            try:
                # Listening wakes the relay once: what was notified while it was away is in the
                # table. A follower stays deaf and asleep: that is the leader's to pass for.
                self._try_lead_then_listen(conn, first=True)
                probed = time.monotonic()
                while not self._stopping.is_set():
                    self._until_taken(LIVENESS_PROBE_SECONDS)
                    for _ in _notifies(conn):
                        # One is enough: the rest say the same thing. They wait in the socket
                        # and are read together after the relay has taken this wake-up.
                        self._event.set()
                        break
                    if time.monotonic() - probed >= LIVENESS_PROBE_SECONDS:
                        # Liveness: a dead connection raises here. Until it leads, the probe is
                        # its next try for the lead (the leader's connection may have gone).
                        if self.lead is not None and self._lead_held is not True:
                            self._try_lead_then_listen(conn)
                        else:
                            conn.execute("SELECT 1")
                        probed = time.monotonic()
            finally:
                # A lock held by a lost connection is the server's to free.
                self._lead_held = None

    def _until_taken(self, timeout: float) -> None:
        """While a wake-up is pending, wait (up to ``timeout``) for the relay to take it.

        Every commit that writes to the outbox sends a NOTIFY; under load hundreds a second reach
        the listener while its relay is in a pass. Each read would wake this thread and take the
        GIL from the worker's busy threads only to set an event already set, so the listener
        reads again only when the relay has taken its wake-up, and then reads all that came
        meanwhile at once. The timeout keeps the liveness probe running and the server's side
        of the connection drained while a pass is held up (a broker outage).
        """
        deadline = time.monotonic() + timeout
        while self._event.is_set() and not self._stopping.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._taken.wait(remaining)  # set by wait() and by stop()
            self._taken.clear()

    def _try_lead_then_listen(self, conn: Any, *, first: bool = False) -> None:
        """Try for the lead (when this listener takes part), then listen unless following.

        A new connection listens to nothing; afterwards it listens exactly when the last try did
        not make it a follower, so whether it listens is read off ``follower`` before the try.
        """
        listened = not first and not self.follower
        if self.lead is not None:
            if first:
                conn.execute(LEAD_SESSION)
            self._lead_held = conn.execute(self.lead).fetchone()[0]  # NULL: no outbox table yet
        listens = not self.follower
        if listens != listened:
            conn.execute(f'{"LISTEN" if listens else "UNLISTEN"} "{self.channel}"')
            if listens:
                self._event.set()  # for what was committed while it did not listen


def _notifies(conn: Any) -> Any:
    # A short timeout, so that stop() (every relay and consumer shutdown) is not held up by it.
    return conn.notifies(timeout=STOP_CHECK_SECONDS, stop_after=1000)
