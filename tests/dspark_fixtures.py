"""Writers of DSpark draft checkpoints for tests (random weights, published packaging).

`make_random_draft` writes a `DSparkDraftModel`-packaged draft (fields in `dflash_config`, no
`lm_head`, no `embed_tokens`) sized to fit a given target checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def make_random_draft(
    out: Path,
    target_dir: Path,
    *,
    num_layers: int = 1,
    block_size: int = 7,
    markov_rank: int = 8,
    markov_head_type: str = "vanilla",
    confidence: bool = True,
    target_layer_ids: list[int] | None = None,
    seed: int = 0,
    scale: float = 0.02,
    overrides: dict | None = None,
) -> Path:
    """A random-weight DSpark draft for the target at `target_dir` (fp32 safetensors)."""
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    if isinstance(tcfg.get("text_config"), dict):  # a VLM target: its language model's fields
        tcfg = {**tcfg, **tcfg["text_config"]}
    d, v = tcfg["hidden_size"], tcfg["vocab_size"]
    n_target = tcfg["num_hidden_layers"]
    heads = tcfg["num_attention_heads"]
    kv = tcfg.get("num_key_value_heads", heads)
    hd = tcfg.get("head_dim") or d // heads
    inter = tcfg["intermediate_size"]
    taps = target_layer_ids
    if taps is None:  # like the published defaults, never the final layer (spec section 1.5)
        taps = sorted({min(t, n_target - 2) for t in (1, n_target // 2, n_target - 2)})
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * scale

    t: dict[str, torch.Tensor] = {}
    for i in range(num_layers):
        p = f"layers.{i}"
        t[f"{p}.self_attn.q_proj.weight"] = rnd(heads * hd, d)
        t[f"{p}.self_attn.k_proj.weight"] = rnd(kv * hd, d)
        t[f"{p}.self_attn.v_proj.weight"] = rnd(kv * hd, d)
        t[f"{p}.self_attn.o_proj.weight"] = rnd(d, heads * hd)
        t[f"{p}.self_attn.q_norm.weight"] = 1 + rnd(hd)
        t[f"{p}.self_attn.k_norm.weight"] = 1 + rnd(hd)
        t[f"{p}.mlp.gate_proj.weight"] = rnd(inter, d)
        t[f"{p}.mlp.up_proj.weight"] = rnd(inter, d)
        t[f"{p}.mlp.down_proj.weight"] = rnd(d, inter)
        t[f"{p}.input_layernorm.weight"] = 1 + rnd(d)
        t[f"{p}.post_attention_layernorm.weight"] = 1 + rnd(d)
    t["fc.weight"] = rnd(d, len(taps) * d)
    t["hidden_norm.weight"] = 1 + rnd(d)
    t["norm.weight"] = 1 + rnd(d)
    r = markov_rank
    if r:
        t["markov_head.markov_w1.weight"] = rnd(v, r) * 10
        t["markov_head.markov_w2.weight"] = rnd(v, r) * 10
        if markov_head_type == "gated":
            t["markov_head.gate_proj.weight"] = rnd(r, d + r)
            t["markov_head.gate_proj.bias"] = rnd(r)
        if markov_head_type == "rnn":
            t["markov_head.joint_proj.weight"] = rnd(3 * r, 2 * r + d)
            t["markov_head.joint_proj.bias"] = rnd(3 * r)
    if confidence:
        t["confidence_head.proj.weight"] = rnd(1, d + (r if r else 0)) * 10
        t["confidence_head.proj.bias"] = torch.zeros(1)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: x.contiguous() for k, x in t.items()}, str(out / "model.safetensors"))
    cfg = {
        "architectures": ["DSparkDraftModel"],
        "model_type": "qwen3",
        "hidden_size": d,
        "intermediate_size": inter,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "vocab_size": v,
        "rms_norm_eps": tcfg.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": tcfg.get("max_position_embeddings", 4096),
        "rope_parameters": tcfg.get("rope_parameters")
        or {"rope_type": "default", "rope_theta": tcfg.get("rope_theta", 10000.0)},
        "tie_word_embeddings": False,
        "attention_bias": False,
        "block_size": block_size,
        "num_target_layers": n_target,
        "dflash_config": {
            "projector_type": "dspark",
            "mask_token_id": v - 1,
            "target_layer_ids": taps,
            "markov_rank": r,
            "markov_head_type": markov_head_type,
            "enable_confidence_head": confidence,
            "confidence_head_with_markov": bool(confidence and r),
            "attention_mode": "gqa" if kv < heads else "mha",
        },
    }
    if overrides:
        for key, value in overrides.items():
            if key.startswith("dflash_config."):
                cfg["dflash_config"][key.split(".", 1)[1]] = value
            else:
                cfg[key] = value
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def assert_greedy_dspark_equals_target_only(llm, texts: list[str], max_tokens: int = 24) -> None:
    """Greedy DSpark output equal to target-only's (the same LLM without its draft) token for
    token on ``texts``, and every request drafted (the draft was exercised)."""
    from edgebuild.runtime.sampling import SamplingParams

    prompts = [llm.encode(t) for t in texts]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ref = [s.output_ids for s in llm.without_draft().generate_ids(prompts, params)]
    got = llm.generate_ids(prompts, params)
    assert [s.output_ids for s in got] == ref
    assert all(s.metrics.proposed_at and s.metrics.proposed_at[0] > 0 for s in got)  # drafted
