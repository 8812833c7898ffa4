"""Helpers for the server tests: uvicorn on a loopback socket in a thread, stopped by the test.

The socket is bound (port 0 = a free port) before uvicorn starts, so there is no race for the
port; `stop()` asks uvicorn to exit, which runs the app's lifespan shutdown (the scheduler's
worker is joined) before the thread is joined.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from pathlib import Path

import torch

from edgebuild.serve.config import ServeConfig, ServeState
from edgebuild.serve.server import EdgeServer


class ServerThread:
    """A server for `state` on 127.0.0.1 (a free port), run by uvicorn in a daemon thread."""

    def __init__(self, state: ServeState):
        self.state = state
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = EdgeServer(state, log_level="warning")
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        with contextlib.suppress(OSError):
            self.sock.close()
        assert not self.thread.is_alive(), "the server thread did not stop"
        assert not self.state.scheduler.alive


@contextlib.contextmanager
def serving(llm, **config):
    """A running server over an already loaded `llm`; stopped (and joined) on exit
    (`stop()` is what SIGTERM does: running requests get `graceful_shutdown_s`, default 5 s
    here, then a 503)."""
    config.setdefault("graceful_shutdown_s", 5.0)
    cfg = ServeConfig(model=Path(llm.model_dir), **config)
    server = ServerThread(ServeState.from_llm(cfg, llm)).start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def torch_threads(n: int):
    """Run with `n` torch threads (the CPU here is shared: oversubscription is very slow)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}t3 {{ m['content'] }} t4 {% endfor %}"
    "{% if add_generation_prompt %}t5{% endif %}"
)


def write_tiny_chat_model(out: Path, seed: int = 0, **overrides) -> Path:
    """A random tiny Llama (vocab 256, 256 positions) with a word-level tokenizer over
    ``t0 .. t255`` (t1 = EOS) and a chat template: a model that decodes a step in about a
    millisecond, for server tests that need many requests."""
    from export_fixtures import make_tiny_target, write_tiny_tokenizer

    out = make_tiny_target(Path(out), arch="llama", seed=seed, **overrides)
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    write_tiny_tokenizer(out, vocab)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TINY_CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return out


def free_pages(llm) -> tuple[int, int | None]:
    """Free KV pages of the target (and of the draft) allocators."""
    draft = llm.draft.allocator.free_pages if llm.draft is not None else None
    return llm.target.allocator.free_pages, draft
