"""One owner of the plugin library's path and build hint (edgebuild.engine.plugin_library).

The engine builder, the TensorRT runtime backend and ``edgebuild doctor`` used to name two
different build folders (``build/plugins`` and ``plugins/build``); now every message comes from
the same constants, and the path lookup is the same function everywhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from edgebuild import doctor
from edgebuild.engine import builder
from edgebuild.engine import plugin_library as pl
from edgebuild.errors import MissingDependencyError
from edgebuild.runtime import trt_engine

ROOT = Path(__file__).resolve().parents[1]


def test_the_build_hint_builds_into_the_folder_that_is_searched():
    assert pl.PLUGIN_BUILD_DIR == ROOT / "plugins" / "build"
    build = pl.PLUGIN_BUILD_DIR
    assert f"-B {build} " in pl.PLUGIN_BUILD_HINT and f"--build {build}" in pl.PLUGIN_BUILD_HINT
    assert trt_engine.plugin_build_hint is pl.plugin_build_hint
    assert doctor.plugin_library_path is pl.plugin_library_path


def test_the_env_var_wins_then_the_build_folder(monkeypatch, tmp_path):
    monkeypatch.setenv(pl.ENV_VAR, str(tmp_path / "custom.so"))
    assert pl.plugin_library_path() == tmp_path / "custom.so"
    monkeypatch.delenv(pl.ENV_VAR)
    build = tmp_path / "plugins" / "build"
    monkeypatch.setattr(pl, "PLUGIN_BUILD_DIR", build)
    assert pl.plugin_library_path() is None
    build.mkdir(parents=True)
    (build / "libedgebuild_plugins.so").write_bytes(b"")
    assert pl.plugin_library_path() == build / "libedgebuild_plugins.so"


class _Registry:
    def __init__(self, handle):
        self.handle, self.loaded = handle, []

    def load_library(self, path):
        self.loaded.append(path)
        return self.handle


class _Builder:
    def __init__(self, handle):
        self.registry = _Registry(handle)

    def get_plugin_registry(self):
        return self.registry


def test_the_builder_names_the_one_build_hint_for_a_missing_or_unloadable_library(tmp_path):
    with pytest.raises(MissingDependencyError) as err:
        builder._load_plugin(None, _Builder(object()), None, True, "EdgebuildAttention")
    assert pl.PLUGIN_BUILD_HINT in str(err.value) and pl.ENV_VAR in str(err.value)
    assert "build/plugins" not in str(err.value)
    lib = tmp_path / "libedgebuild_plugins.so"
    lib.write_bytes(b"not a library")
    with pytest.raises(MissingDependencyError, match="could not load the plugin library"):
        builder._load_plugin(None, _Builder(None), lib, True, "EdgebuildAttention")
    ok = _Builder(object())
    builder._load_plugin(None, ok, lib, True, "EdgebuildAttention")
    assert ok.registry.loaded == [str(lib)]


def test_doctor_reports_the_same_hint(monkeypatch):
    monkeypatch.setattr(doctor, "plugin_library_path", lambda: None)
    rows = {name: (ok, detail) for name, ok, detail in doctor.run_checks()}
    assert rows["plugin library"] == (False, f"not found: {pl.plugin_build_hint()}")
    assert pl.PLUGIN_BUILD_HINT in pl.plugin_build_hint()
