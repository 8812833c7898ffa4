"""Installed from a wheel (no checkout): clear messages for the plugin and the export extra.

Issue 16, item 17. A "wheel install" is simulated by copying the ``edgebuild`` package alone
into a ``site-packages`` folder (no ``plugins/`` beside it) and running from another
directory; a missing ``export`` extra by blocking ``import onnx`` in a fresh interpreter.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from export_fixtures import make_tiny_target, write_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {})}
    if not env.get("EDGEBUILD_PLUGIN_LIB"):  # "" or unset: not set at all
        env.pop("EDGEBUILD_PLUGIN_LIB", None)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """``site-packages/edgebuild`` without the repository around it."""
    site = tmp_path_factory.mktemp("site-packages")
    shutil.copytree(
        ROOT / "edgebuild", site / "edgebuild", ignore=shutil.ignore_patterns("__pycache__")
    )
    return site


def _doctor(site: Path, cwd: Path, env: dict | None = None) -> str:
    code = (
        f"import sys; sys.path.insert(0, {str(site)!r}); import edgebuild; "
        f"assert edgebuild.__file__.startswith({str(site)!r}), edgebuild.__file__; "
        "from edgebuild.cli import main; main(['doctor'])"
    )
    env = {"EDGEBUILD_PLUGIN_LIB": "", **(env or {})}
    proc = _python(code, cwd, env)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if "plugin library" in line]
    assert len(rows) == 1, proc.stdout
    return rows[0]


def test_doctor_from_a_wheel_names_the_paths_searched_not_a_missing_plugins_folder(site, tmp_path):
    row = _doctor(site, tmp_path)
    assert "cmake -S plugins" not in row and "plugins/build" not in row, row
    assert str(site / "edgebuild") in row  # where this edgebuild lives (absolute)
    assert "EDGEBUILD_PLUGIN_LIB" in row and "ships no plugin sources" in row

    missing = tmp_path / "nowhere" / "libedgebuild_plugins.so"
    row = _doctor(site, tmp_path, {"EDGEBUILD_PLUGIN_LIB": str(missing)})
    assert f"{missing} does not exist" in row and f"searched {missing}" in row, row


def test_doctor_in_a_checkout_hints_the_absolute_cmake_command(tmp_path):
    from edgebuild.doctor import plugin_build_hint, plugin_search_paths

    env = os.environ.pop("EDGEBUILD_PLUGIN_LIB", None)
    try:
        assert plugin_search_paths() == [ROOT / "plugins" / "build"]  # one build folder
        hint = plugin_build_hint()
    finally:
        if env is not None:
            os.environ["EDGEBUILD_PLUGIN_LIB"] = env
    assert f"cmake -S {ROOT / 'plugins'} -B {ROOT / 'plugins' / 'build'}" in hint
    assert f"searched {ROOT / 'plugins' / 'build'};" in hint


def test_build_without_the_export_extra_names_the_extra(tmp_path):
    target = make_tiny_target(tmp_path / "qwen3", "qwen3", num_hidden_layers=2)
    write_tiny_tokenizer(target, 256)
    out = tmp_path / "bundle"
    code = (
        "import sys; sys.modules['onnx'] = None; from edgebuild.cli import main; "
        f"main(['build', {str(target)!r}, '--onnx-only', '--no-progress', '-o', {str(out)!r}, "
        "'--max-input-len', '64', '--max-kv-cache-capacity', '128'])"
    )
    proc = _python(code, ROOT)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and "ModuleNotFoundError" not in proc.stderr
    assert proc.stderr.startswith("error: "), proc.stderr
    assert "pip install 'edgebuild[export]'" in proc.stderr and "'onnx'" in proc.stderr
    assert not out.exists()
