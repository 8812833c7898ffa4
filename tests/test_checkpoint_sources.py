"""Every way a checkpoint can be stored loads to the same model.

* single-file, sharded (``save_pretrained(max_shard_size=...)``) safetensors and PyTorch
  ``.bin`` (single and sharded with an index) give bit-identical logits, which match
  transformers;
* every tensor records its file and its ``checkpoint_source``;
* opening a checkpoint reads headers only (a 1 GiB sparse tensor costs nothing until read);
* ModelOpt NVFP4 exports of a tiny Qwen3 (BF16 head, and NVFP4 head) load through
  ``LlamaForCausalLM.from_source`` and match transformers' Qwen3ForCausalLM running the same
  weights dequantized by ModelOpt's own ``NVFP4QTensor`` (an independent oracle), and
  ``edgebuild inspect`` names the format.
"""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from modelopt_fixtures import TINY_QWEN3
from safetensors import safe_open

from edgebuild.checkpoint.quant import QuantAlgo, QuantizedWeight
from edgebuild.checkpoint.source import WeightSource
from edgebuild.cli import main
from edgebuild.models.llama import LlamaForCausalLM
from edgebuild.runtime.torch_backend import TorchTarget

transformers = pytest.importorskip("transformers")

PROMPT = torch.randint(
    0, TINY_QWEN3["vocab_size"], (13,), generator=torch.Generator().manual_seed(3)
)


def _our_logits(ckpt: Path) -> torch.Tensor:
    model = LlamaForCausalLM.from_source(WeightSource(ckpt))
    backend = TorchTarget(model, max_kv_rows=64, page_size=4)
    seq = backend.new_sequence()
    return backend.forward([seq], [PROMPT], [list(range(len(PROMPT)))]).logits[0]


def _hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(PROMPT[None]).logits[0].float()


