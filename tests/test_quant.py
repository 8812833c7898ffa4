"""edgebuild.checkpoint.quant: formats, configs and dequantization against independent oracles.

Oracles: ModelOpt's own ``NVFP4QTensor`` quantize/dequantize (skipped when not installed),
numpy loops written from the spec (``spec/nvfp4-and-fp8-checkpoints.md``), hand-made bytes.
"""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch

from edgebuild.checkpoint.quant import (
    QuantAlgo,
    QuantConfig,
    QuantizedWeight,
    build_linear_weight,
    dequantize_fp8,
    dequantize_fp8_block,
    dequantize_nvfp4,
    is_quant_aux_tensor,
    load_quant_config,
    pack_nvfp4,
    quant_tensor_suffixes,
    unpack_nvfp4,
)
from edgebuild.errors import CheckpointError, QuantFormatError

MAGS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _code_value(code: int) -> float:
    """E2M1 code -> value, straight from the spec (bit 3 sign, bits 0..2 magnitude index)."""
    return (-1.0 if code & 8 else 1.0) * MAGS[code & 7]


def _modelopt_nvfp4(x: torch.Tensor):
    """(packed uint8, fp8 block scales, fp32 global scale, ModelOpt's dequantized x)."""
    qt = pytest.importorskip(
        "modelopt.torch.quantization.qtensor", reason="nvidia-modelopt not installed"
    )
    q, ws, ws2 = qt.NVFP4QTensor.quantize(x.clone(), 16)
    ref = q.dequantize(dtype=x.dtype, scale=ws, double_scale=ws2, block_sizes={-1: 16})
    return q._quantized_data, ws, ws2, ref


def _swap_nibbles(b: torch.Tensor) -> torch.Tensor:
    return ((b & 0x0F) << 4) | (b >> 4)


# ----------------------------------------------------------------------------- NVFP4 math


def test_byte_0x21_decodes_low_nibble_first():
    assert unpack_nvfp4(torch.tensor([0x21], dtype=torch.uint8)).tolist() == [0.5, 1.0]
    assert unpack_nvfp4(torch.tensor([[0x9F]], dtype=torch.uint8)).tolist() == [[-6.0, -0.5]]


def test_unpack_all_bytes_matches_spec_loop():
    b = torch.arange(256, dtype=torch.uint8)
    got = unpack_nvfp4(b.view(16, 16))
    want = [[_code_value(v & 15), _code_value(v >> 4)] for v in range(256)]
    assert got.dtype == torch.float32 and got.shape == (16, 32)
    assert got.reshape(256, 2).tolist() == want


