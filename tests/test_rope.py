"""RoPE parity with transformers 5.14 (the oracle): frequencies, config parsing, rotation."""

from __future__ import annotations

import pytest
import torch
from transformers import GPTNeoXConfig, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_neox.modeling_gpt_neox import (
    GPTNeoXRotaryEmbedding,
)
from transformers.models.gpt_neox.modeling_gpt_neox import (
    apply_rotary_pos_emb as neox_apply_rotary_pos_emb,
)
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from edgebuild.errors import ConfigError
from edgebuild.ops.rope import (
    SUPPORTED_ROPE_TYPES,
    RopeScaling,
    apply_rope,
    compute_inv_freq,
    rope_cos_sin_table,
)

HEAD_DIM = 64


def llama_config(rope_parameters: dict, head_dim: int = HEAD_DIM, max_pos: int = 4096):
    return LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=dict(rope_parameters),
    )


def hf_inv_freq(config) -> tuple[torch.Tensor, float]:
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config, None)


ROPE_CASES = {
    "default-1e4": {"rope_type": "default", "rope_theta": 10000.0},
    "default-1e6": {"rope_type": "default", "rope_theta": 1e6},
    "linear-2": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "linear-4.5": {"rope_type": "linear", "factor": 4.5, "rope_theta": 5e5},
    "llama3.1": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 5e5,
    },
    "llama3-short-context": {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 2.0,
        "high_freq_factor": 8.0,
        "original_max_position_embeddings": 256,
        "rope_theta": 10000.0,
    },
    "yarn-radixark": {
        "rope_type": "yarn",
        "factor": 32.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 1e7,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "yarn-no-truncate": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "rope_theta": 1e6,
        "truncate": False,
    },
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
    },
    "yarn-attention-factor": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 2048,
        "rope_theta": 1e6,
        "attention_factor": 0.8,
    },
}


@pytest.mark.parametrize("name", sorted(ROPE_CASES))
def test_inv_freq_and_attention_scaling_equal_transformers(name):
    config = llama_config(ROPE_CASES[name])
    expected_inv_freq, expected_scaling = hf_inv_freq(config)

    rope = RopeScaling.from_hf_config(config.to_dict())
    inv_freq, scaling = compute_inv_freq(rope.rotary_dim(HEAD_DIM), rope)

    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (HEAD_DIM // 2,)
    torch.testing.assert_close(inv_freq, expected_inv_freq, rtol=0, atol=0)
    assert scaling == pytest.approx(expected_scaling, rel=1e-12)


def test_scaled_cases_really_differ_from_default():
    """Guards the parity test: each scaled rope type changes the frequencies (and yarn the scale)."""
    default, _ = compute_inv_freq(HEAD_DIM, RopeScaling())
    for name, params in ROPE_CASES.items():
        if params["rope_type"] == "default":
            continue
        rope = RopeScaling.from_hf_config({"rope_parameters": params})
        inv_freq, scaling = compute_inv_freq(HEAD_DIM, rope)
        assert not torch.allclose(inv_freq, default), name
        if params["rope_type"] == "yarn":
            assert scaling != 1.0, name
    llama3 = RopeScaling.from_hf_config({"rope_parameters": ROPE_CASES["llama3-short-context"]})
    ratio = default / compute_inv_freq(HEAD_DIM, llama3)[0]
    # the three llama3 regimes: kept (1), divided by factor (4), smoothed (strictly between)
    assert (ratio == 1).any() and (ratio == 4).any() and ((ratio > 1) & (ratio < 4)).any()


def test_yarn_without_factor_uses_max_position_ratio_like_transformers():
    params = {"rope_type": "yarn", "original_max_position_embeddings": 1024, "rope_theta": 1e4}
    config = llama_config(dict(params, factor=8.0), max_pos=8192)
    config.rope_parameters["factor"] = None  # HF's validation wants the key; its yarn allows None
    expected, expected_scaling = hf_inv_freq(config)
    rope = RopeScaling.from_hf_config({"rope_parameters": params, "max_position_embeddings": 8192})
    assert rope.factor == 8.0
    inv_freq, scaling = compute_inv_freq(HEAD_DIM, rope)
    torch.testing.assert_close(inv_freq, expected, rtol=0, atol=0)
    assert scaling == pytest.approx(expected_scaling)


def test_partial_rotary_inv_freq_equals_transformers():
    params = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "rope_theta": 1e4,
        "partial_rotary_factor": 0.5,
    }
    config = llama_config(params)
    expected, _ = hf_inv_freq(config)
    rope = RopeScaling.from_hf_config(config.to_dict())
    assert rope.rotary_dim(HEAD_DIM) == HEAD_DIM // 2
    inv_freq, _ = compute_inv_freq(rope.rotary_dim(HEAD_DIM), rope)
    torch.testing.assert_close(inv_freq, expected, rtol=0, atol=0)