# ----------------------------------------------------------------------------- storage layouts


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """One fp32 Qwen3 saved five ways: single, sharded safetensors, .bin, sharded .bin."""
    root = tmp_path_factory.mktemp("layouts")
    cfg = transformers.Qwen3Config(**TINY_QWEN3, architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(0)
    ref = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # a norm that is skipped or swapped shows up in the logits
    ref.save_pretrained(root / "single")
    ref.save_pretrained(root / "sharded", max_shard_size="150KB")

    # transformers 5 no longer writes .bin: write what 4.x's safe_serialization=False wrote
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    for name in ("bin", "bin-sharded"):
        (root / name).mkdir()
        (root / name / "config.json").write_text((root / "single" / "config.json").read_text())
    torch.save(state, root / "bin" / "pytorch_model.bin")
    names = sorted(state)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2]), start=1):
        shard = f"pytorch_model-{i:05d}-of-00002.bin"
        torch.save({k: state[k] for k in part}, root / "bin-sharded" / shard)
        weight_map.update(dict.fromkeys(part, shard))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (root / "bin-sharded" / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return root, ref


def test_sharded_safetensors_layout_is_really_sharded(layouts):
    root, _ = layouts
    index = json.loads((root / "sharded" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 3, shards
    assert not (root / "sharded" / "model.safetensors").exists()
    source = WeightSource(root / "sharded")
    for name, shard in index["weight_map"].items():
        info = source.info(name)
        assert info.file == root / "sharded" / shard  # every tensor knows its shard
        with safe_open(str(info.file), "pt") as f:
            assert torch.equal(source.get(name), f.get_tensor(name))


@pytest.mark.parametrize("layout", ["sharded", "bin", "bin-sharded"])
def test_every_layout_gives_the_same_logits_as_single_file(layouts, layout):
    root, ref = layouts
    single = _our_logits(root / "single")
    torch.testing.assert_close(single, _hf_logits(ref), atol=1e-4, rtol=0)
    other = _our_logits(root / layout)
    assert torch.equal(other, single), (other - single).abs().max()
    source, base = WeightSource(root / layout), WeightSource(root / "single")
    assert source.names() == base.names()
    for name in base.names():
        assert torch.equal(source.get(name), base.get(name)), name
        assert source.info(name).dtype == torch.float32


def test_tensors_carry_checkpoint_source_and_file(layouts):
    root, _ = layouts
    for role in ("component", "target"):
        source = WeightSource(root / "sharded", checkpoint_source=role)
        assert source.checkpoint_source == role
        assert {source.info(n).checkpoint_source for n in source.names()} == {role}
    bin_source = WeightSource(root / "bin-sharded", checkpoint_source="target")
    name = "model.layers.1.mlp.down_proj.weight"
    info = bin_source.info(name)
    assert info.checkpoint_source == "target"
    assert info.file.name.startswith("pytorch_model-0000") and info.file.suffix == ".bin"
    with pytest.raises(ValueError, match="checkpoint_source"):
        WeightSource(root / "single", checkpoint_source="draft")


# ----------------------------------------------------------------------------- lazy reads


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_opening_reads_headers_only(tmp_path, monkeypatch):
    """A 1 GiB tensor (a sparse file) costs neither time nor memory until it is read."""
    big = 1 << 28  # float32 elements: 1 GiB
    header = {
        "big.weight": {"dtype": "F32", "shape": [big], "data_offsets": [0, big * 4]},
        "small.weight": {"dtype": "F32", "shape": [4], "data_offsets": [big * 4, big * 4 + 16]},
    }
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
        f.seek(8 + len(hb) + big * 4)
        f.write(struct.pack("<4f", 1.0, 2.0, 3.0, 4.0))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))

    import safetensors

    opened = []
    real_open = safetensors.safe_open
    monkeypatch.setattr(
        safetensors, "safe_open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k)
    )
    rss0, t0 = _rss_bytes(), time.perf_counter()
    source = WeightSource(tmp_path)
    assert opened == []  # only the header was parsed, no tensor file handle yet
    assert source.info("big.weight").shape == (big,)
    assert source.total_bytes() == big * 4 + 16
    assert torch.equal(source.get("small.weight"), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert opened == [str(path)]
    big_view = source.get("big.weight")  # memory-mapped: only touched pages become resident
    assert big_view.shape == (big,)
    assert float(big_view[12345]) == 0.0
    elapsed, grown = time.perf_counter() - t0, _rss_bytes() - rss0
    assert grown < 256 << 20, f"resident memory grew by {grown >> 20} MiB"
    assert elapsed < 10.0


# ----------------------------------------------------------------------------- NVFP4 exports

try:
    import modelopt.torch.quantization  # noqa: F401
    from modelopt.torch.quantization.qtensor import NVFP4QTensor
except Exception:  # noqa: BLE001 - any import failure means "cannot test here"
    NVFP4QTensor = None

needs_modelopt = pytest.mark.skipif(NVFP4QTensor is None, reason="nvidia-modelopt not installed")


@pytest.fixture(scope="module")
def nvfp4_exports(tmp_path_factory):
    """{quantize_lm_head: export dir} of the same tiny Qwen3 (seed 0), by ModelOpt."""
    from modelopt_fixtures import make_tiny_nvfp4_qwen3

    root = tmp_path_factory.mktemp("nvfp4")
    return {head: make_tiny_nvfp4_qwen3(root, quantize_lm_head=head) for head in (False, True)}


def _modelopt_dequant_state_dict(export: Path) -> tuple[dict, set[str]]:
    """The export's tensors with each NVFP4 linear dequantized by ModelOpt (fp32)."""
    with safe_open(str(export / "model.safetensors"), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    state, quantized = {}, set()
    for name, value in t.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight":
            continue  # weight_scale / weight_scale_2 / input_scale
        if value.dtype == torch.uint8:
            out, half = value.shape
            q = NVFP4QTensor((out, half * 2), torch.float32, value)
            value = q.dequantize(
                dtype=torch.float32,
                scale=t[f"{prefix}.weight_scale"],
                double_scale=t[f"{prefix}.weight_scale_2"],
                block_sizes={-1: 16},
            )
            quantized.add(prefix)
        state[name] = value.float()
    return state, quantized


@needs_modelopt
@pytest.mark.parametrize("head", [False, True], ids=["bf16-head", "nvfp4-head"])
def test_nvfp4_export_matches_transformers_on_modelopt_dequantized_weights(nvfp4_exports, head):
    export = nvfp4_exports[head]
    src = export.parent / f"src-{export.name}" / "qwen3-tiny"
    state, quantized = _modelopt_dequant_state_dict(export)
    assert len(quantized) == 14 + int(head)  # 7 linears x 2 layers (+ lm_head)
    assert ("lm_head" in quantized) == head

    cfg = transformers.Qwen3Config.from_pretrained(src)  # the non-quantized config
    assert getattr(cfg, "quantization_config", None) is None
    oracle = transformers.Qwen3ForCausalLM(cfg).float().eval()
    oracle.load_state_dict(state, strict=True)
    expected = _hf_logits(oracle)

    source = WeightSource(export)
    assert source.quant.algo is QuantAlgo.NVFP4
    lm_head = source.linear("lm_head")
    assert isinstance(lm_head, QuantizedWeight) == head
    if head:
        assert lm_head.format is QuantAlgo.NVFP4 and lm_head.shape == (1000, 64)
    else:
        assert lm_head.dtype == torch.bfloat16
    got = _our_logits(export)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)

    # the quantization is real: the BF16 source model differs, but not wildly
    bf16 = transformers.Qwen3ForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    source_logits = _hf_logits(bf16)
    assert (got - source_logits).abs().max() > 1e-3
    cos = torch.nn.functional.cosine_similarity(got.flatten(), source_logits.flatten(), dim=0)
    assert cos > 0.9, cos


@needs_modelopt
def test_inspect_names_nvfp4(nvfp4_exports):
    for head, export in nvfp4_exports.items():
        result = CliRunner().invoke(main, ["inspect", str(export), "--json"])
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        assert report["quant_format"] == "NVFP4"
        assert report["quant_config_source"].startswith(str(export / "hf_quant_config.json"))
        dtypes = report["dtypes"]
        assert dtypes["uint8"] == 14 + int(head)  # one packed weight per NVFP4 linear
        assert dtypes["float8_e4m3fn"] == 14 + int(head)  # and one block-scale tensor
        assert ("bfloat16" in dtypes) and report["tensors"] == sum(dtypes.values())
        text = CliRunner().invoke(main, ["inspect", str(export)])
        assert text.exit_code == 0 and "quant_format: NVFP4" in text.stdout
