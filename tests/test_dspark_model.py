"""DSpark draft: both packagings against an independent dense implementation of the spec.

The reference below (``ref_*``) is written straight from spec/draft-checkpoint-formats.md
sections 1.3, 1.4, 2 and 7 with plain torch ops: its own RMSNorm, rotate-half RoPE, dense GQA
attention over ``[context rows; block rows]`` with a hand-built mask, SwiGLU, Markov heads and
the confidence head. It imports nothing from ``edgebuild.ops`` or ``edgebuild.models`` except
the classes under test.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from edgebuild.checkpoint.config import ModelConfig
from edgebuild.checkpoint.source import WeightSource
from edgebuild.errors import CheckpointError, ConfigError, PairingError
from edgebuild.models.common import PagedBatch
from edgebuild.models.dspark import (
    DSparkConfig,
    DSparkDraft,
    DSparkPackaging,
    canonical_name,
    default_target_layer_ids,
)

D, LAYERS, H, HKV, HD, V, R, BS, INTER = 64, 2, 4, 2, 16, 128, 8, 4, 96
N_TARGET, TAPS, MASK, EPS, THETA = 6, [1, 3], 127, 1e-6, 10000.0
NT = len(TAPS)
PAGE_SIZE, NUM_PAGES = 4, 16
PAGE_TABLE = torch.tensor([[3, 0, 7, 5], [1, 2, 6, 4]], dtype=torch.int32)
CONTEXT_LENGTHS = (7, 5)  # two sequences, the second padded in the context update
ANCHORS = torch.tensor([11, 42])
TOL = 1e-5


# ---------------------------------------------------------------------------- configs
def target_dict(**over) -> dict:
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": D,
        "intermediate_size": INTER,
        "num_hidden_layers": N_TARGET,
        "num_attention_heads": H,
        "num_key_value_heads": HKV,
        "head_dim": HD,
        "vocab_size": V,
        "rms_norm_eps": EPS,
        "max_position_embeddings": 512,
        "rope_theta": THETA,
        "tie_word_embeddings": False,
    }
    cfg.update(over)
    return cfg


def target_config(**over) -> ModelConfig:
    return ModelConfig.from_dict(target_dict(**over), source="target/config.json")


def dspark_keys(head: str | None, conf: bool, conf_markov: bool) -> dict:
    return {
        "mask_token_id": MASK,
        "target_layer_ids": list(TAPS),
        "markov_rank": R if head else 0,
        "markov_head_type": head or "vanilla",
        "enable_confidence_head": conf,
        "confidence_head_with_markov": conf_markov,
    }


def deepspec_dict(head="vanilla", conf=True, conf_markov=True, **over) -> dict:
    """DeepSpec: a copy of the target config plus DSpark keys at the top level (spec 1.1)."""
    cfg = target_dict()
    cfg.update(
        architectures=["Qwen3DSparkModel"],
        num_hidden_layers=LAYERS,
        num_target_layers=N_TARGET,
        block_size=BS,
        num_anchors=512,
        layer_types=["full_attention"] * LAYERS,
        **dspark_keys(head, conf, conf_markov),
    )
    cfg.update(over)
    return cfg


def specforge_dict(head="vanilla", conf=True, conf_markov=True, **over) -> dict:
    """SpecForge / RadixArk: Qwen3Config + dflash_config (projector_type dspark)."""
    cfg = {
        "architectures": ["DSparkDraftModel"],
        "model_type": "qwen3",
        "hidden_size": D,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": H,
        "num_key_value_heads": HKV,
        "head_dim": HD,
        "vocab_size": V,
        "rms_norm_eps": EPS,
        "max_position_embeddings": 512,
        "rope_parameters": {"rope_type": "default", "rope_theta": THETA},
        "block_size": BS,
        "num_target_layers": N_TARGET,
        "dflash_config": {
            "projector_type": "dspark",
            "attention_mode": "gqa",
            **dspark_keys(head, conf, conf_markov),
        },
    }
    cfg.update(over)
    return cfg


def parse(cfg: dict, target: ModelConfig | None = None) -> DSparkConfig:
    return DSparkConfig.from_dict(cfg, target or target_config(), source="draft/config.json")


# ---------------------------------------------------------------------------- weights
def random_weights(head: str | None, conf: bool, conf_markov: bool, seed: int = 0) -> dict:
    """Canonical name -> fp32 tensor, scaled so every path contributes O(1) values."""
    g = torch.Generator().manual_seed(seed)

    def lin(out_f, in_f):
        return torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)

    def gamma(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    w = {}
    for layer in range(LAYERS):
        p = f"layers.{layer}."
        w[p + "self_attn.q_proj.weight"] = lin(H * HD, D)
        w[p + "self_attn.k_proj.weight"] = lin(HKV * HD, D)
        w[p + "self_attn.v_proj.weight"] = lin(HKV * HD, D)
        w[p + "self_attn.o_proj.weight"] = lin(D, H * HD)
        w[p + "self_attn.q_norm.weight"] = gamma(HD)
        w[p + "self_attn.k_norm.weight"] = gamma(HD)
        w[p + "mlp.gate_proj.weight"] = lin(INTER, D)
        w[p + "mlp.up_proj.weight"] = lin(INTER, D)
        w[p + "mlp.down_proj.weight"] = lin(D, INTER)
        w[p + "input_layernorm.weight"] = gamma(D)
        w[p + "post_attention_layernorm.weight"] = gamma(D)
    w["fc.weight"] = lin(D, NT * D)
    w["hidden_norm.weight"] = gamma(D)
    w["norm.weight"] = gamma(D)
    if head:
        w["markov_head.markov_w1.weight"] = torch.randn(V, R, generator=g)
        w["markov_head.markov_w2.weight"] = 0.5 * torch.randn(V, R, generator=g)
        if head == "gated":
            w["markov_head.gate_proj.weight"] = lin(R, D + R)
            w["markov_head.gate_proj.bias"] = 0.1 * torch.randn(R, generator=g)
        if head == "rnn":
            w["markov_head.joint_proj.weight"] = lin(3 * R, 2 * R + D)
            w["markov_head.joint_proj.bias"] = 0.1 * torch.randn(3 * R, generator=g)
    if conf:
        w["confidence_head.proj.weight"] = lin(1, D + (R if conf_markov else 0))
        w["confidence_head.proj.bias"] = 0.1 * torch.randn(1, generator=g)
    w["embed_tokens.weight"] = torch.randn(V, D, generator=g)
    w["lm_head.weight"] = lin(V, D)
    return w


def stored_name(packaging: str, canon: str) -> str:
    """How each packaging spells a tensor: DeepSpec bare names; SpecForge with `model.` on the
    backbone and the legacy `logit_head.` nesting on the heads (spec 1.2)."""
    if packaging == "deepspec":
        return canon
    if canon.startswith(("markov_head.", "confidence_head.")):
        return "logit_head." + canon
    return "model." + canon


def write_checkpoint(path: Path, cfg: dict, weights: dict, packaging: str) -> Path:
    """Write config.json + model.safetensors; SpecForge ships no embed_tokens / lm_head."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for canon, t in weights.items():
        if packaging == "specforge" and canon in ("embed_tokens.weight", "lm_head.weight"):
            continue
        tensors[stored_name(packaging, canon)] = t.contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def load_draft(
    tmp_path, packaging, head="vanilla", conf=True, conf_markov=True, cfg=None, target=None
):
    weights = random_weights(head, conf, conf_markov)
    if cfg is None:
        make = deepspec_dict if packaging == "deepspec" else specforge_dict
        cfg = make(head, conf, conf_markov)
    ckpt = write_checkpoint(tmp_path / packaging, cfg, weights, packaging)
    draft = DSparkDraft.from_source(
        WeightSource(ckpt),
        target or target_config(),
        lm_head=weights["lm_head.weight"],
        embed_tokens=weights["embed_tokens.weight"],
    )
    return draft, weights