@pytest.mark.parametrize("shape", [(64, 128), (33, 48), (4, 8, 32), (1, 16), (256, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_nvfp4_identical_to_modelopt(shape, dtype):
    g = torch.Generator().manual_seed(hash(shape) % 1000)
    x = (torch.randn(shape, generator=g) * torch.rand(shape[-2:], generator=g) * 5).to(dtype)
    packed, ws, ws2, ref = _modelopt_nvfp4(x)
    assert packed.dtype == torch.uint8 and ws.dtype == torch.float8_e4m3fn
    got = dequantize_nvfp4(packed, ws, ws2, dtype)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, ref)
    # quantization really happened: error vs x is non-zero but bounded
    rel = (got.float() - x.float()).norm() / x.float().norm()
    assert 0.0 < rel < 0.2


def test_swapped_nibbles_are_detected():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    packed, ws, ws2, ref = _modelopt_nvfp4(x)
    good = dequantize_nvfp4(packed, ws, ws2)
    bad = dequantize_nvfp4(_swap_nibbles(packed), ws, ws2)
    rel_good = ((good - ref).norm() / ref.norm()).item()
    rel_bad = ((bad - ref).norm() / ref.norm()).item()
    assert rel_good == 0.0
    assert rel_bad > 1.0, rel_bad  # the spec measured ~140%


def test_pack_matches_modelopt_packing():
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(5))
    packed, ws, ws2, _ = _modelopt_nvfp4(x)
    assert torch.equal(pack_nvfp4(unpack_nvfp4(packed)), packed)


def test_pack_unpack_round_trip():
    b = torch.arange(256, dtype=torch.uint8).view(8, 32)
    assert torch.equal(pack_nvfp4(unpack_nvfp4(b)), b)  # includes code 8 (-0.0)
    vals = torch.tensor([[0.0, 6.0, -0.5, 1.5, -6.0, 3.0]])
    packed = pack_nvfp4(vals)
    assert packed.shape == (1, 3) and packed[0, 0].item() == 0x70
    assert torch.equal(unpack_nvfp4(packed), vals)
    with pytest.raises(ValueError, match="not FP4 E2M1"):
        pack_nvfp4(torch.tensor([0.7, 1.0]))
    with pytest.raises(ValueError, match="even"):
        pack_nvfp4(torch.tensor([1.0, 1.0, 1.0]))


def test_dequantize_nvfp4_formula_by_hand():
    packed = torch.tensor([[0x21] * 8, [0x9F] * 8], dtype=torch.uint8)  # 2 rows x 16 values
    ws = torch.tensor([[2.0], [0.5]]).to(torch.float8_e4m3fn)
    ws2 = torch.tensor(0.25)
    got = dequantize_nvfp4(packed, ws, ws2)
    assert got[0, :2].tolist() == [0.5 * 2 * 0.25, 1.0 * 2 * 0.25]
    assert got[1, :2].tolist() == [-6.0 * 0.5 * 0.25, -0.5 * 0.5 * 0.25]
    with pytest.raises(QuantFormatError, match="does not fit"):
        dequantize_nvfp4(packed, torch.ones(2, 3).to(torch.float8_e4m3fn), ws2)


# ----------------------------------------------------------------------------- FP8 math


def _fp8(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 50).to(torch.float8_e4m3fn)


def test_dequantize_fp8_per_tensor_vs_numpy():
    w = _fp8((40, 24), 0)
    scale = torch.tensor(0.0371, dtype=torch.float32)
    want = w.float().numpy() * np.float32(0.0371)
    got = dequantize_fp8(w, scale)
    assert np.array_equal(got.numpy(), want)
    assert dequantize_fp8(w, scale, torch.bfloat16).dtype == torch.bfloat16
    per_ch = torch.linspace(0.01, 1.0, 40)
    assert np.allclose(
        dequantize_fp8(w, per_ch).numpy(), w.float().numpy() * per_ch.numpy()[:, None]
    )


@pytest.mark.parametrize(
    "shape,block", [((256, 256), (128, 128)), ((300, 200), (128, 128)), ((130, 129), (64, 32))]
)
def test_dequantize_fp8_block_vs_loop(shape, block):
    w = _fp8(shape, 1)
    bo, bi = block
    rows, cols = math.ceil(shape[0] / bo), math.ceil(shape[1] / bi)
    s = torch.rand(rows, cols, generator=torch.Generator().manual_seed(2)) + 0.01
    wf, sf = w.float().numpy(), s.numpy()
    want = np.empty(shape, dtype=np.float32)
    for i in range(shape[0]):
        for j in range(shape[1]):
            want[i, j] = wf[i, j] * sf[i // bo, j // bi]
    got = dequantize_fp8_block(w, s, block)
    assert got.shape == shape and np.array_equal(got.numpy(), want)
    with pytest.raises(QuantFormatError, match="weight_scale_inv"):
        dequantize_fp8_block(w, s[:, :-1], block)


# ----------------------------------------------------------------------------- configs

NVFP4_HF = {
    "producer": {"name": "modelopt", "version": "0.47.0"},
    "quantization": {
        "quant_algo": "NVFP4",
        "kv_cache_quant_algo": None,
        "group_size": 16,
        "exclude_modules": ["lm_head", "model.embed_tokens"],
    },
}


def _write(d, name, obj):
    (d / name).write_text(obj if isinstance(obj, str) else json.dumps(obj))


def test_hf_quant_config_nvfp4(tmp_path):
    _write(tmp_path, "hf_quant_config.json", NVFP4_HF)
    qc = load_quant_config(tmp_path, {"quantization_config": {"quant_method": "fp8"}})
    assert qc.algo is QuantAlgo.NVFP4 and qc.group_size == 16
    assert qc.exclude_modules == ("lm_head", "model.embed_tokens")
    assert qc.kv_cache_quant_algo is None and "hf_quant_config.json" in qc.source
    assert qc.algo_for("model.layers.0.mlp.down_proj") is QuantAlgo.NVFP4
    assert qc.algo_for("model.layers.0.mlp.down_proj.weight") is QuantAlgo.NVFP4
    assert qc.algo_for("lm_head") is QuantAlgo.NONE
    assert qc.algo_for("model.embed_tokens") is QuantAlgo.NONE
    assert qc.algo_for("embed_tokens") is QuantAlgo.NONE  # leading "model." ignored
    assert qc.is_quantized


def test_hf_quant_config_defaults_and_kv(tmp_path):
    _write(
        tmp_path,
        "hf_quant_config.json",
        {"quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8"}},
    )
    qc = load_quant_config(tmp_path, {})
    assert qc.group_size == 16 and qc.kv_cache_quant_algo == "FP8" and qc.exclude_modules == ()


def test_mixed_precision_per_layer(tmp_path):
    q = {
        "quant_algo": "MIXED_PRECISION",
        "kv_cache_quant_algo": None,
        "quantized_layers": {
            "model.layers.0.self_attn.q_proj": {"quant_algo": "NVFP4", "group_size": 16},
            "layers.1.mlp.down_proj": {"quant_algo": "FP8"},
            "lm_head": {"quant_algo": "FP8"},
        },
        "exclude_modules": ["model.layers.1.*"],
    }
    _write(tmp_path, "hf_quant_config.json", {"quantization": q})
    qc = load_quant_config(tmp_path, {})
    assert qc.algo is QuantAlgo.MIXED_PRECISION
    assert qc.algo_for("model.layers.0.self_attn.q_proj") is QuantAlgo.NVFP4
    assert qc.algo_for("model.layers.1.mlp.down_proj") is QuantAlgo.FP8  # per_layer before exclude
    assert qc.algo_for("lm_head") is QuantAlgo.FP8
    assert qc.algo_for("model.layers.0.self_attn.k_proj") is QuantAlgo.NONE  # not listed
    assert qc.algo_for("model.layers.1.mlp.up_proj") is QuantAlgo.NONE
    q["quantized_layers"]["lm_head"] = {"quant_algo": "W4A16_AWQ"}
    _write(tmp_path, "hf_quant_config.json", {"quantization": q})
    with pytest.raises(QuantFormatError, match=r'quantized_layers\["lm_head"\].quant_algo'):
        load_quant_config(tmp_path, {})


def test_config_json_modelopt_form(tmp_path):
    config = {
        "quantization_config": {
            "config_groups": {
                "group_0": {
                    "input_activations": {
                        "dynamic": False,
                        "num_bits": 4,
                        "type": "float",
                        "group_size": 16,
                    },
                    "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                    "targets": ["Linear"],
                }
            },
            "ignore": ["lm_head", "model.embed_tokens"],
            "quant_algo": "NVFP4",
            "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
            "quant_method": "modelopt",
        }
    }
    qc = load_quant_config(tmp_path, config)
    assert qc.algo is QuantAlgo.NVFP4 and qc.group_size == 16
    assert qc.exclude_modules == ("lm_head", "model.embed_tokens")
    assert qc.kv_cache_quant_algo == "FP8"
    assert "config.json" in qc.source and "quantization_config" in qc.source
    del config["quantization_config"]["quant_algo"]  # inferred from config_groups
    assert load_quant_config(tmp_path, config).algo is QuantAlgo.NVFP4


def test_config_json_fp8_block_form(tmp_path):
    config = {
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head"],
        }
    }
    qc = load_quant_config(tmp_path, config)
    assert qc.algo is QuantAlgo.FP8_BLOCK and qc.weight_block_size == (128, 128)
    assert qc.algo_for("lm_head") is QuantAlgo.NONE
    assert qc.algo_for("model.layers.3.mlp.up_proj") is QuantAlgo.FP8_BLOCK
    config["quantization_config"]["fmt"] = "e5m2"
    with pytest.raises(QuantFormatError, match="fmt"):
        load_quant_config(tmp_path, config)


