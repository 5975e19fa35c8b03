"""A TCP proxy that can be cut, and a tansu broker behind it: a broker that goes away and comes
back, or drops its connections, for the crash tests and the Kafka transport's tests.

Everything listens and connects on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from typing import Any

from saga_engine.testing import tansu

# -- a TCP proxy that can be cut --------------------------------------------------------------


class TcpProxy:
    """Forwards connections to ``127.0.0.1:<port>`` to ``127.0.0.1:<target_port>``.

    :meth:`cut` closes every connection and stops listening, so clients get "connection refused"
    (a broker that went away); :meth:`restore` listens on the same port again.
    """

    def __init__(self, target_port: int, port: int | None = None) -> None:
        self.target = ("127.0.0.1", target_port)
        self.port = port or tansu.free_port()
        self.accepted = 0
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> TcpProxy:
        self.restore()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def restore(self) -> None:
        with self._lock:
            if self._listener is not None:
                return
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.port))
            listener.listen(128)
            self._listener = listener
        self._spawn(self._accept_loop, listener)

    def cut(self) -> None:
        """Drop every connection and refuse new ones until :meth:`restore`."""
        with self._lock:
            listener, self._listener = self._listener, None
            sockets, self._sockets = self._sockets, set()
        for sock in [*([listener] if listener else []), *sockets]:
            _close(sock)
        self._join()

    def close(self) -> None:
        self.cut()

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name="crash-proxy", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _join(self) -> None:
        threads, self._threads = self._threads, []
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(5)

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut: the listener was closed
            try:
                upstream = socket.create_connection(self.target, timeout=2)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                if self._listener is not listener:  # cut meanwhile
                    _close(client)
                    _close(upstream)
                    return
                self._sockets |= {client, upstream}
                self.accepted += 1
            self._spawn(self._pump, client, upstream)
            self._spawn(self._pump, upstream, client)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        # One side finished or failed: the connection is over in both directions.
        with self._lock:
            self._sockets -= {source, sink}
        _close(source)
        _close(sink)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


# -- tansu behind the proxy -------------------------------------------------------------------


def start_tansu_behind(proxy: TcpProxy, *, timeout: float = 20.0) -> tansu.TansuBroker:
    """A tansu broker on ``proxy.target`` that advertises the proxy's port, so that the clients'
    reconnections (to the address in the metadata) go through the proxy too."""
    return tansu.TansuBroker.start(proxy.target[1], timeout=timeout, advertised_port=proxy.port)
