"""One validation path for drafts: `inspect --draft` refuses exactly what `run` refuses.

Issue 16, items 10-14. Each broken draft is a one-field (or one-tensor) mutation of a valid
random draft for a tiny Qwen3 target. For every case the runtime loader (`prepare_torch_draft` and
its `load`, what `edgebuild run` and the server call) must raise an EdgebuildError naming the
field or tensor, and `edgebuild inspect TARGET --draft DRAFT` must exit 2 with that same message.

Also here: a draft vocab padded differently from the target's is refused at load (item 11),
config fields edgebuild does not implement are refused by name (item 12), a draft tokenizer
that differs from the target's is refused (item 13), and `dspark_config` is read by every
reader of the draft config (item 14).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from dspark_fixtures import make_random_draft
from modelopt_fixtures import make_tiny_qwen3
from safetensors.torch import load_file, save_file

from edgebuild.checkpoint.config import ModelConfig
from edgebuild.checkpoint.pairing import PairedSources
from edgebuild.checkpoint.source import WeightSource
from edgebuild.cli import main
from edgebuild.errors import ConfigError, EdgebuildError, PairingError
from edgebuild.models.dspark import DSparkConfig
from edgebuild.runtime.dspark_loader import prepare_torch_draft as prepare_draft
from edgebuild.runtime.llm import RuntimeOptions
from edgebuild.speculative.config import SpeculativeConfig, default_draft_top_k

ST = "model.safetensors"
D, V, R = 64, 1000, 8  # the tiny target's hidden size and vocab; the draft's Markov rank


def _write_tokenizer(d: Path, tokens: dict[int, str]) -> None:
    """A BPE tokenizer.json whose vocab is `tokens` ({id: token})."""
    vocab = {t: i for i, t in tokens.items()}
    tok = {"model": {"type": "BPE", "vocab": vocab, "merges": []}, "added_tokens": []}
    (d / "tokenizer.json").write_text(json.dumps(tok))


TARGET_TOKENS = {i: f"t{i}" for i in range(990)}  # ids 990..999 are padding rows


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """Tiny untied BF16 Qwen3 (2 layers, hidden 64, vocab 1000) with a 990-token tokenizer."""
    d = make_tiny_qwen3(tmp_path_factory.mktemp("target"))
    _write_tokenizer(d, TARGET_TOKENS)
    return d


def _edit_config(d: Path, fn: Callable[[dict], None]) -> None:
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(d: Path, fn: Callable[[dict], None]) -> None:
    tensors = load_file(d / ST)
    fn(tensors)
    save_file(tensors, d / ST)


def _set(**fields) -> Callable[[dict], None]:
    """Set `dflash_config` fields (keys with a `dflash_` prefix) or top-level ones."""

    def fn(cfg: dict) -> None:
        for key, value in fields.items():
            if key.startswith("dflash_"):
                cfg["dflash_config"][key[len("dflash_") :]] = value
            else:
                cfg[key] = value

    return fn


def _loader_error(draft: Path, target: Path) -> EdgebuildError:
    """What `edgebuild run` / the server raise for this pair (validation, then the load)."""
    spec = SpeculativeConfig.parse(
        {"method": "dspark", "model": str(draft), "num_speculative_tokens": 1, "draft_top_k": 4}
    )
    with pytest.raises(EdgebuildError) as info:
        prepare_draft(spec, WeightSource(target))(RuntimeOptions(max_kv_rows=64))
    return info.value


def _inspect(target: Path, draft: Path):
    return CliRunner().invoke(main, ["inspect", str(target), "--draft", str(draft)])


# ----------------------------------------------------------------------------- item 10
# name -> (make_random_draft kwargs, config edit, tensor edit, expected error, needles)
BROKEN = {
    "taps-unsorted": ({"target_layer_ids": [1, 0]}, None, None, ConfigError,
                      ["dflash_config.target_layer_ids", "strictly increasing"]),
    "taps-out-of-range": ({"target_layer_ids": [0, 5]}, None, None, PairingError,
                          ["dflash_config.target_layer_ids", "2 layers"]),
    "taps-final-layer": ({"target_layer_ids": [1]}, None, None, PairingError,
                         ["dflash_config.target_layer_ids", "final layer"]),
    "mask-outside-vocab": ({}, _set(dflash_mask_token_id=V), None, ConfigError,
                           ["dflash_config.mask_token_id", "vocab_size=1000"]),
    "markov-rank-wrong": ({}, _set(dflash_markov_rank=2 * R), None, EdgebuildError,
                          ["markov_head.markov_w1.weight", "markov_rank"]),
    "markov-head-type-unknown": ({}, _set(dflash_markov_head_type="lstm"), None, ConfigError,
                                 ["dflash_config.markov_head_type", "'lstm'"]),
    "markov-head-type-wrong": ({}, _set(dflash_markov_head_type="gated"), None, EdgebuildError,
                               ["markov_head.gate_proj", "gated"]),
    "fc-width": ({}, None, lambda t: t.update({"fc.weight": torch.zeros(D, 2 * D)}),
                 PairingError, ["fc.weight takes 128 inputs", "target_layer_ids"]),
    "missing-k-norm": ({}, None, lambda t: t.pop("layers.0.self_attn.k_norm.weight"),
                       EdgebuildError, ["layers.0.self_attn.k_norm.weight", "missing"]),
    "confidence-width": ({}, None,
                         lambda t: t.update({"confidence_head.proj.weight": torch.zeros(1, D)}),
                         EdgebuildError, ["confidence_head.proj.weight", "confidence_head_with_markov"]),
    "confidence-needs-markov": ({"markov_rank": 0},
                                _set(dflash_confidence_head_with_markov=True), None, ConfigError,
                                ["dflash_config.confidence_head_with_markov", "no Markov head"]),
    "block-size-0": ({}, _set(block_size=0), None, ConfigError, ["block_size", ">= 1"]),
}  # fmt: skip


def _broken(name: str, tmp_path: Path, target: Path) -> Path:
    kwargs, cfg_edit, tensor_edit, _, _ = BROKEN[name]
    draft = make_random_draft(tmp_path / name, target, **kwargs)
    if cfg_edit is not None:
        _edit_config(draft, cfg_edit)
    if tensor_edit is not None:
        _edit_tensors(draft, tensor_edit)
    return draft


def test_the_unbroken_draft_passes_inspect_and_the_loader(tmp_path, target):
    draft = make_random_draft(tmp_path / "ok", target)
    spec = SpeculativeConfig.parse(
        {"method": "dspark", "model": str(draft), "num_speculative_tokens": 1, "draft_top_k": 4}
    )
    loaded = prepare_draft(spec, WeightSource(target))(RuntimeOptions(max_kv_rows=64))
    assert loaded.model.config.block_size == 7
    result = _inspect(target, draft)
    assert result.exit_code == 0, result.output
    assert "block_size: 7" in result.stdout and "markov_head: vanilla rank 8" in result.stdout


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_inspect_refuses_every_draft_the_loader_refuses_with_the_same_message(
    name, tmp_path, target
):
    draft = _broken(name, tmp_path, target)
    error, needles = BROKEN[name][3], BROKEN[name][4]
    exc = _loader_error(draft, target)
    assert isinstance(exc, error), f"{type(exc).__name__}: {exc}"
    msg = str(exc)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    assert str(draft) in msg
    result = _inspect(target, draft)
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: {msg}\n"  # one validation path: the same message
    assert result.stdout == "" and "Traceback" not in result.output


def test_run_cli_refuses_a_broken_draft_with_the_inspect_message(tmp_path, target):
    draft = _broken("missing-k-norm", tmp_path, target)
    spec = json.dumps({"method": "dspark", "model": str(draft), "num_speculative_tokens": 1})
    run = CliRunner().invoke(
        main, ["run", str(target), "--prompt", "t1", "--speculative-config", spec]
    )
    inspect = _inspect(target, draft)
    assert run.exit_code == inspect.exit_code == 2, run.output
    assert inspect.stderr.strip() in run.stderr


# ----------------------------------------------------------------------------- item 11
def _deepspec_draft(out: Path, target: Path, vocab: int) -> Path:
    """A draft over `vocab` ids shipping its own lm_head and embed_tokens (DeepSpec style)."""
    draft = make_random_draft(
        out, target, overrides={"vocab_size": vocab, "dflash_config.mask_token_id": 980}
    )
    g = torch.Generator().manual_seed(3)

    def grow(t: dict) -> None:
        for name in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight"):
            t[name] = torch.randn(vocab, R, generator=g)
        t["lm_head.weight"] = torch.randn(vocab, D, generator=g) * 0.02
        t["embed_tokens.weight"] = torch.randn(vocab, D, generator=g) * 0.02

    _edit_tensors(draft, grow)
    return draft


@pytest.mark.parametrize("vocab", [1024, 992, 990])
def test_a_draft_vocab_padded_differently_is_refused_at_load(vocab, tmp_path, target):
    """Padding-only vocab differences used to pass pairing, then crash the verify step."""
    draft = _deepspec_draft(tmp_path / "draft", target, vocab)
    exc = _loader_error(draft, target)
    assert isinstance(exc, PairingError), f"{type(exc).__name__}: {exc}"
    msg = str(exc)
    for needle in (f"draft vocab_size {vocab}", "target vocab_size 1000", "only padding", "990"):
        assert needle in msg, msg
    assert str(draft / "config.json") in msg and str(target / "config.json") in msg
    result = _inspect(target, draft)
    assert result.exit_code == 2 and result.stderr == f"error: {msg}\n", result.output


# ----------------------------------------------------------------------------- item 12
UNIMPLEMENTED = {
    "draft-vocab-size-smaller": (_set(draft_vocab_size=500), ["'draft_vocab_size' = 500", "d2t"]),
    "sample-from-anchor-false": (_set(sample_from_anchor=False), ["'sample_from_anchor' = False"]),
    "query-zero-predicts-next-false": (
        _set(dflash_query_zero_predicts_next=False),
        ["'dflash_config.query_zero_predicts_next' = False"],
    ),
    "contradictory-anchor-flags": (
        _set(sample_from_anchor=True, dflash_sample_from_anchor=False),
        ["'dflash_config.sample_from_anchor' = False disagrees with 'sample_from_anchor' = True"],
    ),
    "causal": (_set(dflash_causal=True), ["'dflash_config.causal' = True"]),
    "use-swa-without-size": (_set(use_swa=True), ["'use_swa' = true", "'swa_window_size'"]),
    "sliding-layers-mixed": (
        _set(
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=8,
            num_hidden_layers=2,
        ),
        ["layer_types", "mix sliding and full attention"],
    ),
    "sliding-window": (
        _set(use_sliding_window=True, sliding_window=8),
        ["'use_sliding_window' = true", "'sliding_window' = 8", "full attention"],
    ),
    "sliding-layer-types": (
        _set(layer_types=["sliding_attention"]),
        ["layer_types", "sliding_attention"],
    ),
    "base-model-hidden-size-wrong": (
        _set(base_model_hidden_size=2 * D),
        ["'base_model_hidden_size' = 128", "1 * 64 = 64"],
    ),
    "unknown-section-key": (
        _set(dflash_fancy_new_mode="on"),
        ["unknown DSpark field", "dflash_config.fancy_new_mode"],
    ),
}


@pytest.mark.parametrize("name", sorted(UNIMPLEMENTED))
def test_config_fields_edgebuild_does_not_implement_are_refused_by_name(name, tmp_path, target):
    edit, needles = UNIMPLEMENTED[name]
    draft = make_random_draft(tmp_path / "draft", target)
    _edit_config(draft, edit)
    exc = _loader_error(draft, target)
    assert isinstance(exc, ConfigError), f"{type(exc).__name__}: {exc}"
    for needle in needles:
        assert needle in str(exc), str(exc)
    result = _inspect(target, draft)
    assert result.exit_code == 2 and result.stderr == f"error: {exc}\n", result.output


@pytest.mark.parametrize(
    "edit",
    [
        _set(draft_vocab_size=V),
        _set(sample_from_anchor=True, dflash_query_zero_predicts_next=True),
        _set(use_sliding_window=False, sliding_window=8),
        _set(use_sliding_window=True, sliding_window=8, max_window_layers=1),  # HF: all full
        _set(use_sliding_window=True, sliding_window=8, layer_types=["full_attention"]),
        _set(dflash_confidence_head_alpha=1.0, dflash_num_anchors=512, dflash_is_neox_style=True),
        _set(dflash_heads_file="dspark_heads.safetensors", base_model_hidden_size=D),
    ],
    ids=["draft-vocab-equal", "implemented-flags", "window-off", "window-layers", "layer-types",
         "training-only", "tel-runtime-keys"],
)  # fmt: skip
def test_implemented_values_of_those_fields_are_accepted(edit, tmp_path, target):
    draft = make_random_draft(tmp_path / "draft", target)
    _edit_config(draft, edit)
    result = _inspect(target, draft)
    assert result.exit_code == 0, result.output


# ----------------------------------------------------------------------------- item 13
def test_a_draft_tokenizer_that_differs_at_some_id_is_refused(tmp_path, target):
    draft = make_random_draft(tmp_path / "draft", target)
    _write_tokenizer(draft, {**TARGET_TOKENS, 17: "other"})
    exc = _loader_error(draft, target)
    assert isinstance(exc, PairingError), f"{type(exc).__name__}: {exc}"
    msg = str(exc)
    assert "at id 17" in msg and "'other' vs 't17'" in msg, msg
    assert str(draft / "tokenizer.json") in msg and str(target / "tokenizer.json") in msg
    result = _inspect(target, draft)
    assert result.exit_code == 2 and result.stderr == f"error: {msg}\n", result.output


def test_a_draft_vocab_json_that_differs_is_refused_too(tmp_path, target):
    """A draft shipping vocab.json (+ added_tokens_decoder) instead of tokenizer.json."""
    draft = make_random_draft(tmp_path / "draft", target)
    vocab = {f"t{i}": i for i in range(980)}
    (draft / "vocab.json").write_text(json.dumps(vocab))
    added = {str(i): {"content": f"t{i}"} for i in range(980, 989)} | {"989": {"content": "<x>"}}
    (draft / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}))
    exc = _loader_error(draft, target)
    assert isinstance(exc, PairingError), f"{type(exc).__name__}: {exc}"
    assert "at id 989: '<x>' vs 't989'" in str(exc) and str(draft / "vocab.json") in str(exc)
    added["989"] = {"content": "t989"}  # now equal to the target's tokenizer
    (draft / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}))
    assert _inspect(target, draft).exit_code == 0


@pytest.mark.parametrize("extra", [0, 2], ids=["identical", "padding-tokens-appended"])
def test_a_draft_tokenizer_equal_up_to_padding_is_accepted(extra, tmp_path, target):
    draft = make_random_draft(tmp_path / "draft", target)
    _write_tokenizer(draft, {**TARGET_TOKENS, **{990 + i: f"<pad{i}>" for i in range(extra)}})
    PairedSources(draft, target).validate()  # does not raise
    assert _inspect(target, draft).exit_code == 0


# ----------------------------------------------------------------------------- item 14
def test_dspark_config_block_size_and_markov_topk_are_read_by_every_reader(tmp_path, target):
    """`dspark_config` (newer SpecForge drafts) means the same to every reader of the config."""
    from edgebuild.bundle.build import recipe_from_flags

    draft = make_random_draft(tmp_path / "draft", target, block_size=4)

    def nest(cfg: dict) -> None:
        cfg.pop("block_size")
        cfg["dspark_config"] = {"block_size": 4, "markov_topk": 8}

    _edit_config(draft, nest)
    tcfg = ModelConfig.from_dict(json.loads((target / "config.json").read_text()))
    dcfg = DSparkConfig.from_dict(json.loads((draft / "config.json").read_text()), tcfg)
    assert dcfg.block_size == 4
    assert default_draft_top_k(draft) == 8
    spec = SpeculativeConfig.parse(
        {"method": "dspark", "model": str(draft), "num_speculative_tokens": 4}
    )
    assert spec.draft_top_k == 8
    recipe = recipe_from_flags(target, draft)
    assert recipe.speculative.num_speculative_tokens == 4
    assert recipe.speculative.draft_top_k == 8


def test_markov_topk_in_two_places_that_disagree_is_an_error(tmp_path, target):
    draft = make_random_draft(tmp_path / "draft", target)
    _edit_config(draft, lambda c: c.update(markov_topk=4, dspark_config={"markov_topk": 8}))
    with pytest.raises(ConfigError, match="dspark_config.markov_topk' = 8 disagrees"):
        default_draft_top_k(draft)


def test_a_copy_of_the_target_tokenizer_in_the_draft_folder_is_accepted(tmp_path, target):
    draft = make_random_draft(tmp_path / "draft", target)
    shutil.copy(target / "tokenizer.json", draft / "tokenizer.json")
    assert _inspect(target, draft).exit_code == 0
