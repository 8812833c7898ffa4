"""The two cache variables: ``$EDGEBUILD_CACHE_DIR`` (the engine cache, and by default the CPU
kernel cache under it, as without any variable both live under ``~/.cache/edgebuild``) and
``$EDGEBUILD_CACHE`` (the kernel cache only). Setting the look-alike ``EDGEBUILD_CACHE``
alone, e.g. for the engine cache, is warned about: the engines do not go there."""

from __future__ import annotations

import logging

import pytest

from edgebuild.bundle import cache as engine_cache
from edgebuild.ops import cpu_build


@pytest.fixture
def env(monkeypatch, tmp_path):
    for name in ("EDGEBUILD_CACHE", "EDGEBUILD_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(engine_cache, "_WARNED_LOOKALIKE", False, raising=False)
    return monkeypatch


def test_without_variables_kernels_sit_under_the_engine_cache(env, tmp_path):
    assert engine_cache.default_cache_dir() == tmp_path / "xdg" / "edgebuild"
    assert cpu_build.cache_dir() == engine_cache.default_cache_dir() / "kernels"


def test_edgebuild_cache_dir_moves_the_kernels_too(env, tmp_path):
    env.setenv("EDGEBUILD_CACHE_DIR", str(tmp_path / "eb"))
    assert engine_cache.default_cache_dir() == tmp_path / "eb"
    assert cpu_build.cache_dir() == tmp_path / "eb" / "kernels"


def test_edgebuild_cache_still_sets_the_kernel_cache_alone(env, tmp_path):
    env.setenv("EDGEBUILD_CACHE_DIR", str(tmp_path / "eb"))
    env.setenv("EDGEBUILD_CACHE", str(tmp_path / "k"))
    assert cpu_build.cache_dir() == tmp_path / "k" / "kernels"
    assert engine_cache.default_cache_dir() == tmp_path / "eb"


def test_the_lookalike_alone_is_warned_about_once(env, tmp_path, caplog):
    env.setenv("EDGEBUILD_CACHE", str(tmp_path / "k"))
    with caplog.at_level(logging.WARNING, logger="edgebuild.cache"):
        assert engine_cache.default_cache_dir() == tmp_path / "xdg" / "edgebuild"
        engine_cache.default_cache_dir()
    warned = [r.getMessage() for r in caplog.records if "EDGEBUILD_CACHE_DIR" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    assert "EDGEBUILD_CACHE" in warned[0] and str(tmp_path / "xdg" / "edgebuild") in warned[0]


def test_no_warning_when_the_engine_cache_variable_is_set(env, tmp_path, caplog):
    env.setenv("EDGEBUILD_CACHE", str(tmp_path / "k"))
    env.setenv("EDGEBUILD_CACHE_DIR", str(tmp_path / "eb"))
    with caplog.at_level(logging.WARNING, logger="edgebuild.cache"):
        engine_cache.default_cache_dir()
    assert not caplog.records