def test_no_quantization(tmp_path):
    qc = load_quant_config(tmp_path, {"hidden_size": 8})
    assert qc.algo is QuantAlgo.NONE and not qc.is_quantized
    assert qc.algo_for("model.layers.0.mlp.up_proj") is QuantAlgo.NONE
    assert QuantConfig.none().algo is QuantAlgo.NONE


def test_wildcard_excludes():
    qc = QuantConfig(
        algo=QuantAlgo.NVFP4,
        exclude_modules=("model.layers.0.*", "*mlp.gate", "lm_head", "model.layers.1.self_attn"),
    )
    assert qc.algo_for("model.layers.0.mlp.up_proj") is QuantAlgo.NONE
    assert qc.algo_for("layers.0.self_attn.q_proj") is QuantAlgo.NONE
    assert qc.algo_for("model.layers.2.mlp.gate") is QuantAlgo.NONE
    assert qc.algo_for("model.layers.2.mlp.gate_proj") is QuantAlgo.NVFP4
    assert qc.algo_for("model.layers.1.self_attn.q_proj") is QuantAlgo.NONE  # child of exact name
    assert qc.algo_for("model.layers.1.mlp.down_proj") is QuantAlgo.NVFP4
    assert qc.algo_for("model.layers.10.mlp.up_proj") is QuantAlgo.NVFP4  # not layers.1*
    assert qc.algo_for("lm_head") is QuantAlgo.NONE


