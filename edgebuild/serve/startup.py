"""The server's start-up phase: it listens while the model is resolved, built and loaded.

``edgellm-serve ORG/TARGET`` may spend minutes before it can serve: downloading into the Hub
cache, building engines on first start (TensorRT on a Jetson: ~10 minutes per engine), loading
weights, profiling. During all of it the HTTP server already answers:

- ``/health`` (readiness): 503 with ``Retry-After`` and a JSON body ``{"status": "building" |
  "downloading" | "loading" | "starting", "stage": ..., "elapsed_s": ..., "stage_elapsed_s":
  ..., "eta_s": ...}``; 200 ``{"status": "ok"}`` once serving;
- ``/health/live`` (liveness): always 200 while the process runs, so an orchestrator does not
  kill a server that is only building;
- every other route: 503 with ``Retry-After`` and the OpenAI error body (code
  ``model_not_ready``) instead of a timeout.

Every stage logs a start line and an end line with its duration, and its ETA when one is
known (a previous build's time from the engine cache).

:class:`Startup` holds that status (thread-safe); the work itself is a ``load(startup)``
callable run on a thread (:meth:`Startup.run`), which reports its stages through
:meth:`Startup.stage` and returns the :class:`~edgebuild.serve.config.ServeState`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("edgebuild.serve")

RETRY_AFTER_S = 10  # what a client is told to wait while the server starts


@dataclass
class _Stage:
    status: str
    name: str
    started: float
    eta_s: float | None = None


class Startup:
    """Status of a server that is not serving yet (module docstring).

    Args:
        load: ``load(startup) -> ServeState``: resolves, builds and loads the model, calling
            :meth:`stage` as it goes; run by :meth:`run` on a daemon thread.
    """

    def __init__(self, load: Callable[[Startup], object]):
        self._load = load
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self._stage: _Stage | None = None
        self.state = None  # the ServeState once loaded
        self.error: BaseException | None = None
        self.done = threading.Event()

    # ---------------------------------------------------------------- stages
    def stage(self, status: str, name: str, eta_s: float | None = None) -> None:
        """Begin a stage (ending the one before it, logged with its duration).

        Args:
            status: the ``/health`` status word: ``downloading``, ``building``, ``loading``.
            name: what runs, e.g. ``building engines for RadixArk/Qwen3.8-27B-NVFP4``.
            eta_s: the stage's expected duration in seconds, when known (logged, reported).
        """
        with self._lock:
            self._end_stage()
            self._stage = _Stage(status, name, time.monotonic(), eta_s)
        eta = f" (ETA {_duration(eta_s)})" if eta_s else ""
        log.info("start-up: %s%s", name, eta)

    def _end_stage(self) -> None:
        if self._stage is not None:
            took = time.monotonic() - self._stage.started
            log.info("start-up: %s done in %s", self._stage.name, _duration(took))
            self._stage = None

    def snapshot(self) -> dict:
        """The ``/health`` body while starting (module docstring)."""
        now = time.monotonic()
        with self._lock:
            st = self._stage
            body = {
                "status": st.status if st else "starting",
                "stage": st.name if st else "starting",
                "elapsed_s": round(now - self.started, 1),
                "stage_elapsed_s": round(now - st.started, 1) if st else 0.0,
            }
            if st is not None and st.eta_s:
                body["eta_s"] = round(max(0.0, st.eta_s - (now - st.started)), 1)
        return body

    # ---------------------------------------------------------------- running
    def run(self, on_ready: Callable[[object], None], on_error: Callable[[BaseException], None]):
        """Run ``load`` on a daemon thread; then ``on_ready(state)`` or ``on_error(exc)``."""

        def work():
            try:
                state = self._load(self)
            except BaseException as exc:  # noqa: BLE001 - reported, then the server exits
                with self._lock:
                    self._stage = None
                self.error = exc
                on_error(exc)
            else:
                with self._lock:
                    self._end_stage()
                self.state = state
                log.info("start-up: ready after %s", _duration(time.monotonic() - self.started))
                on_ready(state)
            finally:
                self.done.set()

        thread = threading.Thread(target=work, name="edgellm-startup", daemon=True)
        thread.start()
        return thread


def _duration(seconds: float) -> str:
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
