"""Ctrl-C during the first build of a CPU kernel aborts the command; it is not a build failure
that falls back to the torch path while the run goes on.

A terminal's Ctrl-C sends SIGINT to the whole process group: ninja stops ("ninja: build
stopped: interrupted by user.") and ``torch.utils.cpp_extension`` turns that into a
RuntimeError, which the kernels' ``except Exception`` took for a compiler failure. Where the
build runs off the main thread (``edgellm-serve``'s start-up) that RuntimeError was all the
build thread saw. Here a fake ``ninja`` first on PATH plays the interrupted build, through the
real ``cpp_extension.load``.
"""

from __future__ import annotations

import fcntl
import os
import platform
import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgebuild.ops import amx_linear, attention_kernel, cpu_build, f32_linear

INTERRUPTED = 'echo "ninja: build stopped: interrupted by user."; exit 2'
# ninja itself killed by the signal (return code -2). Not `kill -INT $$` in the shell: a
# process that inherited SIGINT ignored (a background job, or an earlier test of the same
# xdist worker) cannot reset it in sh, so the "killed" ninja slept and exited 0 (CI failure).
KILLED = (
    f'exec "{sys.executable}" -c "import os, signal; signal.signal(signal.SIGINT, signal.SIG_DFL);'
    ' os.kill(os.getpid(), signal.SIGINT)"'
)
FAILED = 'echo "x.cpp:1:1: error: expected unqualified-id"; exit 1'


@pytest.fixture
def fake_ninja(tmp_path, monkeypatch):
    """``fake_ninja(body)``: a ``ninja`` first on PATH that answers --version and runs
    ``body`` for the build; the kernel cache is empty (``EDGEBUILD_CACHE`` under tmp_path)."""

    def make(body: str) -> None:
        bindir = tmp_path / "bin"
        bindir.mkdir(exist_ok=True)
        ninja = bindir / "ninja"
        ninja.write_text(
            f'#!/bin/sh\nif [ "$1" = "--version" ]; then echo 1.11.1; exit 0; fi\n{body}\n'
        )
        ninja.chmod(0o755)
        venv_bin = str(Path(sys.executable).parent)  # on PATH: build_and_load adds no other
        path = os.pathsep.join([str(bindir), venv_bin, os.environ.get("PATH", "")])
        monkeypatch.setenv("PATH", path)
        monkeypatch.setenv("EDGEBUILD_CACHE", str(tmp_path / "cache"))

    return make


def _assert_nothing_left_valid() -> None:
    """No stamp (a later run rebuilds) and every kernel flock free."""
    root = cpu_build.cache_dir()
    assert not list(root.glob("*/*.sha256")), list(root.glob("*/*"))
    assert cpu_build.prebuilt(attention_kernel.SOURCE, attention_kernel.FLAGS) is None
    for lock in root.glob("*.lock"):
        with open(lock, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError if still held
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.mark.parametrize("body", [INTERRUPTED, KILLED], ids=["ninja-stopped", "ninja-killed"])
def test_an_interrupted_build_raises_keyboard_interrupt(fake_ninja, body):
    fake_ninja(body)
    with pytest.raises(KeyboardInterrupt):
        cpu_build.build_and_load(attention_kernel.SOURCE, attention_kernel.FLAGS)
    _assert_nothing_left_valid()


def test_an_interrupted_build_aborts_the_kernel_load_instead_of_falling_back(
    fake_ninja, monkeypatch, caplog
):
    fake_ninja(INTERRUPTED)
    monkeypatch.setattr(attention_kernel.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(attention_kernel.platform, "system", lambda: "Linux")
    attention_kernel._load.cache_clear()
    try:
        with pytest.raises(KeyboardInterrupt):
            attention_kernel.available()
        assert "torch decode path" not in caplog.text  # no fallback warning
    finally:
        attention_kernel._load.cache_clear()
    _assert_nothing_left_valid()


def test_a_compiler_error_still_falls_back(fake_ninja):
    fake_ninja(FAILED)
    with pytest.raises(RuntimeError, match="expected unqualified-id") as info:
        cpu_build.build_and_load(attention_kernel.SOURCE, attention_kernel.FLAGS)
    assert not isinstance(info.value, KeyboardInterrupt)
    _assert_nothing_left_valid()


@pytest.mark.parametrize(
    "kernel", [attention_kernel, amx_linear, f32_linear], ids=["attention", "amx_linear", "f32"]
)
def test_keyboard_interrupt_from_the_build_propagates_and_writes_no_stamp(
    kernel, tmp_path, monkeypatch
):
    """A KeyboardInterrupt raised in the build itself (Ctrl-C on the main thread) passes the
    kernels' ``except Exception``, releases the flock and leaves no stamp."""
    from torch.utils import cpp_extension

    def interrupted(**kwargs):
        raise KeyboardInterrupt

    monkeypatch.setenv("EDGEBUILD_CACHE", str(tmp_path / "cache"))
    for switch in (f32_linear.ENV, amx_linear.ENV, amx_linear.BF16_ENV):
        monkeypatch.delenv(switch, raising=False)  # a kernel switched off would not build
    monkeypatch.setattr(cpp_extension, "load", interrupted)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    flags = {"amx_tile", "amx_bf16", "avx512_bf16", "avx512bw", "avx2", "fma"}  # may build
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: flags)
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    reset = getattr(kernel, "_reset", kernel._load.cache_clear)  # amx_linear: two caches
    reset()
    try:
        with pytest.raises(KeyboardInterrupt):
            kernel.available()
    finally:
        reset()
    _assert_nothing_left_valid()


def test_serve_exits_as_interrupted_when_the_startup_build_is(tmp_path, monkeypatch):
    """edgellm-serve builds the kernels on its start-up thread: a KeyboardInterrupt there is
    the usual Ctrl-C exit (click's "Aborted!", exit 1), not an "error:" with a traceback."""
    import edgebuild.deploy
    from edgebuild.serve.cli import main

    def load(startup):
        raise KeyboardInterrupt("building decode_attention.cpp was interrupted")

    monkeypatch.setattr(edgebuild.deploy, "serve_loader", lambda config: load)
    model = tmp_path / "model"
    model.mkdir()
    result = CliRunner().invoke(main, [str(model), "--port", "0", "--backend", "torch"])
    assert result.exit_code == 1, (result.exit_code, result.output)
    assert "Aborted!" in result.output
    assert "error:" not in result.output