def test_unsupported_algo_message(tmp_path):
    _write(
        tmp_path,
        "hf_quant_config.json",
        {"quantization": {"quant_algo": "W4A16_AWQ", "group_size": 128}},
    )
    with pytest.raises(QuantFormatError) as e:
        load_quant_config(tmp_path, {})
    msg = str(e.value)
    for part in ("hf_quant_config.json", "quant_algo", "W4A16_AWQ", "NVFP4", "FP8", "FP8_BLOCK"):
        assert part in msg, (part, msg)


def test_unsupported_quant_method_message(tmp_path):
    config = {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}}
    with pytest.raises(QuantFormatError) as e:
        load_quant_config(tmp_path, config)
    msg = str(e.value)
    for part in ("config.json", "quant_method", "'awq'", "modelopt", "fp8"):
        assert part in msg, (part, msg)


def test_other_config_errors(tmp_path):
    _write(tmp_path, "hf_quant_config.json", '{"quantization": {"quant_algo": "NVFP4",')
    with pytest.raises(QuantFormatError, match="hf_quant_config.json.*not valid JSON"):
        load_quant_config(tmp_path, {})
    _write(
        tmp_path,
        "hf_quant_config.json",
        {"quantization": {"quant_algo": "NVFP4", "group_size": 32}},
    )
    with pytest.raises(QuantFormatError, match="group_size"):
        load_quant_config(tmp_path, {})
    _write(
        tmp_path,
        "hf_quant_config.json",
        {"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "INT8"}},
    )
    with pytest.raises(QuantFormatError, match="kv_cache_quant_algo"):
        load_quant_config(tmp_path, {})


# ----------------------------------------------------------------------------- build_linear_weight


def _nvfp4_tensors(prefix="model.layers.0.mlp.down_proj", out=32, inn=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(out, inn, generator=g)
    packed, ws, ws2, ref = _modelopt_nvfp4(x)
    tensors = {
        f"{prefix}.weight": packed,
        f"{prefix}.weight_scale": ws,
        f"{prefix}.weight_scale_2": ws2,
        f"{prefix}.input_scale": torch.tensor(0.02),
    }
    return tensors, ref


NVFP4_CFG = QuantConfig(
    algo=QuantAlgo.NVFP4, exclude_modules=("lm_head",), source="hf_quant_config.json"
)


def test_build_nvfp4_from_mapping():
    tensors, ref = _nvfp4_tensors()
    w = build_linear_weight(
        "model.layers.0.mlp.down_proj", tensors, NVFP4_CFG, "target", "m.safetensors"
    )
    assert isinstance(w, QuantizedWeight)
    assert w.format is QuantAlgo.NVFP4 and w.shape == (32, 64) and w.group_size == 16
    assert w.checkpoint_source == "target" and w.file == "m.safetensors"
    assert w.input_scale is not None and w.nbytes == 32 * 32 + 32 * 4 + 4 + 4
    assert torch.equal(w.dequantize(), ref)
    assert w.dequantize(torch.bfloat16).dtype == torch.bfloat16


def test_build_fp8_and_fp8_block_and_dense():
    wq = _fp8((20, 48), 3)
    fp8 = {"p.weight": wq, "p.weight_scale": torch.tensor(0.5), "p.input_scale": torch.tensor(1.0)}
    cfg = QuantConfig(algo=QuantAlgo.FP8)
    w = build_linear_weight("p", fp8, cfg)
    assert isinstance(w, QuantizedWeight) and w.format is QuantAlgo.FP8 and w.shape == (20, 48)
    assert torch.equal(w.dequantize(), wq.float() * 0.5)

    blk = {"p.weight": wq, "p.weight_scale_inv": torch.tensor([[2.0, 3.0]])}
    cfgb = QuantConfig(algo=QuantAlgo.FP8_BLOCK, weight_block_size=(32, 32))
    w = build_linear_weight("p", blk, cfgb)
    assert w.format is QuantAlgo.FP8_BLOCK and w.block_size == (32, 32)
    want = wq.float().clone()
    want[:, :32] *= 2.0
    want[:, 32:] *= 3.0
    assert torch.equal(w.dequantize(), want)

    dense = torch.randn(8, 16, dtype=torch.bfloat16)
    assert build_linear_weight("p", {"p.weight": dense}, QuantConfig.none()) is dense


def test_lookup_kinds():
    tensors, ref = _nvfp4_tensors(prefix="x")

    class Reader:  # get() raises on absent names, like a strict safetensors reader
        def has(self, name):
            return name in tensors

        def get(self, name):
            return tensors[name]

    for lookup in (tensors, tensors.get, Reader()):
        w = build_linear_weight("x", lookup, NVFP4_CFG)
        assert torch.equal(w.dequantize(), ref)
    with pytest.raises(CheckpointError, match="'y.weight' not found"):
        build_linear_weight("y", Reader(), NVFP4_CFG, file="f.safetensors")


def test_excluded_but_stored_packed_logs_note(caplog):
    tensors, ref = _nvfp4_tensors(prefix="lm_head", out=48)
    assert NVFP4_CFG.algo_for("lm_head") is QuantAlgo.NONE
    with caplog.at_level(logging.INFO, logger="edgebuild.checkpoint"):
        w = build_linear_weight("lm_head", tensors, NVFP4_CFG, file="model.safetensors")
    assert isinstance(w, QuantizedWeight) and torch.equal(w.dequantize(), ref)
    notes = [r for r in caplog.records if r.name == "edgebuild.checkpoint"]
    assert len(notes) == 1 and notes[0].levelno == logging.WARNING
    assert "lm_head" in notes[0].getMessage() and "NVFP4" in notes[0].getMessage()

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="edgebuild.checkpoint"):
        build_linear_weight(
            "model.layers.0.mlp.up_proj",
            {"model.layers.0.mlp.up_proj.weight": torch.ones(4, 16)},
            NVFP4_CFG,
        )
    assert [r.levelno for r in caplog.records] == [logging.INFO]

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="edgebuild.checkpoint"):
        t, _ = _nvfp4_tensors()
        build_linear_weight("model.layers.0.mlp.down_proj", t, NVFP4_CFG)
    assert caplog.records == []  # consistent: no note