def test_from_hf_config_reads_the_v4_layout():
    cfg = {
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    rope = RopeScaling.from_hf_config(cfg)
    assert rope == RopeScaling(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        original_max_position_embeddings=8192,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
    )


def test_from_hf_config_reads_the_legacy_type_key_and_null_scaling():
    legacy = RopeScaling.from_hf_config(
        {"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2}}
    )
    assert (legacy.rope_type, legacy.factor, legacy.rope_theta) == ("linear", 2.0, 1e6)
    null = RopeScaling.from_hf_config({"rope_theta": 1e6, "rope_scaling": None})
    assert null == RopeScaling(rope_type="default", rope_theta=1e6)
    assert RopeScaling.from_hf_config({}).rope_theta == 10000.0
    explicit_none = RopeScaling.from_hf_config({"rope_parameters": {"rope_type": None}})
    assert explicit_none.rope_type == "default"


def test_from_hf_config_reads_the_v5_layout():
    cfg = {
        "max_position_embeddings": 262144,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 32,
            "original_max_position_embeddings": 8192,
            "rope_theta": 10000000.0,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    }
    rope = RopeScaling.from_hf_config(cfg)
    assert rope == RopeScaling(
        rope_type="yarn",
        rope_theta=1e7,
        factor=32.0,
        original_max_position_embeddings=8192,
        beta_fast=32.0,
        beta_slow=1.0,
    )
    # a transformers-5 config object round-trips to the same parameters
    assert RopeScaling.from_hf_config(llama_config(cfg["rope_parameters"]).to_dict()) == rope


def test_yarn_and_llama3_default_original_max_to_max_position_embeddings():
    cfg = {"max_position_embeddings": 2048, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}
    assert RopeScaling.from_hf_config(cfg).original_max_position_embeddings == 2048
    top_level = dict(cfg, original_max_position_embeddings=1024)
    assert RopeScaling.from_hf_config(top_level).original_max_position_embeddings == 1024


def test_per_layer_type_rope_parameters_need_a_layer_type():
    cfg = {
        "layer_types": ["full_attention", "sliding_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    }
    assert RopeScaling.from_hf_config(cfg, layer_type="full_attention").factor == 8.0
    assert RopeScaling.from_hf_config(cfg, layer_type="sliding_attention").rope_theta == 1e4
    with pytest.raises(ConfigError, match="per layer type"):
        RopeScaling.from_hf_config(cfg)


@pytest.mark.parametrize(
    ("cfg", "field"),
    [
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.type"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling.rope_type"),
        ({"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}, "rope_scaling.type"),
        ({"rope_parameters": {"rope_type": "proportional"}}, "rope_parameters.rope_type"),
    ],
)
def test_unknown_rope_type_is_refused_with_the_supported_list(cfg, field):
    with pytest.raises(ConfigError) as info:
        RopeScaling.from_hf_config(cfg, source="ckpt/config.json")
    message = str(info.value)
    assert "ckpt/config.json" in message and field in message
    for supported in SUPPORTED_ROPE_TYPES:
        assert supported in message


def test_mrope_section_under_a_default_type_is_refused():
    cfg = {"rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24]}}
    with pytest.raises(ConfigError, match="mrope_section"):
        RopeScaling.from_hf_config(cfg)


def test_missing_llama3_keys_are_named():
    cfg = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "max_position_embeddings": 8}
    with pytest.raises(ConfigError, match="low_freq_factor") as info:
        RopeScaling.from_hf_config(cfg, source="x/config.json")
    assert "x/config.json" in str(info.value)
    with pytest.raises(ConfigError, match="factor"):
        RopeScaling.from_hf_config({"rope_scaling": {"type": "linear"}})


@pytest.mark.parametrize("name", ["default-1e4", "linear-2", "llama3.1", "yarn-radixark"])
def test_apply_rope_equals_transformers_apply_rotary_pos_emb(name):
    torch.manual_seed(0)
    max_pos, batch, heads, seq = 512, 2, 3, 7
    config = llama_config(ROPE_CASES[name], max_pos=max_pos)
    rotary = LlamaRotaryEmbedding(config)
    q = torch.randn(batch, heads, seq, HEAD_DIM)  # HF layout [B, H, S, D]
    k = torch.randn(batch, heads, seq, HEAD_DIM)
    positions = torch.randint(0, max_pos, (batch, seq))
    cos, sin = rotary(q, positions)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)

    table = rope_cos_sin_table(HEAD_DIM, max_pos, RopeScaling.from_hf_config(config.to_dict()))
    half = HEAD_DIM // 2
    torch.testing.assert_close(table[positions][..., :half], cos[..., :half], rtol=0, atol=1e-7)
    torch.testing.assert_close(table[positions][..., half:], sin[..., half:], rtol=0, atol=1e-7)
    q_ours = apply_rope(q.transpose(1, 2), positions.int(), table).transpose(1, 2)
    k_ours = apply_rope(k.transpose(1, 2), positions.int(), table).transpose(1, 2)
    torch.testing.assert_close(q_ours, q_hf, rtol=0, atol=1e-6)
    torch.testing.assert_close(k_ours, k_hf, rtol=0, atol=1e-6)


def test_partial_apply_rope_equals_gpt_neox_and_keeps_the_tail():
    torch.manual_seed(1)
    head_dim, max_pos = 32, 64
    config = GPTNeoXConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        max_position_embeddings=max_pos,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
    )
    rotary = GPTNeoXRotaryEmbedding(config)
    q = torch.randn(1, 2, 5, head_dim)
    positions = torch.randint(0, max_pos, (1, 5))
    cos, sin = rotary(q, positions)
    q_hf, _ = neox_apply_rotary_pos_emb(q, q, cos, sin)

    rope = RopeScaling.from_hf_config(config.to_dict())
    rotary_dim = rope.rotary_dim(head_dim)
    assert rotary_dim == 8
    table = rope_cos_sin_table(rotary_dim, max_pos, rope)
    q_ours = apply_rope(q.transpose(1, 2), positions.int(), table).transpose(1, 2)
    torch.testing.assert_close(q_ours, q_hf, rtol=0, atol=1e-6)
    assert torch.equal(q_ours[..., rotary_dim:], q[..., rotary_dim:])


def test_apply_rope_keeps_dtype_and_rounds_once_from_fp32():
    torch.manual_seed(2)
    table = rope_cos_sin_table(16, 32, RopeScaling())
    x = torch.randn(2, 3, 4, 16).bfloat16()
    positions = torch.randint(0, 32, (2, 3), dtype=torch.int32)
    out = apply_rope(x, positions, table)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, apply_rope(x.float(), positions, table).bfloat16())


def test_apply_rope_refuses_positions_beyond_the_table():
    table = rope_cos_sin_table(8, 10, RopeScaling())
    with pytest.raises(ValueError, match="10 rows"):
        apply_rope(torch.zeros(1, 2, 8), torch.tensor([[3, 10]]), table)


@pytest.mark.parametrize(
    "params, field",
    [
        ({"rope_type": "yarn", "factor": "x"}, "rope_parameters.factor"),
        ({"rope_theta": "abc", "rope_type": "default"}, "rope_parameters.rope_theta"),
        (
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": [1], "high_freq_factor": 4.0},
            "rope_parameters.low_freq_factor",
        ),  # fmt: skip
        ({"rope_type": "linear", "factor": True}, "rope_parameters.factor"),
    ],
)
def test_a_rope_value_of_the_wrong_type_is_a_config_error_naming_it(params, field):
    cfg = {"rope_parameters": params, "max_position_embeddings": 64}
    with pytest.raises(ConfigError, match=rf"x/config\.json: {field} must be a number"):
        RopeScaling.from_hf_config(cfg, source="x/config.json")


def test_the_cli_exits_2_on_a_rope_value_of_the_wrong_type(tmp_path):
    import json

    from click.testing import CliRunner
    from tiny_checkpoints import write_tiny_llama

    from edgebuild.cli import main

    ckpt = write_tiny_llama(tmp_path / "m", layers=1)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": "x"}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    result = CliRunner().invoke(main, ["inspect", str(ckpt)])
    assert result.exit_code == 2, result.output
    assert "config.json" in result.output and "rope_parameters.factor" in result.output


def test_positions_outside_the_table_are_refused_whatever_their_count():
    """check_positions on a few positions (Python ints) and on many (tensor ops): the same
    refusal with the span, and float positions refused; in-range positions pass."""
    from edgebuild.ops.rope import check_positions

    table = torch.zeros(100, 8)
    for n in (2, 64, 65, 300):
        ok = torch.arange(n, dtype=torch.int32) % 100
        check_positions(ok, table)
        for bad, span in ((ok + 99, "99"), (ok - 1, "-1")):
            with pytest.raises(ValueError, match=rf"positions span \[.*{span}.*\].*100 rows"):
                check_positions(bad, table)
    with pytest.raises(ValueError, match="integer tensor"):
        check_positions(torch.zeros(3), table)
    check_positions(torch.zeros(0, dtype=torch.long), table)
