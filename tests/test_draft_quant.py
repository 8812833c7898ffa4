"""The draft's own packing (speculative ``quantization``) on the torch runtime.

Oracles: the packing each draft linear actually got (its PackedLinear), the resolution rule of
:func:`draft_quant` stated in its docstring, and greedy DSpark output equal to target-only
token for token whatever the draft's packing (verification decides every token).
"""

from __future__ import annotations

import pytest
import torch
from dspark_fixtures import assert_greedy_dspark_equals_target_only, make_random_draft
from serve_fixtures import torch_threads, write_tiny_chat_model

from edgebuild.errors import ConfigError
from edgebuild.ops import f32_linear
from edgebuild.runtime.dspark_loader import draft_quant
from edgebuild.runtime.llm import LLM, RuntimeOptions
from edgebuild.speculative.config import SpeculativeConfig


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = write_tiny_chat_model(root / "tiny")
    return target, make_random_draft(root / "draft", target, block_size=4)


def spec(draft, **extra) -> dict:
    return {"method": "dspark", "model": str(draft), "num_speculative_tokens": 3,
            "confidence_scheduling": False, **extra}  # fmt: skip


def draft_packing(llm: LLM) -> set:
    """The quant mode of every packed linear of the loaded draft (layers and lm_head)."""
    model = llm.draft.model
    packed = [model.packed_lm_head]
    for layer in model.layers:
        sa, mlp = layer.self_attn, layer.mlp
        packed += [sa.packed_qkv, sa.packed_kv, sa.packed_o, mlp.packed_gate_up, mlp.packed_down]
    return {p.quant for p in packed}


def test_quantization_values_are_parsed_and_bad_ones_refused_by_name(pair):
    _, draft = pair
    assert SpeculativeConfig.parse(spec(draft)).quantization is None
    for q in ("int4", "int8", "none"):
        assert SpeculativeConfig.parse(spec(draft, quantization=q)).quantization == q
    for bad in ("fp8", 4, True, "INT4"):
        with pytest.raises(ConfigError, match="quantization must be one of"):
            SpeculativeConfig.parse(spec(draft, quantization=bad))


class Cfg:
    hidden_size, intermediate_size, num_attention_heads, head_dim = 64, 128, 4, 16


def test_the_default_is_int4_on_fp32_runtimes_only():
    kernels = f32_linear.available()
    assert draft_quant(None, torch.float32, None, Cfg) == ("int4" if kernels else None)
    assert draft_quant(None, torch.bfloat16, None, Cfg) is None  # bf16: as the target
    assert draft_quant(None, torch.float32, "int8", Cfg) == "int8"  # a quantized target's mode
    assert draft_quant(None, torch.bfloat16, "int4", Cfg) == "int4"
    odd = type("Odd", (Cfg,), {"intermediate_size": 120})  # not a multiple of int4's group
    assert draft_quant(None, torch.float32, None, odd) is None
    assert draft_quant("none", torch.float32, "int4", Cfg) is None  # given wins
    assert draft_quant("int8", torch.bfloat16, None, Cfg) == "int8"


@pytest.mark.parametrize("given", [None, "none", "int8"])
def test_greedy_dspark_equals_target_only_whatever_the_draft_packing(pair, given):
    target, draft = pair
    opts = RuntimeOptions(dtype=torch.float32, max_kv_rows=512, page_size=8)
    extra = {} if given is None else {"quantization": given}
    with torch_threads(1):
        llm = LLM(target, speculative=spec(draft, **extra), options=opts)
        want = {None: "int4" if f32_linear.available() else None, "none": None, "int8": "int8"}
        assert draft_packing(llm) == {want[given]}
        tm = llm.target_model  # the target keeps its own (here: no) --quant
        assert {tm.packed_lm_head.quant, tm.model.layers[0].mlp.packed_down.quant} == {None}
        assert_greedy_dspark_equals_target_only(llm, ["hello there", "one two three four", "abc"])
