"""`PairedSources`: a draft borrows the target's head / embedding, in the target's precision.

* NVFP4 target with a quantized ``lm_head``: the draft's head is the target's packed NVFP4
  weight (a ``QuantizedWeight`` from "target", never a dense reinterpretation) whose
  dequantization equals the target's own and ModelOpt's ``NVFP4QTensor`` dequantization;
* tied BF16 target: head and embedding are the target's ``model.embed_tokens.weight``;
* a draft that ships its own ``lm_head.weight`` keeps it, decided by the tensors present and
  not by the vocab size;
* a target with ``tie_word_embeddings: false`` and no ``lm_head`` is refused naming both paths;
* ``edgebuild inspect TARGET --draft DRAFT`` reports where the head comes from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from dspark_fixtures import make_random_draft
from modelopt_fixtures import make_tiny_qwen3
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from edgebuild.checkpoint.pairing import PairedSources
from edgebuild.checkpoint.quant import QuantAlgo, QuantizedWeight
from edgebuild.checkpoint.source import WeightSource
from edgebuild.cli import main
from edgebuild.errors import PairingError

ST = "model.safetensors"


def _raw(ckpt: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(ckpt / ST), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def bf16_target(tmp_path_factory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("bf16"), tie_word_embeddings=False, seed=1)


@pytest.fixture(scope="module")
def tied_target(tmp_path_factory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("tied"), tie_word_embeddings=True, seed=2)


# ----------------------------------------------------------------------------- NVFP4 target


@pytest.fixture(scope="module")
def nvfp4_head_target(tmp_path_factory) -> Path:
    pytest.importorskip("modelopt.torch.quantization")
    from modelopt_fixtures import make_tiny_nvfp4_qwen3

    return make_tiny_nvfp4_qwen3(tmp_path_factory.mktemp("nvfp4"), quantize_lm_head=True)


def _modelopt_dequant(t: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    packed = t[f"{prefix}.weight"]
    out, half = packed.shape
    q = NVFP4QTensor((out, half * 2), torch.float32, packed)
    return q.dequantize(
        dtype=torch.float32,
        scale=t[f"{prefix}.weight_scale"],
        double_scale=t[f"{prefix}.weight_scale_2"],
        block_sizes={-1: 16},
    )


def test_draft_borrows_the_nvfp4_head_of_its_target(tmp_path, nvfp4_head_target):
    target = nvfp4_head_target
    draft = make_random_draft(tmp_path / "draft", target)
    assert "lm_head.weight" not in WeightSource(draft)
    pair = PairedSources(draft, target)
    pair.validate()

    head = pair.lm_head()
    assert head.name == "lm_head.weight"
    assert head.checkpoint_source == "target"
    assert head.file == str(target / ST)
    assert head.format == "NVFP4" and head.shape == (1000, 64)
    w = head.value
    assert isinstance(w, QuantizedWeight)  # kept packed, never read as a dense weight
    assert w.format is QuantAlgo.NVFP4 and w.checkpoint_source == "target"
    assert w.data.dtype == torch.uint8 and tuple(w.data.shape) == (1000, 32)
    assert w.weight_scale.dtype == torch.float8_e4m3fn and w.input_scale is not None

    raw = _raw(target)
    assert torch.equal(w.data, raw["lm_head.weight"])
    assert torch.equal(
        w.weight_scale.view(torch.uint8), raw["lm_head.weight_scale"].view(torch.uint8)
    )
    own = WeightSource(target).linear("lm_head")
    assert isinstance(own, QuantizedWeight) and own.checkpoint_source == "component"
    deq = w.dequantize(torch.float32)
    assert torch.equal(deq, own.dequantize(torch.float32))
    assert torch.equal(deq, _modelopt_dequant(raw, "lm_head"))
    assert deq.abs().max() > 0  # not an all-zero head

    embed = pair.embed_tokens()
    assert embed.name == "model.embed_tokens.weight" and embed.checkpoint_source == "target"
    assert embed.value.dtype == torch.bfloat16  # excluded from quantization, as stored
    assert torch.equal(embed.value, raw["model.embed_tokens.weight"])
    assert pair.provenance() == {"lm_head": "target", "embed_tokens": "target"}


def test_inspect_with_draft_shows_lm_head_from_target(tmp_path, nvfp4_head_target):
    target = nvfp4_head_target
    draft = make_random_draft(tmp_path / "draft", target)
    result = CliRunner().invoke(main, ["inspect", str(target), "--draft", str(draft)])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert f"lm_head: lm_head.weight from target (NVFP4, {target / ST})" in out
    assert f"embed_tokens: model.embed_tokens.weight from target (bfloat16, {target / ST})" in out
    report = json.loads(
        CliRunner().invoke(main, ["inspect", str(target), "--draft", str(draft), "--json"]).stdout
    )
    assert report["target"]["quant_format"] == "NVFP4"
    assert report["draft"]["quant_format"] == "NONE"
    assert report["draft"]["architecture"] == "DSparkDraftModel"


# ----------------------------------------------------------------------------- tied BF16 target


def test_tied_target_gives_its_embedding_as_head_and_embedding(tmp_path, tied_target):
    target = tied_target
    assert json.loads((target / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in WeightSource(target)  # transformers drops the tied copy
    draft = make_random_draft(tmp_path / "draft", target)
    pair = PairedSources(WeightSource(draft), WeightSource(target))  # re-opened as "target"
    assert pair.target.checkpoint_source == "target"
    pair.validate()
    embed_raw = _raw(target)["model.embed_tokens.weight"]
    for resolved in (pair.lm_head(), pair.embed_tokens()):
        assert resolved.name == "model.embed_tokens.weight"
        assert resolved.checkpoint_source == "target"
        assert resolved.file == str(target / ST)
        assert torch.equal(resolved.value, embed_raw)
    result = CliRunner().invoke(main, ["inspect", str(target), "--draft", str(draft)])
    assert result.exit_code == 0, result.output
    assert "lm_head: model.embed_tokens.weight from target (bfloat16" in result.stdout


def test_untied_target_head_is_its_lm_head_not_its_embedding(tmp_path, bf16_target):
    draft = make_random_draft(tmp_path / "draft", bf16_target)
    pair = PairedSources(draft, bf16_target)
    raw = _raw(bf16_target)
    head = pair.lm_head()
    assert head.name == "lm_head.weight" and head.checkpoint_source == "target"
    assert torch.equal(head.value, raw["lm_head.weight"])
    assert not torch.equal(head.value, raw["model.embed_tokens.weight"])


# ----------------------------------------------------------------------------- own head


def _add_tensors(ckpt: Path, extra: dict[str, torch.Tensor]) -> None:
    tensors = load_file(ckpt / ST)
    tensors.update(extra)
    save_file(tensors, ckpt / ST)


@pytest.mark.parametrize("draft_vocab", [1000, 1024], ids=["same-vocab", "padded-vocab"])
def test_draft_with_its_own_head_keeps_it(tmp_path, bf16_target, draft_vocab):
    """Own head -> "component", whatever the vocab; without the tensor -> target's, same vocab.

    (A vocab padded differently from the target's resolves the same way but fails validate.)
    """
    g = torch.Generator().manual_seed(5)
    own_head = torch.randn(draft_vocab, 64, generator=g)
    tok = {"model": {"vocab": {f"t{i}": i for i in range(1000)}}, "added_tokens": []}
    target = tmp_path / "target"
    shutil.copytree(bf16_target, target)
    (target / "tokenizer.json").write_text(json.dumps(tok))  # 1024 is padding only

    with_head = make_random_draft(
        tmp_path / "with-head", target, overrides={"vocab_size": draft_vocab}
    )
    _add_tensors(with_head, {"lm_head.weight": own_head})
    pair = PairedSources(with_head, target)
    if draft_vocab == 1000:
        pair.validate()
    else:  # a differently padded vocab cannot be verified against the target (issue 16.11)
        with pytest.raises(PairingError, match="only padding"):
            pair.validate()
    assert pair.draft_has_own_head()
    head = pair.lm_head()
    assert head.checkpoint_source == "component" and head.file == str(with_head / ST)
    assert torch.equal(head.value, own_head)
    embed = pair.embed_tokens()  # the draft ships no embedding: still the target's
    assert embed.checkpoint_source == "target"
    assert pair.provenance() == {"lm_head": "component", "embed_tokens": "target"}

    # the same vocab without the tensor: borrowed from the target
    without = make_random_draft(tmp_path / "without", target, overrides={"vocab_size": draft_vocab})
    pair = PairedSources(without, target)
    assert not pair.draft_has_own_head()
    head = pair.lm_head()
    assert head.checkpoint_source == "target"
    assert torch.equal(head.value, _raw(target)["lm_head.weight"])

    # a DeepSpec-style draft shipping both (no prefix on the embedding)
    own_embed = torch.randn(draft_vocab, 64, generator=g)
    _add_tensors(without, {"lm_head.weight": own_head, "embed_tokens.weight": own_embed})
    pair = PairedSources(without, target)
    assert pair.provenance() == {"lm_head": "component", "embed_tokens": "component"}
    assert torch.equal(pair.embed_tokens().value, own_embed)


# ----------------------------------------------------------------------------- no head anywhere


def test_untied_target_without_lm_head_is_refused_naming_both_paths(tmp_path, bf16_target):
    target = tmp_path / "target-no-head"
    shutil.copytree(bf16_target, target)
    tensors = load_file(target / ST)
    del tensors["lm_head.weight"]
    save_file(tensors, target / ST)
    draft = make_random_draft(tmp_path / "draft", target)
    pair = PairedSources(draft, target)
    for call in (pair.lm_head, pair.validate):
        with pytest.raises(PairingError) as info:
            call()
        msg = str(info.value)
        assert str(draft) in msg and str(target) in msg, msg
        assert "tie_word_embeddings: False" in msg and str(target / "config.json") in msg
        assert "no 'lm_head.weight'" in msg
    assert pair.embed_tokens().checkpoint_source == "target"  # the embedding is still there
    result = CliRunner().invoke(main, ["inspect", str(target), "--draft", str(draft)])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and str(target) in result.stderr
    assert "Traceback" not in result.output
