"""edgebuild.quantize + quant.py on real ModelOpt exports of a tiny Qwen3 (CPU, a few seconds).

The oracle for every packed weight is ModelOpt's own ``NVFP4QTensor.dequantize`` on the same
packed data and scales; the BF16 source weights check that the export means what we think.
"""

from __future__ import annotations

import copy
import json
import logging
import sys

import pytest
import torch

try:
    import modelopt.torch.quantization  # noqa: F401
    from modelopt.torch.quantization.qtensor import NVFP4QTensor
except Exception as exc:  # noqa: BLE001 - any import failure means "cannot test here"
    reason = f"nvidia-modelopt cannot be imported ({exc}); pip install 'edgebuild[quant]'"
    print(f"SKIP tests/test_quantize_modelopt.py: {reason}", file=sys.stderr)
    pytest.skip(reason, allow_module_level=True)

from modelopt_fixtures import make_tiny_nvfp4_qwen3, make_tiny_qwen3, random_calib_inputs
from safetensors import safe_open

from edgebuild.checkpoint.quant import (
    QuantAlgo,
    QuantizedWeight,
    build_linear_weight,
    load_quant_config,
)
from edgebuild.errors import CheckpointError, ConfigError, MissingDependencyError
from edgebuild.quantize import default_calib_prompts, lm_head_quant_cfg, quantize_checkpoint

LINEARS = [
    f"model.layers.{i}.{m}"
    for i in range(2)
    for m in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
]
SHAPES = {  # logical [out, in] for hidden 64, 4 heads x 16, 2 kv heads, intermediate 128
    "q_proj": (64, 64),
    "k_proj": (32, 64),
    "v_proj": (32, 64),
    "o_proj": (64, 64),
    "gate_proj": (128, 64),
    "up_proj": (128, 64),
    "down_proj": (64, 128),
}


def _tensors(ckpt):
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="session")
def nvfp4_plain(tmp_path_factory):
    return make_tiny_nvfp4_qwen3(tmp_path_factory.mktemp("nvfp4"), quantize_lm_head=False)


@pytest.fixture(scope="session")
def nvfp4_head(tmp_path_factory):
    return make_tiny_nvfp4_qwen3(tmp_path_factory.mktemp("nvfp4h"), quantize_lm_head=True)


@pytest.fixture(scope="session")
def source_weights(nvfp4_plain):
    # make_tiny_nvfp4_qwen3 writes its BF16 source next to the export (same seed for both)
    return _tensors(nvfp4_plain.parent / "src-qwen3-tiny-nvfp4" / "qwen3-tiny")


def _oracle(packed, ws, ws2, dtype=torch.float32):
    out, half = packed.shape
    q = NVFP4QTensor((out, half * 2), dtype, packed)
    return q.dequantize(dtype=dtype, scale=ws, double_scale=ws2, block_sizes={-1: 16})


def test_export_files_and_config(nvfp4_plain, nvfp4_head):
    for ckpt, head in ((nvfp4_plain, False), (nvfp4_head, True)):
        names = {p.name for p in ckpt.iterdir()}
        assert {"config.json", "hf_quant_config.json", "model.safetensors"} <= names
        assert not [n for n in ckpt.parent.iterdir() if ".partial-" in n.name]
        config = json.loads((ckpt / "config.json").read_text())
        assert config["quantization_config"]["quant_method"] == "modelopt"
        assert config["architectures"] == ["Qwen3ForCausalLM"]
        qc = load_quant_config(ckpt, config)
        assert qc.algo is QuantAlgo.NVFP4 and qc.group_size == 16
        assert qc.algo_for("lm_head") is (QuantAlgo.NVFP4 if head else QuantAlgo.NONE)
        assert qc.algo_for("model.embed_tokens") is QuantAlgo.NONE
        assert qc.algo_for("model.layers.1.mlp.down_proj") is QuantAlgo.NVFP4
        # config.json's own quantization_config reads the same
        (ckpt / "hf_quant_config.json").rename(ckpt / "hf.bak")
        try:
            qc2 = load_quant_config(ckpt, config)
        finally:
            (ckpt / "hf.bak").rename(ckpt / "hf_quant_config.json")
        assert qc2.algo is qc.algo and set(qc2.exclude_modules) == set(qc.exclude_modules)


