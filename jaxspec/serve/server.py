"""uvicorn around the app: in the foreground until SIGINT or SIGTERM, or in a thread.

Shutdown is uvicorn's graceful one: no new connection is taken, requests in flight finish
(for at most `shutdown_timeout` seconds, after which their tasks are cancelled, which drops
them from the engine), then the app's shutdown stops the engine thread, aborting anything left.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Optional

import uvicorn


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        """SIGINT and SIGTERM start the graceful shutdown, after which `serve` returns (uvicorn
        would raise the signal again once shut down, ending the process by it; `jaxspec serve`
        exits with its own status instead). A second SIGINT forces the exit."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _config(app, host: str, port: int, shutdown_timeout: Optional[float], log_level: str):
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                          timeout_graceful_shutdown=shutdown_timeout)


def serve_forever(app, host: str, port: int, shutdown_timeout: Optional[float] = 30.0,
                  log_level: str = "info") -> int:
    """Serves until SIGINT or SIGTERM, then shuts down gracefully; 0 then, 1 if the server could
    not start (the port taken, say: uvicorn logs why)."""
    server = _Server(_config(app, host, port, shutdown_timeout, log_level))
    try:
        server.run()
    except SystemExit as e:          # uvicorn exits on a failed startup
        return int(e.code or 1)
    return 0 if server.started else 1


class ThreadedServer:
    """The app served from a thread of this process (tests, benchmarks, notebooks). port 0:
    a free port, read back as `port` once started."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0,
                 shutdown_timeout: Optional[float] = 30.0, log_level: str = "warning"):
        self.host = host
        self.server = _Server(_config(app, host, port, shutdown_timeout, log_level))
        self.thread: Optional[threading.Thread] = None
        self.port: Optional[int] = None       # the port listened on, once started

    def start(self, timeout: float = 60.0) -> "ThreadedServer":
        self.thread = threading.Thread(target=self.server.run, name="jaxspec-serve",
                                       daemon=True)
        self.thread.start()
        while not self.server.started:
            self.thread.join(0.02)
            timeout -= 0.02
            if not self.thread.is_alive() or timeout <= 0:
                raise RuntimeError("the server did not start (see its log)")
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 60.0):
        """Shuts down as on SIGTERM and waits for the thread."""
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)
            if self.thread.is_alive():
                raise RuntimeError(f"the server did not stop within {timeout} s")
