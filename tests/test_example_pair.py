"""The shipped example pair: SmolLM2-135M-Instruct (BF16 and NVFP4) + the trained DSpark draft.

Oracles: the target checkpoint's own head (tied embedding for BF16; ModelOpt's
``NVFP4QTensor.dequantize`` of the packed NVFP4 ``lm_head`` for NVFP4) and target-only greedy
decoding of the same LLM (DSpark must not change a single token).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from edgebuild.checkpoint.source import WeightSource
from edgebuild.example import example_draft_dir
from edgebuild.runtime.decoding import TargetOnlyDecoder
from edgebuild.runtime.dspark_loader import prepare_torch_draft as prepare_draft
from edgebuild.runtime.llm import LLM, RuntimeOptions
from edgebuild.runtime.sampling import SamplingParams
from edgebuild.speculative.config import SpeculativeConfig

ROOT = Path(__file__).resolve().parent.parent
DRAFT = example_draft_dir()
EVAL_PROMPTS = ROOT / "tools" / "train_dspark" / "data" / "eval_prompts.jsonl"


def _spec(n: int = 7) -> SpeculativeConfig:
    return SpeculativeConfig.parse(
        {"method": "dspark", "model": str(DRAFT), "num_speculative_tokens": n,
         "confidence_scheduling": False}  # every step drafts: the pair's acceptance
    )  # fmt: skip


def _held_out(k: int) -> list[str]:
    rows = [json.loads(x) for x in EVAL_PROMPTS.read_text().splitlines() if x.strip()]
    return [r["prompt"] for r in rows[:k]]


def test_shipped_draft_is_a_headless_dspark_draft_model():
    cfg = json.loads((DRAFT / "config.json").read_text())
    assert cfg["architectures"] == ["DSparkDraftModel"]
    dspark = cfg["dflash_config"]
    assert dspark["projector_type"] == "dspark"
    assert cfg["block_size"] == 7 and dspark["markov_head_type"] == "vanilla"
    assert 0 < dspark["markov_rank"] <= 64 and dspark["enable_confidence_head"]
    assert dspark["target_layer_ids"][-1] < cfg["num_target_layers"] - 1  # never the last layer
    weights = DRAFT / "model.safetensors"
    assert weights.stat().st_size < 50 * 2**20
    with safe_open(str(weights), "pt") as f:
        names = set(f.keys())
        dtypes = {f.get_slice(n).get_dtype() for n in names}
    assert not any(n.startswith(("lm_head", "embed_tokens", "model.")) for n in names)
    assert dtypes <= {"BF16", "F16"}
    assert (DRAFT / "README.md").is_file()


def test_bf16_pair_borrows_the_tied_target_head(smollm2_dir):
    draft = prepare_draft(_spec(), WeightSource(smollm2_dir))(RuntimeOptions(max_kv_rows=256))
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight").float()
    assert torch.equal(draft.model.lm_head.weight, embed)
    assert torch.equal(draft.model.embed_tokens.weight, embed)


def test_nvfp4_pair_borrows_the_nvfp4_head_dequantized_as_modelopt_does(nvfp4_dir):
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    draft = prepare_draft(_spec(), WeightSource(nvfp4_dir))(RuntimeOptions(max_kv_rows=256))
    with safe_open(str(nvfp4_dir / "model.safetensors"), "pt") as f:
        packed = f.get_tensor("lm_head.weight")
        assert packed.dtype == torch.uint8  # the head really is NVFP4
        scale, scale2 = f.get_tensor("lm_head.weight_scale"), f.get_tensor("lm_head.weight_scale_2")
    rows, half = packed.shape
    oracle = NVFP4QTensor((rows, half * 2), torch.float32, packed).dequantize(
        dtype=torch.float32, scale=scale, double_scale=scale2, block_sizes={-1: 16}
    )
    torch.testing.assert_close(draft.model.lm_head.weight, oracle, rtol=0, atol=0)


def _dspark_vs_target_only(target: Path, prompts: list[str], max_tokens: int):
    llm = LLM(target, speculative=_spec(), options=RuntimeOptions(max_kv_rows=2048))
    ids = [llm.encode(p, chat=True) for p in prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    spec_states = llm.generate_ids(ids, params)
    llm.decoder = TargetOnlyDecoder(llm.target)
    base_states = llm.generate_ids(ids, params)
    return spec_states, base_states


def test_bf16_pair_is_lossless_on_held_out_prompts(smollm2_dir):
    spec, base = _dspark_vs_target_only(smollm2_dir, _held_out(3), max_tokens=24)
    for s, b in zip(spec, base, strict=True):
        assert s.output_ids == b.output_ids
    total = spec[0].metrics.merge(spec[1].metrics).merge(spec[2].metrics)
    assert total.tau > 1.0  # the trained draft does get tokens accepted


@pytest.mark.slow
def test_nvfp4_pair_is_lossless_on_held_out_prompts(nvfp4_dir):
    spec, base = _dspark_vs_target_only(nvfp4_dir, _held_out(3), max_tokens=24)
    for s, b in zip(spec, base, strict=True):
        assert s.output_ids == b.output_ids