@pytest.mark.parametrize("head", [False, True])
def test_exported_tensors_and_dtypes(nvfp4_plain, nvfp4_head, head):
    t = _tensors(nvfp4_head if head else nvfp4_plain)
    for prefix in LINEARS:
        out, inn = SHAPES[prefix.rsplit(".", 1)[-1]]
        assert t[f"{prefix}.weight"].dtype == torch.uint8
        assert t[f"{prefix}.weight"].shape == (out, inn // 2)
        assert t[f"{prefix}.weight_scale"].dtype == torch.float8_e4m3fn
        assert t[f"{prefix}.weight_scale"].shape == (out, inn // 16)
        for s in ("weight_scale_2", "input_scale"):
            assert t[f"{prefix}.{s}"].dtype == torch.float32 and t[f"{prefix}.{s}"].shape == ()
    assert t["model.embed_tokens.weight"].dtype == torch.bfloat16
    if head:
        assert t["lm_head.weight"].dtype == torch.uint8 and t["lm_head.weight"].shape == (1000, 32)
        assert t["lm_head.weight_scale"].dtype == torch.float8_e4m3fn
        assert t["lm_head.weight_scale"].shape == (1000, 4)
        assert t["lm_head.weight_scale_2"].shape == ()
    else:
        assert t["lm_head.weight"].dtype == torch.bfloat16 and t["lm_head.weight"].shape == (
            1000,
            64,
        )
        assert "lm_head.weight_scale" not in t


@pytest.mark.parametrize("head", [False, True])
def test_dequant_matches_modelopt_oracle(nvfp4_plain, nvfp4_head, source_weights, head, caplog):
    ckpt = nvfp4_head if head else nvfp4_plain
    t = _tensors(ckpt)
    qc = load_quant_config(ckpt, json.loads((ckpt / "config.json").read_text()))
    prefixes = LINEARS + (["lm_head"] if head else [])
    with caplog.at_level(logging.INFO, logger="edgebuild.checkpoint"):
        for prefix in prefixes:
            w = build_linear_weight(prefix, t.get, qc, "component", str(ckpt / "model.safetensors"))
            assert isinstance(w, QuantizedWeight) and w.format is QuantAlgo.NVFP4, prefix
            d = w.dequantize(torch.float32)
            oracle = _oracle(
                t[f"{prefix}.weight"], t[f"{prefix}.weight_scale"], t[f"{prefix}.weight_scale_2"]
            )
            assert torch.equal(d, oracle), prefix
            assert torch.equal(
                w.dequantize(torch.bfloat16),
                _oracle(
                    t[f"{prefix}.weight"],
                    t[f"{prefix}.weight_scale"],
                    t[f"{prefix}.weight_scale_2"],
                    torch.bfloat16,
                ),
            )
            # and it is the source weight, NVFP4-rounded (a nibble swap would give ~140%)
            src = source_weights[f"{prefix}.weight"].float()
            assert d.shape == src.shape
            rel = ((d - src).norm() / src.norm()).item()
            assert rel < 0.15, (prefix, rel)
    assert not caplog.records  # tensors agree with the config: no notes
    if not head:
        dense = build_linear_weight("lm_head", t, qc)
        assert isinstance(dense, torch.Tensor) and dense.dtype == torch.bfloat16


def test_tied_embeddings_with_quantized_head(tmp_path):
    ckpt = make_tiny_nvfp4_qwen3(tmp_path, quantize_lm_head=True, tie_word_embeddings=True)
    config = json.loads((ckpt / "config.json").read_text())
    assert config["tie_word_embeddings"] is False  # separate quantized head, BF16 embedding
    t = _tensors(ckpt)
    assert t["lm_head.weight"].dtype == torch.uint8
    assert t["model.embed_tokens.weight"].dtype == torch.bfloat16
    qc = load_quant_config(ckpt, config)
    w = build_linear_weight("lm_head", t, qc)
    emb = t["model.embed_tokens.weight"].float()
    assert ((w.dequantize() - emb).norm() / emb.norm()).item() < 0.15


def test_fp8_export(tmp_path):
    src = make_tiny_qwen3(tmp_path / "src", seed=2)
    ckpt = quantize_checkpoint(
        src, tmp_path / "fp8", quant="fp8", calib_inputs=random_calib_inputs(4)
    )
    t, s = _tensors(ckpt), _tensors(src)
    qc = load_quant_config(ckpt, json.loads((ckpt / "config.json").read_text()))
    assert qc.algo is QuantAlgo.FP8 and qc.algo_for("lm_head") is QuantAlgo.NONE
    for prefix in LINEARS:
        w = build_linear_weight(prefix, t, qc)
        assert w.format is QuantAlgo.FP8 and w.data.dtype == torch.float8_e4m3fn
        assert torch.equal(
            w.dequantize(), t[f"{prefix}.weight"].float() * t[f"{prefix}.weight_scale"]
        )
        ref = s[f"{prefix}.weight"].float()
        assert ((w.dequantize() - ref).norm() / ref.norm()).item() < 0.06


def test_lm_head_cfg_does_not_touch_modelopt_defaults():
    import modelopt.torch.quantization as mtq

    before = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
    cfg = lm_head_quant_cfg(mtq.NVFP4_DEFAULT_CFG, mtq.NVFP4_DEFAULT_CFG)
    assert mtq.NVFP4_DEFAULT_CFG == before
    names = [e.get("quantizer_name") for e in cfg["quant_cfg"]]
    assert "*lm_head*" not in names and "*lm_head*weight_quantizer" in names
    assert lm_head_quant_cfg(mtq.NVFP4_DEFAULT_CFG, None) == mtq.NVFP4_DEFAULT_CFG


def test_quantize_errors(tmp_path, monkeypatch):
    src = make_tiny_qwen3(tmp_path / "src")
    with pytest.raises(ConfigError, match="int4"):
        quantize_checkpoint(src, tmp_path / "o", quant="int4")
    with pytest.raises(ConfigError, match="lm_head"):
        quantize_checkpoint(src, tmp_path / "o", lm_head="bf16")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(CheckpointError, match="not empty"):
        quantize_checkpoint(src, tmp_path / "busy", calib_inputs=random_calib_inputs(1))
    with pytest.raises(CheckpointError, match="calib_inputs"):  # no tokenizer in the tiny model
        quantize_checkpoint(src, tmp_path / "o")
    assert not (tmp_path / "o").exists()
    monkeypatch.setitem(sys.modules, "modelopt.torch.quantization", None)
    with pytest.raises(MissingDependencyError, match=r"edgebuild\[quant\]"):
        quantize_checkpoint(src, tmp_path / "o", calib_inputs=random_calib_inputs(1))


def test_shipped_prompts():
    prompts = default_calib_prompts()
    assert 24 <= len(prompts) <= 64 and len(set(prompts)) == len(prompts)
    assert all(0 < len(p) < 300 for p in prompts)
