"""`edgellm-serve` startup: backend choice (logged, with the reason), clear startup errors, and
the real entry point serving, then shutting down on SIGTERM."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from click.testing import CliRunner

from edgebuild.errors import ConfigError
from edgebuild.serve.cli import main
from edgebuild.serve.config import ServeConfig, select_backend

ALL = {"gpu": True, "tensorrt": True}


def test_auto_picks_torch_without_a_gpu_and_says_why(tmp_path):
    choice = select_backend("auto", tmp_path, {"gpu": False, "tensorrt": False})
    assert choice.name == "torch"
    assert "no CUDA GPU" in choice.reason and "tensorrt" in choice.reason
    assert "no built *.engine" in choice.reason


def test_auto_needs_engines_too(tmp_path):
    choice = select_backend("auto", tmp_path, ALL)
    assert choice.name == "torch" and "no built *.engine" in choice.reason


def test_backend_tensorrt_without_gpu_is_a_clear_startup_error(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "model.engine").write_bytes(b"")
    with pytest.raises(ConfigError, match="no CUDA GPU visible"):
        select_backend("tensorrt", tmp_path, {"gpu": False, "tensorrt": True})


def test_cli_backend_tensorrt_exits_2_with_the_reason(smollm2_dir):
    # a checkpoint: the server would build engines, but this machine cannot
    result = CliRunner().invoke(main, [str(smollm2_dir), "--backend", "tensorrt"])
    assert result.exit_code == 2
    assert "--backend tensorrt cannot build engines for" in result.output
    assert "tensorrt Python module is not installed" in result.output
    assert "no CUDA GPU is visible" in result.output


def test_cli_backend_tensorrt_on_a_bundle_without_engines_exits_2(tmp_path, smollm2_dir):
    bundle = tmp_path / "b"
    bundle.mkdir()
    (bundle / "manifest.json").write_text('{"engines": {"status": "not built: --onnx-only"}}')
    result = CliRunner().invoke(main, [str(bundle), "--backend", "tensorrt"])
    assert result.exit_code == 2
    assert "--backend tensorrt cannot run" in result.output
    assert "no built *.engine files" in result.output


def test_cli_rejects_a_bad_speculative_config_before_loading(smollm2_dir):
    result = CliRunner().invoke(
        main, [str(smollm2_dir), "--speculative-config", '{"method":"eagle3"}']
    )
    assert result.exit_code == 2
    assert "eagle3 is planned" in result.output


@pytest.mark.parametrize(
    "field, value, flag",
    [
        ("max_batch_size", 0, "--max-batch-size"),
        ("max_queued_requests", -1, "--max-queued-requests"),
        ("max_input_len", 0, "--max-input-len"),
    ],
)
def test_config_validation_names_the_flag(smollm2_dir, field, value, flag):
    with pytest.raises(ConfigError, match=flag):
        ServeConfig(model=smollm2_dir, **{field: value}).validate()


def test_the_choice_is_logged(smollm2_dir, caplog, monkeypatch):
    from edgebuild.serve import config as cfg

    monkeypatch.setattr(cfg, "LLM", lambda *a, **k: (_ for _ in ()).throw(ConfigError("stop")))
    with caplog.at_level(logging.INFO, "edgebuild.serve"), pytest.raises(ConfigError):
        cfg.load_state(ServeConfig(model=smollm2_dir))
    assert "backend: torch (TensorRT not usable" in caplog.text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_entry_point_serves_and_stops_cleanly_on_sigterm(smollm2_dir):
    port = _free_port()
    cmd = [sys.executable, "-m", "edgebuild.serve", str(smollm2_dir), "--port", str(port)]
    proc = subprocess.Popen(
        [*cmd, "--threads", "1", "--served-model-name", "smol"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.5)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "smol", "prompt": "Hello", "max_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        # uvicorn re-raises the signal once shutdown is complete
        assert proc.returncode in (0, -signal.SIGTERM), out
        assert "backend: torch (no engines: the tensorrt Python module is not installed" in out
        assert "Application shutdown complete" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_quant_reaches_the_torch_runtime_and_is_refused_on_engine_backends(
    smollm2_dir, monkeypatch
):
    """`edgellm-serve --quant int4` (break-it: the flag did not exist, int4 was `run`-only)."""
    from click.testing import CliRunner

    import edgebuild.deploy
    from edgebuild.serve import cli
    from edgebuild.serve import config as cfg

    seen = {}

    def fake_loader(config, probe=None):
        seen["config"] = config
        raise ConfigError("stop here")

    monkeypatch.setattr(edgebuild.deploy, "serve_loader", fake_loader)
    result = CliRunner().invoke(cli.main, [str(smollm2_dir), "--quant", "int4"])
    assert result.exit_code == 2 and seen["config"].quant == "int4", result.output
    bad = CliRunner().invoke(cli.main, [str(smollm2_dir), "--quant", "int3"])
    assert bad.exit_code == 2 and "--quant" in bad.output

    loaded = {}

    def fake_llm(model, **kw):
        loaded["options"] = kw["options"]
        raise ConfigError("loaded")

    monkeypatch.setattr(cfg, "LLM", fake_llm)
    config = cfg.ServeConfig(model=smollm2_dir, quant="int4")
    with pytest.raises(ConfigError, match="loaded"):
        cfg.load_state(config, cfg.ServePlan(smollm2_dir, cfg.BackendChoice("torch", "asked")))
    assert loaded["options"].quant == "int4"
    loaded.clear()
    ort = cfg.ServePlan(smollm2_dir, cfg.BackendChoice("onnxruntime", "asked"))
    with pytest.raises(ConfigError, match="--quant int4: weight-only CPU linears are a torch"):
        cfg.load_state(config, ort)
    assert not loaded  # refused before loading
    with pytest.raises(ConfigError, match="--quant must be one of int8, int4"):
        cfg.ServeConfig(model=smollm2_dir, quant="fp4").validate()