@pytest.mark.parametrize(
    "suffix,bad",
    [
        ("weight_scale", float("nan")),
        ("weight_scale_2", float("inf")),
        ("input_scale", float("nan")),
    ],
)
def test_nan_inf_scales_rejected(suffix, bad):
    tensors, _ = _nvfp4_tensors(prefix="q")
    t = tensors[f"q.{suffix}"].float().clone()
    t.view(-1)[0] = bad
    tensors[f"q.{suffix}"] = t.to(tensors[f"q.{suffix}"].dtype)
    with pytest.raises(QuantFormatError) as e:
        build_linear_weight("q", tensors, NVFP4_CFG, file="model-00001.safetensors")
    msg = str(e.value)
    assert f"'q.{suffix}'" in msg and "model-00001.safetensors" in msg and "NaN or Inf" in msg
    assert "re-export" in msg


def test_fp8_block_inf_rejected():
    blk = {"p.weight": _fp8((20, 48), 3), "p.weight_scale_inv": torch.tensor([[2.0, float("inf")]])}
    with pytest.raises(QuantFormatError, match="'p.weight_scale_inv'.*NaN or Inf"):
        build_linear_weight(
            "p", blk, QuantConfig(algo=QuantAlgo.FP8_BLOCK, weight_block_size=(32, 32))
        )


