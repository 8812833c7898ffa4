"""An unreadable model folder (the folder, its config.json or a .safetensors file without read
permission) is a one-line error naming the path and the fix, exit code 2, no traceback: from
``edgebuild inspect``, ``edgebuild run`` and ``edgellm-serve``, and a CheckpointError from the
library (``WeightSource``).

``chmod 000`` does not stop root, so as root the denial is simulated: ``open`` / ``stat`` /
directory listing of the denied path raise the PermissionError the kernel would give.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from modelopt_fixtures import make_tiny_qwen3

from edgebuild.checkpoint.source import WeightSource
from edgebuild.cli import main as edgebuild_main
from edgebuild.errors import CheckpointError
from edgebuild.serve.cli import main as serve_main

CASES = ("folder", "config.json", "model.safetensors")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("unreadable"))


def _denied(path, target: Path, folder: bool) -> bool:
    """Whether the kernel would refuse `path` for a user without read access to `target`."""
    try:
        p = Path(os.fsdecode(path)).absolute()
    except TypeError:  # a file descriptor
        return False
    return target in p.parents if folder else p == target


def _simulate_denial(monkeypatch, target: Path, folder: bool) -> None:
    """As root: make open / stat / listing of `target` (a folder: everything in it) raise."""

    def guard(real, listing=False):
        def wrapped(path=".", *args, **kwargs):
            hit = (Path(os.fsdecode(path)).absolute() == target) if listing else False
            if hit or _denied(path, target, folder):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))
            return real(path, *args, **kwargs)

        return wrapped

    monkeypatch.setattr(builtins, "open", guard(builtins.open))
    monkeypatch.setattr(io, "open", guard(io.open))
    if folder:  # a file's own stat still works (its folder is searchable)
        monkeypatch.setattr(os, "stat", guard(os.stat))
        monkeypatch.setattr(os, "scandir", guard(os.scandir, listing=True))
        monkeypatch.setattr(os, "listdir", guard(os.listdir, listing=True))


@pytest.fixture
def unreadable(tiny_dir, tmp_path, monkeypatch):
    """``unreadable(case)``: a copy of the tiny checkpoint with `case` unreadable; returns
    (model dir, the denied path)."""
    restore: list[Path] = []

    def make(case: str) -> tuple[Path, Path]:
        model = tmp_path / f"model-{case.replace('.', '_')}"
        shutil.copytree(tiny_dir, model)
        target = (model if case == "folder" else model / case).absolute()
        if os.geteuid() == 0:
            _simulate_denial(monkeypatch, target, folder=case == "folder")
        else:
            target.chmod(0)
            restore.append(target)
        return model, target

    yield make
    for path in restore:
        path.chmod(0o755)


def _assert_clean(result, denied: Path) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.output
    assert str(denied) in errors[0] and "permission denied" in errors[0]
    assert "chmod" in errors[0]  # the fix


@pytest.mark.parametrize("case", CASES)
def test_inspect_names_the_unreadable_path(unreadable, case):
    model, denied = unreadable(case)
    result = CliRunner().invoke(edgebuild_main, ["inspect", str(model)])
    _assert_clean(result, denied)


@pytest.mark.parametrize("case", CASES)
def test_run_names_the_unreadable_path(unreadable, case):
    model, denied = unreadable(case)
    args = ["run", str(model), "--prompt", "hi", "--max-tokens", "1", "--backend", "torch"]
    result = CliRunner().invoke(edgebuild_main, args)
    _assert_clean(result, denied)


@pytest.mark.parametrize("case", CASES)
def test_serve_names_the_unreadable_path(unreadable, case):
    model, denied = unreadable(case)
    args = [str(model), "--backend", "torch", "--port", "0", "--log-level", "warning"]
    result = CliRunner().invoke(serve_main, args)
    _assert_clean(result, denied)


@pytest.mark.parametrize("case", CASES)
def test_weight_source_raises_a_checkpoint_error(unreadable, case):
    model, denied = unreadable(case)
    with pytest.raises(CheckpointError, match="permission denied") as info:
        WeightSource(model)
    assert str(denied) in str(info.value)
