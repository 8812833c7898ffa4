"""The target decoder matches transformers (the parity oracle) on tiny random-weight models.

Llama / Qwen2 / Qwen3, tied and untied heads, yarn and llama3 rope scaling, v4 and v5 config
layouts, sliding window: prefill logits and 20 steps of cached decode, max abs diff <= 1e-4.
"""

from __future__ import annotations

import json

import pytest
import torch

from edgebuild.checkpoint.source import WeightSource
from edgebuild.models.llama import LlamaForCausalLM
from edgebuild.runtime.torch_backend import TorchTarget

transformers = pytest.importorskip("transformers")

BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)

CASES = {
    "llama-untied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama-tied-llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "qwen2-bias-yarn": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=128,
            ),
        ),
    ),
    "qwen2-sliding": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
    ),
    "qwen3-qknorm-tied": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(tie_word_embeddings=True, head_dim=32),
    ),
    "qwen3-yarn": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=1e6,
                factor=2.0,
                original_max_position_embeddings=256,
                beta_fast=32.0,
                beta_slow=1.0,
            )
        ),
    ),
}


def to_v4_layout(path):
    """Rewrite a saved (v5) config.json into the v4 layout: rope_theta + rope_scaling (type)."""
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rp = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = rp.pop("rope_theta", 10000.0)
    kind = rp.pop("rope_type", "default")
    cfg["rope_scaling"] = None if kind == "default" else {"type": kind, **rp}
    cfg_path.write_text(json.dumps(cfg))


def make_checkpoint(tmp_path, case, layout="v5"):
    cfg_cls, model_cls, extra = CASES[case]
    cfg = getattr(transformers, cfg_cls)(**BASE, **extra)
    cfg.architectures = [model_cls]
    torch.manual_seed(0)
    ref = getattr(transformers, model_cls)(cfg).eval()
    # make the norms non-trivial so that a missing norm would show up
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    if layout == "v4":
        to_v4_layout(tmp_path)
    return ref


@pytest.mark.parametrize("layout", ["v5", "v4"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers_for_prefill_and_20_decode_steps(tmp_path, case, layout):
    ref = make_checkpoint(tmp_path, case, layout)
    model = LlamaForCausalLM.from_source(WeightSource(tmp_path))
    backend = TorchTarget(model, max_kv_rows=256, page_size=4)  # many pages: splits sequences
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, BASE["vocab_size"], (13,), generator=g)
    seq = backend.new_sequence()
    out = backend.forward([seq], [prompt], [list(range(13))])
    with torch.no_grad():
        ref_out = ref(prompt[None], use_cache=True)
    torch.testing.assert_close(out.logits[0], ref_out.logits[0].float(), atol=1e-4, rtol=0)
    past = ref_out.past_key_values
    token = int(ref_out.logits[0, -1].argmax())
    for _ in range(20):
        step = backend.forward([seq], [torch.tensor([token])], [[0]])
        with torch.no_grad():
            ref_out = ref(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past = ref_out.past_key_values
        torch.testing.assert_close(
            step.logits[0][0], ref_out.logits[0, -1].float(), atol=1e-4, rtol=0
        )
        token = int(ref_out.logits[0, -1].argmax())


def test_batched_unequal_prompts_match_single_runs(tmp_path):
    make_checkpoint(tmp_path, "qwen3-qknorm-tied")
    model = LlamaForCausalLM.from_source(WeightSource(tmp_path))
    backend = TorchTarget(model, max_kv_rows=512, page_size=4)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in (5, 11, 2)]
    singles = []
    for p in prompts:
        s = backend.new_sequence()
        singles.append(backend.forward([s], [p], [[len(p) - 1]]).logits[0])
        backend.free(s)
    seqs = [backend.new_sequence() for _ in prompts]
    batched = backend.forward(seqs, prompts, [[len(p) - 1] for p in prompts]).logits
    for a, b in zip(singles, batched, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_tapped_hidden_states_equal_transformers_hidden_states(tmp_path):
    ref = make_checkpoint(tmp_path, "llama-untied")
    model = LlamaForCausalLM.from_source(WeightSource(tmp_path))
    backend = TorchTarget(model, max_kv_rows=64, page_size=8)
    prompt = torch.arange(7)
    out = backend.forward([backend.new_sequence()], [prompt], [[6]], tap_layers=(0, 1))
    with torch.no_grad():
        hs = ref(prompt[None], output_hidden_states=True).hidden_states
    # output of layer l == hidden_states[l + 1]
    torch.testing.assert_close(out.taps[0], torch.cat([hs[1][0], hs[2][0]], -1), atol=1e-5, rtol=0)