def test_bad_shapes_and_dtypes_rejected():
    tensors, _ = _nvfp4_tensors(prefix="q")
    t = dict(tensors, **{"q.weight_scale": tensors["q.weight_scale"][:, :2]})
    with pytest.raises(
        QuantFormatError, match="'q.weight_scale'.*expected float8_e4m3fn \\[32, 4\\]"
    ):
        build_linear_weight("q", t, NVFP4_CFG)
    t = dict(tensors, **{"q.weight_scale": tensors["q.weight_scale"].float()})
    with pytest.raises(QuantFormatError, match="'q.weight_scale'.*float8_e4m3fn"):
        build_linear_weight("q", t, NVFP4_CFG)
    t = {k: v for k, v in tensors.items() if not k.endswith("weight_scale_2")}
    with pytest.raises(QuantFormatError, match="'q.weight_scale_2' is missing"):
        build_linear_weight("q", t, NVFP4_CFG)
    with pytest.raises(QuantFormatError, match="int8"):
        build_linear_weight("q", {"q.weight": torch.zeros(4, 4, dtype=torch.int8)}, NVFP4_CFG)
    with pytest.raises(QuantFormatError, match="weight_scale_inv"):
        build_linear_weight("q", {"q.weight": _fp8((4, 4), 0)}, NVFP4_CFG)
    bad_blk = {"p.weight": _fp8((20, 48), 3), "p.weight_scale_inv": torch.ones(3, 3)}
    with pytest.raises(QuantFormatError, match="expected float32 \\[1, 2\\]"):
        build_linear_weight(
            "p", bad_blk, QuantConfig(algo=QuantAlgo.FP8_BLOCK, weight_block_size=(32, 32))
        )


def test_suffixes():
    sfx = quant_tensor_suffixes()
    assert set(sfx) == {
        "weight_scale",
        "weight_scale_2",
        "input_scale",
        "weight_scale_inv",
        "k_scale",
        "v_scale",
    }
    assert is_quant_aux_tensor("model.layers.0.self_attn.k_proj.k_scale")
    assert not is_quant_aux_tensor("model.layers.0.self_attn.k_proj.weight")
