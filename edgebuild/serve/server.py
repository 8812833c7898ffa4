"""The uvicorn server of `edgellm-serve`, with a shutdown that answers every request.

On SIGTERM / SIGINT uvicorn stops accepting connections and waits for the open ones. Here
the scheduler first refuses new requests (503) and lets the running ones go on for
``--graceful-shutdown-s``; what is still running or queued then is ended by the worker
with the documented 503 (``shutting_down``, with ``Retry-After``): a JSON error body for a
non-streamed request, an SSE error event followed by ``data: [DONE]`` for a stream. Only
after that does uvicorn's own deadline (``SHUTDOWN_MARGIN_S`` later) cancel anything left.
"""

from __future__ import annotations

import asyncio
import socket

import uvicorn

from edgebuild.serve.app import create_app
from edgebuild.serve.config import ServeConfig, ServeState
from edgebuild.serve.startup import Startup

SHUTDOWN_MARGIN_S = 5.0  # time the 503s have to reach their clients before uvicorn cancels


class EdgeServer(uvicorn.Server):
    """A uvicorn server for one ServeState whose shutdown drains the scheduler (module doc).

    Args:
        state: the loaded server state (its config gives host, port, graceful shutdown), or
            None with ``startup``.
        log_level: uvicorn's log level.
        startup: loads the state on a thread while the server already listens
            (:mod:`edgebuild.serve.startup`); ``config`` is then required. If the load fails
            the server exits and :attr:`startup_error` holds the exception.
        config: the settings when there is no loaded state yet.
    """

    def __init__(
        self,
        state: ServeState | None,
        log_level: str = "info",
        startup: Startup | None = None,
        config: ServeConfig | None = None,
    ):
        cfg = config if config is not None else state.config
        self.startup_error: BaseException | None = None
        app = create_app(state, startup, cfg, on_startup_error=self._startup_failed)
        config = uvicorn.Config(
            app,
            host=cfg.host,
            port=cfg.port,
            log_level=log_level,
            lifespan="on",
            timeout_graceful_shutdown=cfg.graceful_shutdown_s + SHUTDOWN_MARGIN_S,
        )
        super().__init__(config)
        self.app, self.serve_config = app, cfg

    @property
    def state(self) -> ServeState | None:
        """The loaded state (None while starting)."""
        return self.app.state.serve

    def _startup_failed(self, exc: BaseException) -> None:
        self.startup_error = exc
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Refuse new requests, give running ones the grace period, then end them with 503."""
        state = self.state
        if state is None:  # still starting: nothing runs yet
            await super().shutdown(sockets)
            return
        state.scheduler.begin_shutdown()
        deadline = asyncio.ensure_future(self._abort_after(self.serve_config.graceful_shutdown_s))
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    async def _abort_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        self.state.scheduler.abort_all()