# ---------------------------------------------------------------------------- reference
def ref_rms(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def default_rope():
    inv = 1.0 / (THETA ** (torch.arange(0, HD, 2, dtype=torch.float32) / HD))
    return inv, 1.0


def ref_rope(x, pos, rope):
    """Rotate-half RoPE of x [T, heads, HD] at integer positions [T] (spec 7)."""
    inv, scale = rope
    ang = pos.to(torch.float32)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :] * scale
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :] * scale
    rot = torch.cat([-x[..., HD // 2 :], x[..., : HD // 2]], -1)
    return x * cos + rot * sin


def ref_context_kv(w, features, ctx_pos, layer, rope):
    """Context K (k_norm, then RoPE) and V of one layer: C = hidden_norm(fc(F)) (spec 2.2, 7)."""
    p = f"layers.{layer}.self_attn."
    c = ref_rms(features @ w["fc.weight"].T, w["hidden_norm.weight"])
    k = (c @ w[p + "k_proj.weight"].T).view(-1, HKV, HD)
    k = ref_rope(ref_rms(k, w[p + "k_norm.weight"]), ctx_pos, rope)
    return k, (c @ w[p + "v_proj.weight"].T).view(-1, HKV, HD)


def ref_hidden(w, features, ctx_pos, block_ids, block_pos, rope=None):
    """Post-norm draft hidden [BS, D] of one sequence (spec 2.3-2.5)."""
    rope = rope or default_rope()
    x = w["embed_tokens.weight"][block_ids]
    m, bs = features.shape[0], block_ids.shape[0]
    # block row i sees context rows at positions < s (all of them here) and every block row
    visible = torch.cat(
        [(ctx_pos[None, :] < block_pos[0]).expand(bs, m), torch.ones(bs, bs, dtype=torch.bool)], 1
    )
    for layer in range(LAYERS):
        p = f"layers.{layer}."
        xn = ref_rms(x, w[p + "input_layernorm.weight"])
        q = (xn @ w[p + "self_attn.q_proj.weight"].T).view(bs, H, HD)
        q = ref_rope(ref_rms(q, w[p + "self_attn.q_norm.weight"]), block_pos, rope)
        k_blk = (xn @ w[p + "self_attn.k_proj.weight"].T).view(bs, HKV, HD)
        k_blk = ref_rope(ref_rms(k_blk, w[p + "self_attn.k_norm.weight"]), block_pos, rope)
        v_blk = (xn @ w[p + "self_attn.v_proj.weight"].T).view(bs, HKV, HD)
        k_ctx, v_ctx = ref_context_kv(w, features, ctx_pos, layer, rope)
        keys, values = torch.cat([k_ctx, k_blk]), torch.cat([v_ctx, v_blk])  # [M+BS, HKV, HD]
        kv_head = torch.arange(H) // (H // HKV)
        scores = torch.einsum("ihd,jhd->hij", q, keys[:, kv_head]) / math.sqrt(HD)
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
        attn = torch.einsum("hij,jhd->ihd", probs, values[:, kv_head]).reshape(bs, H * HD)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        xn = ref_rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = xn @ w[p + "mlp.gate_proj.weight"].T, xn @ w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return ref_rms(x, w["norm.weight"])


def ref_markov(w, head, prev, h, state):
    """Spec 1.3: (bias [V], new state) for one row."""
    e = w["markov_head.markov_w1.weight"][prev]
    if head == "vanilla":
        u = e
    elif head == "gated":
        g = torch.sigmoid(
            torch.cat([h, e]) @ w["markov_head.gate_proj.weight"].T
            + w["markov_head.gate_proj.bias"]
        )
        u = g * e
    else:
        z = torch.cat([state, e, h]) @ w["markov_head.joint_proj.weight"].T
        a, c, o = (z + w["markov_head.joint_proj.bias"]).split(R)
        state = torch.sigmoid(a) * state + (1 - torch.sigmoid(a)) * torch.tanh(c)
        u = torch.tanh(o)
    return w["markov_head.markov_w2.weight"] @ u, state


def ref_confidence(w, h, prev, with_markov):
    x = torch.cat([h, w["markov_head.markov_w1.weight"][prev]]) if with_markov else h
    return torch.sigmoid(
        x @ w["confidence_head.proj.weight"][0] + w["confidence_head.proj.bias"][0]
    )


# ---------------------------------------------------------------------------- running the draft
def context_features(seed: int = 1) -> list[torch.Tensor]:
    """Per-sequence target taps [m, NT*D], large like real taps (spec 2.7)."""
    g = torch.Generator().manual_seed(seed)
    return [3.0 * torch.randn(m, NT * D, generator=g) for m in CONTEXT_LENGTHS]


def new_caches() -> list[torch.Tensor]:
    return [torch.zeros(NUM_PAGES, 2, HKV, PAGE_SIZE, HD) for _ in range(LAYERS)]


def update(draft, caches, feats, start, stop, offset=0):
    """context_update with rows start[b]..stop[b]-1 of each sequence (padded batch)."""
    lengths = [b - a for a, b in zip(start, stop, strict=True)]
    rows = max(lengths)
    x = torch.zeros(len(feats), rows, NT * D)
    pos = torch.zeros(len(feats), rows, dtype=torch.int32)
    for b, f in enumerate(feats):
        x[b, : lengths[b]] = f[start[b] : stop[b]]
        pos[b] = torch.arange(start[b], start[b] + rows) + offset
    batch = PagedBatch(
        PAGE_TABLE,
        torch.tensor(start, dtype=torch.int32),
        torch.tensor(lengths, dtype=torch.int32),
        pos,
    )
    draft.context_update(x, caches, batch)


def run_block(draft, caches, offset=0, block_shift=0):
    s = torch.tensor(CONTEXT_LENGTHS)
    pos = (s[:, None] + torch.arange(BS) + offset + block_shift).to(torch.int32)
    batch = PagedBatch(PAGE_TABLE, s.to(torch.int32), torch.full((2,), BS, dtype=torch.int32), pos)
    return draft.block_forward(draft.block_input_ids(ANCHORS), caches, batch)


def run(draft, feats, offset=0, block_shift=0, split=None):
    caches = new_caches()
    zeros, full = [0, 0], list(CONTEXT_LENGTHS)
    if split is None:
        update(draft, caches, feats, zeros, full, offset)
    else:
        update(draft, caches, feats, zeros, split, offset)
        update(draft, caches, feats, split, full, offset)
    return run_block(draft, caches, offset, block_shift), caches


def ref_run(w, feats, offset=0, block_shift=0, rope=None):
    hs = []
    for b, f in enumerate(feats):
        m = f.shape[0]
        ids = torch.tensor([int(ANCHORS[b])] + [MASK] * (BS - 1))
        ctx_pos = torch.arange(m) + offset
        block_pos = torch.arange(m, m + BS) + offset + block_shift
        hs.append(ref_hidden(w, f, ctx_pos, ids, block_pos, rope))
    return torch.stack(hs)


def cache_row(cache, b, t):
    """K and V [HKV, HD] stored at slot t of sequence b."""
    page, off = int(PAGE_TABLE[b, t // PAGE_SIZE]), t % PAGE_SIZE
    return cache[page, 0, :, off], cache[page, 1, :, off]


# ---------------------------------------------------------------------------- numerics
CASES = [
    ("deepspec", "vanilla", True, True),
    ("specforge", "gated", True, False),
    ("specforge", "rnn", True, True),
    ("deepspec", "rnn", False, False),
    ("specforge", None, True, False),
]


@pytest.mark.parametrize(("packaging", "head", "conf", "conf_markov"), CASES)
def test_draft_matches_the_spec_reference_over_a_full_block_walk(
    tmp_path, packaging, head, conf, conf_markov
):
    draft, w = load_draft(tmp_path, packaging, head, conf, conf_markov)
    assert draft.config.packaging is DSparkPackaging(
        "Qwen3DSparkModel" if packaging == "deepspec" else "DSparkDraftModel"
    )
    feats = context_features()
    h, caches = run(draft, feats)
    ref_h = ref_run(w, feats)
    assert h.shape == (2, BS, D) and h.dtype == torch.float32
    assert (h - ref_h).abs().max() <= TOL

    # context K stored after k_norm and RoPE, V as projected; block K/V not persisted
    for b, f in enumerate(feats):
        k_ref, v_ref = ref_context_kv(w, f, torch.arange(f.shape[0]), 1, default_rope())
        for t in range(f.shape[0]):
            k, v = cache_row(caches[1], b, t)
            assert (k - k_ref[t]).abs().max() <= TOL and (v - v_ref[t]).abs().max() <= TOL
        k, v = cache_row(caches[1], b, f.shape[0])
        assert not k.any() and not v.any()

    base = draft.base_logits(h)
    ref_base = ref_h @ w["lm_head.weight"].T
    assert base.dtype == torch.float32 and (base - ref_base).abs().max() <= TOL

    if head is None:
        assert draft.markov_head is None
    # the decoder's left-to-right walk: prev_0 = anchor, prev_{k+1} = argmax of row k
    for b in range(2):
        prev, ref_prev, state, ref_state = ANCHORS.clone(), int(ANCHORS[b]), None, torch.zeros(R)
        for k in range(BS):
            logits, ref_logits = base[:, k], ref_base[b, k]
            if head is not None:
                before = state
                bias, state = draft.markov_head.step(prev, h[:, k], before)
                ref_bias, ref_state = ref_markov(w, head, ref_prev, ref_h[b, k], ref_state)
                assert bias.shape == (2, V) and bias.dtype == torch.float32
                assert (bias[b] - ref_bias).abs().max() <= TOL
                cand = torch.topk(logits, 6, dim=-1).indices
                cand_bias, cand_state = draft.markov_head.candidate_bias(
                    prev, h[:, k], before, cand
                )
                assert (cand_bias - torch.gather(bias, 1, cand)).abs().max() <= 1e-6
                if head == "rnn":
                    assert torch.equal(cand_state, state)
                logits, ref_logits = logits + bias, ref_logits + ref_bias
            if conf:
                c = draft.confidence(h[:, k], prev)
                ref_c = ref_confidence(w, ref_h[b, k], ref_prev, conf_markov)
                assert c.shape == (2,) and abs(float(c[b]) - float(ref_c)) <= TOL
            prev, ref_prev = logits.argmax(-1), int(ref_logits.argmax())
            assert int(prev[b]) == ref_prev


def test_rnn_state_restarted_per_row_would_be_detected(tmp_path):
    """Spec 7: the rnn state is carried across the block; a restart at zero differs."""
    draft, w = load_draft(tmp_path, "specforge", "rnn")
    h, _ = run(draft, context_features())
    prev = ANCHORS
    _, state = draft.markov_head.step(prev, h[:, 0], None)
    carried, _ = draft.markov_head.step(prev, h[:, 1], state)
    restarted, _ = draft.markov_head.step(prev, h[:, 1], None)
    assert (carried - restarted).abs().max() > 1e-2


def test_block_positions_shifted_by_one_change_the_output(tmp_path):
    draft, w = load_draft(tmp_path, "deepspec", "vanilla")
    feats = context_features()
    h, _ = run(draft, feats)
    shifted, _ = run(draft, feats, block_shift=1)
    assert (shifted - ref_run(w, feats, block_shift=1)).abs().max() <= TOL
    assert (shifted - h).abs().max() > 1e-2  # an off-by-one is visible
    # a common offset of context and block keeps relative positions: same output
    moved, _ = run(draft, feats, offset=3)
    assert (moved - h).abs().max() <= 1e-4


def test_context_split_in_two_updates_equals_one_update(tmp_path):
    draft, _ = load_draft(tmp_path, "specforge", "gated", True, False)
    feats = context_features()
    h_one, caches_one = run(draft, feats)
    h_two, caches_two = run(draft, feats, split=[4, 2])
    assert (h_one - h_two).abs().max() <= TOL
    for a, b in zip(caches_one, caches_two, strict=True):
        assert (a - b).abs().max() <= TOL


def test_draft_without_rope_scaling_takes_the_targets_yarn(tmp_path):
    yarn = {
        "rope_type": "yarn",
        "rope_theta": THETA,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
    }
    target = target_config(rope_theta=None, rope_parameters=yarn)
    assert target.rope.rope_type == "yarn"
    draft, w = load_draft(tmp_path, "specforge", "vanilla", target=target)
    rope = draft.config.rope
    assert (rope.rope_type, rope.factor, rope.original_max_position_embeddings) == ("yarn", 4, 128)
    hf = Qwen3Config(
        **{k: v for k, v in target_dict(rope_parameters=yarn).items() if k != "rope_theta"}
    )
    inv, scale = ROPE_INIT_FUNCTIONS["yarn"](hf, None)
    assert scale > 1.0
    feats = context_features()
    h, _ = run(draft, feats)
    assert (h - ref_run(w, feats, rope=(inv.float(), scale))).abs().max() <= TOL
    assert (h - ref_run(w, feats)).abs().max() > 1e-3  # the default rope would differ


def test_draft_keeps_its_own_rope_scaling_and_drops_inherited_mrope_and_partial_rotary():
    target = target_config()
    own = specforge_dict(
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": THETA}
    )
    assert parse(own, target).rope.rope_type == "linear"
    inherited = deepspec_dict(
        rope_parameters={"rope_type": "default", "rope_theta": THETA, "mrope_section": [2, 3, 3]},
        partial_rotary_factor=0.5,
    )
    rope = parse(inherited, target).rope
    assert rope.rope_type == "default" and rope.partial_rotary_factor == 1.0


def test_geometry_comes_from_tensor_shapes_when_the_config_inherits_target_fields(tmp_path):
    cfg = deepspec_dict(
        head_dim=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=7
    )
    draft, w = load_draft(tmp_path, "deepspec", "vanilla", cfg=cfg)
    c = draft.config
    assert (c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size) == (
        HD,
        H,
        HKV,
        INTER,
    )
    feats = context_features()
    assert (run(draft, feats)[0] - ref_run(w, feats)).abs().max() <= TOL


# ---------------------------------------------------------------------------- config parsing
def test_both_packagings_parse_to_the_same_fields():
    a, b = parse(deepspec_dict("gated", True, False)), parse(specforge_dict("gated", True, False))
    for name in ("block_size", "mask_token_id", "target_layer_ids", "markov_rank", "head_dim"):
        assert getattr(a, name) == getattr(b, name)
    assert (a.markov_head_type, b.enable_confidence_head, b.confidence_head_with_markov) == (
        "gated",
        True,
        False,
    )
    assert b.where("mask_token_id") == "dflash_config.mask_token_id"
    assert a.where("mask_token_id") == "mask_token_id"


def test_fields_in_dspark_config_are_read():
    cfg = specforge_dict()
    cfg["dspark_config"] = cfg.pop("dflash_config")
    assert parse(cfg).target_layer_ids == tuple(TAPS)


def test_locations_that_disagree_are_an_error():
    cfg = specforge_dict(mask_token_id=5)
    with pytest.raises(ConfigError, match="dflash_config.mask_token_id.*disagrees.*mask_token_id"):
        parse(cfg)


def test_absent_target_layer_ids_default_per_spec():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(36, 1) == (18,)
    cfg = specforge_dict()
    del cfg["dflash_config"]["target_layer_ids"]
    parsed = parse(cfg)
    assert parsed.target_layer_ids == (1, 3) and "default" in parsed.where("target_layer_ids")
    big = deepspec_dict(num_hidden_layers=5, num_target_layers=36, target_layer_ids=None)
    assert parse(big, target_config(num_hidden_layers=36)).target_layer_ids == (1, 9, 17, 25, 33)


def test_unknown_architecture_lists_the_supported_ones():
    with pytest.raises(ConfigError, match="Qwen3DSparkModel, DSparkDraftModel"):
        parse(specforge_dict(architectures=["DFlashDraftModel"]))


BAD_FIELDS = [
    ({"target_layer_ids": []}, ConfigError, ["target_layer_ids", "empty"]),
    ({"target_layer_ids": [3, 1]}, ConfigError, ["target_layer_ids", "strictly increasing"]),
    ({"target_layer_ids": [1, 1]}, ConfigError, ["strictly increasing", "no duplicates"]),
    ({"target_layer_ids": [-1, 3]}, ConfigError, ["negative", "-1", "embedding"]),
    ({"target_layer_ids": [1, 6]}, PairingError, ["target_layer_ids", "6 layers", "0..4"]),
    ({"target_layer_ids": [1, 5]}, PairingError, ["final layer 5", "final norm", "subtract 1"]),
    ({"mask_token_id": V}, ConfigError, ["mask_token_id", "[0, vocab_size=128)"]),
    ({"mask_token_id": -1}, ConfigError, ["mask_token_id", "outside"]),
    ({"markov_head_type": "lstm"}, ConfigError, ["'lstm'", "supported: vanilla, gated, rnn"]),
    ({"markov_rank": -1}, ConfigError, ["markov_rank", ">= 0"]),
    (
        {"markov_rank": 0, "confidence_head_with_markov": True},
        ConfigError,
        ["confidence_head_with_markov", "no Markov head", "markov_rank"],
    ),
    ({"num_target_layers": 8}, PairingError, ["num_target_layers", "6 layers"]),
    ({"block_size": 0}, ConfigError, ["block_size", ">= 1"]),
    ({"attention_mode": "mha"}, ConfigError, ["attention_mode", "'mha'"]),
]


@pytest.mark.parametrize(("change", "error", "fragments"), BAD_FIELDS)
def test_bad_dspark_fields_are_rejected_naming_file_and_field(change, error, fragments):
    cfg = specforge_dict()
    for key, value in change.items():
        where = cfg if key in ("block_size", "num_target_layers") else cfg["dflash_config"]
        where[key] = value
    with pytest.raises(error) as info:
        parse(cfg)
    message = str(info.value)
    assert "draft/config.json" in message
    for fragment in fragments:
        assert fragment in message


def test_hidden_size_mismatch_with_target_is_a_pairing_error():
    with pytest.raises(PairingError, match="hidden_size 32 != target hidden_size 64"):
        parse(specforge_dict(hidden_size=32, head_dim=8))


def test_fc_width_must_equal_taps_times_hidden(tmp_path):
    cfg = parse(specforge_dict())
    with pytest.raises(PairingError, match=r"fc.weight takes 192 inputs .* 2 \* 64 = 128"):
        cfg.validate(target_config(), fc_in_features=3 * D)
    weights = random_weights("vanilla", True, True)
    weights["fc.weight"] = torch.randn(D, 3 * D)
    ckpt = write_checkpoint(tmp_path / "d", specforge_dict(), weights, "specforge")
    with pytest.raises(PairingError, match="target_layer_ids"):
        DSparkDraft.from_source(
            WeightSource(ckpt),
            target_config(),
            weights["lm_head.weight"],
            weights["embed_tokens.weight"],
        )


# ---------------------------------------------------------------------------- loading
def test_canonical_names_strip_model_prefix_and_legacy_nesting():
    assert canonical_name("model.layers.0.fc.weight") == "layers.0.fc.weight"
    assert (
        canonical_name("logit_head.markov_head.markov_w1.weight") == "markov_head.markov_w1.weight"
    )
    assert (
        canonical_name("model.logit_head.confidence_head.proj.bias") == "confidence_head.proj.bias"
    )
    assert canonical_name("fc.weight") == "fc.weight"


def _load_with(tmp_path, mutate, packaging="deepspec"):
    weights = random_weights("vanilla", True, True)
    mutate(weights)
    make = deepspec_dict if packaging == "deepspec" else specforge_dict
    ckpt = write_checkpoint(tmp_path / "bad", make(), weights, packaging)
    return DSparkDraft.from_source(
        WeightSource(ckpt),
        target_config(),
        lm_head=random_weights("vanilla", True, True)["lm_head.weight"],
        embed_tokens=torch.randn(V, D),
    )


def test_missing_tensor_names_file_and_tensor(tmp_path):
    with pytest.raises(CheckpointError, match=r"bad.*missing tensors \['layers.1.mlp.up_proj"):
        _load_with(tmp_path, lambda w: w.pop("layers.1.mlp.up_proj.weight"))


def test_unexpected_tensor_is_rejected(tmp_path):
    def add(w):
        w["markov_head.gate_proj.weight"] = torch.randn(R, D + R)

    with pytest.raises(CheckpointError, match=r"unexpected tensors \['markov_head.gate_proj"):
        _load_with(tmp_path, add)


def test_wrong_shape_names_tensor_and_config_fields(tmp_path):
    def bad(w):
        w["markov_head.markov_w2.weight"] = torch.randn(V, R + 1)

    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'logit_head.markov_head"):
        _load_with(tmp_path, bad, packaging="specforge")
    with pytest.raises(CheckpointError, match="markov_rank"):
        _load_with(tmp_path / "again", bad, packaging="specforge")


def test_same_parameter_under_two_names_is_rejected(tmp_path):
    weights = random_weights("vanilla", True, True)
    tensors = {k: v for k, v in weights.items()}
    tensors["model.fc.weight"] = weights["fc.weight"].clone()
    ckpt = write_checkpoint(tmp_path / "dup", deepspec_dict(), tensors, "deepspec")
    with pytest.raises(CheckpointError, match="same parameter 'fc.weight'"):
        DSparkDraft.from_source(
            WeightSource(ckpt),
            target_config(),
            weights["lm_head.weight"],
            weights["embed_tokens.weight"],
        )


def test_resolved_head_with_wrong_shape_is_a_pairing_error(tmp_path):
    weights = random_weights("vanilla", True, True)
    ckpt = write_checkpoint(tmp_path / "d", specforge_dict(), weights, "specforge")
    with pytest.raises(PairingError, match=r"target/model.safetensors: lm_head.*\[130, 64\]"):
        DSparkDraft.from_source(
            WeightSource(ckpt),
            target_config(),
            torch.randn(V + 2, D),
            weights["embed_tokens.weight"],
            lm_head_origin="target/model.safetensors: lm_head.weight",
        )


def test_confidence_without_head_is_a_config_error(tmp_path):
    draft, _ = load_draft(tmp_path, "deepspec", "rnn", conf=False, conf_markov=False)
    with pytest.raises(ConfigError, match="no confidence head"):
        draft.confidence(torch.zeros(2, D), ANCHORS)


def test_confidence_broadcasts_h_over_the_candidates_and_refuses_bad_shapes(tmp_path):
    """The lattice's call (h [B, n, 1, d] against prev [B, n, K]) gives each candidate what
    the one-row call gives for that row and token, within fp32 rounding; the reference
    (ref_confidence: one dot over [h; W1[prev]]) agrees too. A wrong width, or leading dims
    that would broadcast prev up, are refused by name."""
    draft, w = load_draft(tmp_path, "specforge", "vanilla", conf=True, conf_markov=True)
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 3, D, generator=g)
    prev = torch.randint(0, V, (2, 3, 5), generator=g)
    lattice = draft.confidence(h.unsqueeze(2), prev)
    assert lattice.shape == (2, 3, 5) and lattice.dtype == torch.float32
    for b, n, k in itertools.product(range(2), range(3), range(5)):
        one = draft.confidence(h[b, n][None], prev[b, n, k][None])
        ref = ref_confidence(w, h[b, n], int(prev[b, n, k]), True)
        assert abs(float(lattice[b, n, k]) - float(one[0])) <= 1e-6
        assert abs(float(one[0]) - float(ref)) <= TOL
    with pytest.raises(ValueError, match=r"h must be \[\.\.\., 64\]"):
        draft.confidence(torch.zeros(2, D + 1), ANCHORS)
    with pytest.raises(ValueError, match="broadcast to prev"):
        draft.confidence(torch.zeros(2, D), ANCHORS[:, None])  # [2] against [2, 1]: [2, 2]


def test_specforge_draft_loads_with_heads_resolved_from_its_target(tmp_path):
    """The real flow: PairedSources gives the target's lm_head / embedding (spec 1.1, 6.9)."""
    from edgebuild.checkpoint.pairing import PairedSources

    weights = random_weights("rnn", True, True)
    draft_dir = write_checkpoint(tmp_path / "draft", specforge_dict("rnn"), weights, "specforge")
    target_dir = tmp_path / "target"
    target_dir.mkdir()
    target_tensors = {
        "model.embed_tokens.weight": weights["embed_tokens.weight"],
        "lm_head.weight": weights["lm_head.weight"],
    }
    save_file(target_tensors, str(target_dir / "model.safetensors"))
    (target_dir / "config.json").write_text(json.dumps(target_dict()))
    pair = PairedSources(draft_dir, target_dir)
    head, embed = pair.lm_head(), pair.embed_tokens()
    assert head.checkpoint_source == "target" and embed.checkpoint_source == "target"
    draft = DSparkDraft.from_source(
        pair.draft,
        target_config(),
        head.value,
        embed.value,
        lm_head_origin=f"{head.file}: {head.name}",
        embed_origin=f"{embed.file}: {embed.name}",
    )
    feats = context_features()
    assert (run(draft, feats)[0] - ref_run(weights, feats)).abs().max() <= TOL


def test_bf16_draft_runs_close_to_the_fp32_reference(tmp_path):
    weights = random_weights("gated", True, False)
    ckpt = write_checkpoint(
        tmp_path / "bf16", deepspec_dict("gated", True, False), weights, "deepspec"
    )
    draft = DSparkDraft.from_source(
        WeightSource(ckpt),
        target_config(),
        weights["lm_head.weight"],
        weights["embed_tokens.weight"],
        dtype=torch.bfloat16,
    )
    feats = context_features()
    caches = [c.to(torch.bfloat16) for c in new_caches()]
    update(draft, caches, [f.to(torch.bfloat16) for f in feats], [0, 0], list(CONTEXT_LENGTHS))
    h = run_block(draft, caches)
    assert h.dtype == torch.bfloat16
    assert (h.float() - ref_run(weights, feats)).abs().max() < 0.1
    bias, _ = draft.markov_head.step(ANCHORS, h[:, 0])
    assert bias.dtype == torch.float32 and draft.confidence(h[:, 0], ANCHORS).dtype == torch.float32
