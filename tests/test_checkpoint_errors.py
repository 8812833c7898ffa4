"""A corpus of malformed checkpoints: each fails with an EdgebuildError naming the file and problem.

Every case is written into ``tmp_path`` from a valid tiny Qwen3 (BF16, or a hand-packed NVFP4
copy of it) by one small mutation. For each case we check

* which call fails: opening the directory (``WeightSource``) or building the model
  (``LlamaForCausalLM.from_source``) - the other stage must succeed / must not be reached;
* the exception type (an :class:`edgebuild.errors.EdgebuildError` subclass, never a raw
  torch / safetensors / json exception) and that its message names the file and the problem;
* that ``edgebuild inspect BAD_DIR`` exits 2 with ``error: <the same message>`` and no traceback.

Draft/target pairing errors (hidden size, vocab) go through ``PairedSources.validate`` and
``edgebuild inspect TARGET --draft DRAFT``; a vocab difference that is only padding is refused too.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from dspark_fixtures import make_random_draft
from modelopt_fixtures import make_tiny_qwen3
from safetensors.torch import load_file, save_file

from edgebuild.checkpoint.pairing import PairedSources
from edgebuild.checkpoint.quant import pack_nvfp4
from edgebuild.checkpoint.source import WeightSource
from edgebuild.cli import main
from edgebuild.errors import (
    CheckpointError,
    ConfigError,
    EdgebuildError,
    PairingError,
    QuantFormatError,
)
from edgebuild.models.llama import LlamaForCausalLM

ST = "model.safetensors"
NORM = "model.norm.weight"
GATE0 = "model.layers.0.mlp.gate_proj.weight"
UP1 = "model.layers.1.mlp.up_proj.weight"
DOWN0 = "model.layers.0.mlp.down_proj"
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ----------------------------------------------------------------------------- base checkpoints


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory) -> Path:
    """A valid tiny untied BF16 Qwen3 (hidden 64, 2 layers, vocab 1000) written by transformers."""
    return make_tiny_qwen3(tmp_path_factory.mktemp("bf16"))


def _nvfp4_tensors(dense: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace every decoder linear by random but well-formed ModelOpt NVFP4 tensors."""
    g = torch.Generator().manual_seed(0)
    out = dict(dense)
    codes = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -2, -6])
    for layer in range(2):
        for lin in LINEARS:
            kind = "self_attn" if lin.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            prefix = f"model.layers.{layer}.{kind}.{lin}"
            rows, cols = dense[f"{prefix}.weight"].shape
            values = codes[torch.randint(0, len(codes), (rows, cols), generator=g)]
            out[f"{prefix}.weight"] = pack_nvfp4(values)
            scales = torch.rand(rows, cols // 16, generator=g) * 0.5 + 0.25
            out[f"{prefix}.weight_scale"] = scales.to(torch.float8_e4m3fn)
            out[f"{prefix}.weight_scale_2"] = torch.tensor(0.01)
            out[f"{prefix}.input_scale"] = torch.tensor(0.02)
    return out


@pytest.fixture(scope="module")
def nvfp4_dir(bf16_dir, tmp_path_factory) -> Path:
    """The BF16 checkpoint with its decoder linears stored as NVFP4 (ModelOpt layout)."""
    out = tmp_path_factory.mktemp("nvfp4") / "qwen3-tiny-nvfp4"
    shutil.copytree(bf16_dir, out)
    save_file(_nvfp4_tensors(load_file(bf16_dir / ST)), out / ST)
    quant = {
        "producer": {"name": "modelopt", "version": "0.47.0"},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": 16,
            "exclude_modules": ["lm_head", "model.embed_tokens"],
        },
    }
    (out / "hf_quant_config.json").write_text(json.dumps(quant))
    return out


def test_base_checkpoints_are_valid(bf16_dir, nvfp4_dir):
    """The controls: both unmutated bases load, and the NVFP4 one really is NVFP4."""
    for d in (bf16_dir, nvfp4_dir):
        model = LlamaForCausalLM.from_source(WeightSource(d))
        assert model.config.hidden_size == 64
    src = WeightSource(nvfp4_dir)
    assert src.quant.algo.value == "NVFP4"
    assert src.info(f"{DOWN0}.weight").dtype == torch.uint8
    result = CliRunner().invoke(main, ["inspect", str(nvfp4_dir)])
    assert result.exit_code == 0, result.output
    assert "NVFP4" in result.output


# ----------------------------------------------------------------------------- mutations


def _edit_config(d: Path, fn: Callable[[dict], None]) -> None:
    path = d / "config.json"
    cfg = json.loads(path.read_text())
    fn(cfg)
    path.write_text(json.dumps(cfg))


def _edit_tensors(d: Path, fn: Callable[[dict], None]) -> None:
    tensors = load_file(d / ST)
    fn(tensors)
    save_file(tensors, d / ST)


def _read_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_header(path: Path, header: dict, data: bytes) -> None:
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + data)


def _edit_header(d: Path, fn: Callable[[dict], None]) -> None:
    header, data = _read_header(d / ST)
    fn(header)
    _write_header(d / ST, header, data)


def _shard(d: Path, edit_map: Callable[[dict], None] | None = None) -> None:
    """Split model.safetensors into two shards with an index (as save_pretrained does)."""
    tensors = load_file(d / ST)
    (d / ST).unlink()
    names = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    weight_map = {}
    for shard, part in halves.items():
        save_file({k: tensors[k] for k in part}, d / shard)
        weight_map.update(dict.fromkeys(part, shard))
    if edit_map:
        edit_map(weight_map)
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def _remap_norm(weight_map: dict) -> None:
    other = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    other.discard(weight_map[NORM])
    weight_map[NORM] = other.pop()


def _truncate(d: Path, keep: float | int) -> None:
    raw = (d / ST).read_bytes()
    n = keep if isinstance(keep, int) else int(len(raw) * keep)
    (d / ST).write_bytes(raw[:n])


def _nan_weight_scale(tensors: dict) -> None:
    scale = tensors[f"{DOWN0}.weight_scale"].clone()
    scale.view(torch.uint8)[3, 2] = 0x7F  # float8_e4m3fn NaN
    assert scale.float().isnan().sum() == 1
    tensors[f"{DOWN0}.weight_scale"] = scale


def _garbage_bin(d: Path) -> None:
    (d / ST).unlink()
    (d / "pytorch_model.bin").write_bytes(b"this is not a pytorch checkpoint\x00\xff" * 50)


def _list_bin(d: Path) -> None:
    (d / ST).unlink()
    torch.save([torch.zeros(2)], d / "pytorch_model.bin")


@dataclass
class Case:
    mutate: Callable[[Path], None]
    error: type[EdgebuildError]
    stage: str  # "open": WeightSource(dir) fails; "load": LlamaForCausalLM.from_source fails
    needles: tuple[str, ...]  # substrings of the message (the problem)
    file: str  # file name the message must name ("" = the directory itself)
    base: str = "bf16"
    extra: dict = field(default_factory=dict)


CASES: dict[str, Case] = {
    # ---------------------------------------------------------------- config.json
    "missing-config": Case(
        lambda d: (d / "config.json").unlink(),
        CheckpointError,
        "open",
        ("missing config file",),
        "config.json",
    ),
    "invalid-json-config": Case(
        lambda d: (d / "config.json").write_text('{"hidden_size": 64,'),
        CheckpointError,
        "open",
        ("not valid JSON",),
        "config.json",
    ),
    "config-not-an-object": Case(
        lambda d: (d / "config.json").write_text("[1, 2]"),
        CheckpointError,
        "open",
        ("expected a JSON object", "list"),
        "config.json",
    ),
    "config-missing-hidden-size": Case(
        lambda d: _edit_config(d, lambda c: c.pop("hidden_size")),
        ConfigError,
        "load",
        ("'hidden_size'", "missing"),
        "config.json",
    ),
    "unsupported-architecture": Case(
        lambda d: _edit_config(
            d, lambda c: c.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
        ),
        ConfigError,
        "load",
        ("unsupported architecture 'GPT2LMHeadModel'", "Qwen3ForCausalLM", "LlamaForCausalLM"),
        "config.json",
    ),
    "unknown-rope-type": Case(
        lambda d: _edit_config(
            d, lambda c: c.update(rope_parameters={"rope_type": "weird", "rope_theta": 1e4})
        ),
        ConfigError,
        "load",
        ("rope type 'weird'", "rope_parameters.rope_type", "yarn", "llama3"),
        "config.json",
    ),
    "rms-norm-eps-string": Case(
        lambda d: _edit_config(d, lambda c: c.update(rms_norm_eps="1e-6")),
        ConfigError,
        "load",
        ("'rms_norm_eps'", "'1e-6'"),
        "config.json",
    ),
    "tie-word-embeddings-string": Case(
        lambda d: _edit_config(d, lambda c: c.update(tie_word_embeddings="false")),
        ConfigError,
        "load",
        ("'tie_word_embeddings'", "true or false", "'false'"),
        "config.json",
    ),
    "zero-heads-without-head-dim": Case(
        lambda d: _edit_config(d, lambda c: (c.pop("head_dim"), c.update(num_attention_heads=0))),
        ConfigError,
        "load",
        ("'num_attention_heads' must be positive", "got 0"),
        "config.json",
    ),
    "tie-false-without-lm-head": Case(
        lambda d: _edit_tensors(d, lambda t: t.pop("lm_head.weight")),
        CheckpointError,
        "load",
        ("'tie_word_embeddings' is false", "no 'lm_head.weight'"),
        "config.json",
    ),
    # ---------------------------------------------------------------- weight files
    "no-weight-files": Case(
        lambda d: (d / ST).unlink(),
        CheckpointError,
        "open",
        ("no weights found", "model.safetensors.index.json"),
        "",
    ),
    "truncated-safetensors": Case(
        lambda d: _truncate(d, 0.5),
        CheckpointError,
        "open",
        ("truncated", "data bytes"),
        ST,
    ),
    "truncated-inside-header": Case(
        lambda d: _truncate(d, 40),
        CheckpointError,
        "open",
        ("corrupt safetensors header", "file has 40"),
        ST,
    ),
    "empty-safetensors": Case(
        lambda d: _truncate(d, 0),
        CheckpointError,
        "open",
        ("truncated safetensors file (0 bytes)",),
        ST,
    ),
    "garbage-header": Case(
        lambda d: (d / ST).write_bytes(b"\x93NUMPY garbage, not safetensors" * 20),
        CheckpointError,
        "open",
        ("corrupt safetensors header",),
        ST,
    ),
    "header-not-json": Case(
        lambda d: (d / ST).write_bytes(struct.pack("<Q", 8) + b"{notjson" + bytes(64)),
        CheckpointError,
        "open",
        ("corrupt safetensors header (not JSON)",),
        ST,
    ),
    "header-offsets-vs-shape": Case(
        lambda d: _edit_header(d, lambda h: h[NORM].update(shape=[128])),
        CheckpointError,
        "open",
        (f"'{NORM}'", "do not fit its dtype BF16 and shape [128]"),
        ST,
    ),
    "header-overlapping-offsets": Case(
        lambda d: _edit_header(
            d,
            lambda h: h[NORM].update(
                data_offsets=[0, h[NORM]["data_offsets"][1] - h[NORM]["data_offsets"][0]]
            ),
        ),
        CheckpointError,
        "open",
        ("overlapping or non-contiguous data offsets",),
        ST,
    ),
    "header-shape-not-a-list": Case(
        lambda d: _edit_header(d, lambda h: h[NORM].update(shape=None)),
        CheckpointError,
        "open",
        (f"corrupt header entry for tensor '{NORM}'", "shape None"),
        ST,
    ),
    "header-unknown-dtype": Case(
        lambda d: _edit_header(d, lambda h: h[NORM].update(dtype="Q4_K")),
        CheckpointError,
        "open",
        ("unsupported dtype Q4_K", "BF16"),
        ST,
    ),
    "index-names-missing-shard": Case(
        lambda d: (_shard(d), (d / "model-00002-of-00002.safetensors").unlink()),
        CheckpointError,
        "open",
        ("names shard 'model-00002-of-00002.safetensors'", "missing"),
        "model.safetensors.index.json",
    ),
    "index-maps-tensor-to-wrong-shard": Case(
        lambda d: _shard(d, _remap_norm),
        CheckpointError,
        "open",
        (f"maps tensor '{NORM}'", "does not contain it"),
        "model.safetensors.index.json",
    ),
    "index-value-not-a-file-name": Case(
        lambda d: _shard(d, lambda m: m.update({NORM: 3})),
        CheckpointError,
        "open",
        (f"maps tensor '{NORM}' to 3", "not a shard file name"),
        "model.safetensors.index.json",
    ),
    "index-invalid-json": Case(
        lambda d: (_shard(d), (d / "model.safetensors.index.json").write_text("{")),
        CheckpointError,
        "open",
        ("not valid JSON", "weight index"),
        "model.safetensors.index.json",
    ),
    "garbage-bin": Case(
        _garbage_bin,
        CheckpointError,
        "open",
        ("cannot load PyTorch checkpoint with weights_only=True", "corrupt"),
        "pytorch_model.bin",
    ),
    "bin-not-a-state-dict": Case(
        _list_bin,
        CheckpointError,
        "open",
        ("expected a state dict, got list",),
        "pytorch_model.bin",
    ),
    # ---------------------------------------------------------------- tensors vs config
    "missing-tensor": Case(
        lambda d: _edit_tensors(d, lambda t: t.pop(UP1)),
        CheckpointError,
        "load",
        ("missing tensors", UP1, "2 layers"),
        "",
    ),
    "unexpected-tensor": Case(
        lambda d: _edit_tensors(
            d, lambda t: t.update({"model.layers.7.mlp.up_proj.weight": torch.zeros(2, 2)})
        ),
        CheckpointError,
        "load",
        ("unexpected tensors", "model.layers.7.mlp.up_proj.weight"),
        "",
    ),
    "shape-does-not-match-config": Case(
        lambda d: _edit_tensors(
            d, lambda t: t.update({GATE0: torch.zeros(100, 64, dtype=torch.bfloat16)})
        ),
        CheckpointError,
        "load",
        (f"'{GATE0}'", "shape [100, 64]", "[128, 64]"),
        ST,
    ),
    "int64-weight": Case(
        lambda d: _edit_tensors(
            d, lambda t: t.update({GATE0: torch.zeros(128, 64, dtype=torch.int64)})
        ),
        CheckpointError,
        "load",
        (f"'{GATE0}'", "int64"),
        ST,
    ),
    # ---------------------------------------------------------------- quantization
    "unsupported-quant-algo": Case(
        lambda d: (d / "hf_quant_config.json").write_text(
            json.dumps({"quantization": {"quant_algo": "W4A16_AWQ"}})
        ),
        QuantFormatError,
        "open",
        ("unsupported quant_algo 'W4A16_AWQ'", "NVFP4", "FP8"),
        "hf_quant_config.json",
    ),
    "unsupported-quant-method-in-config": Case(
        lambda d: _edit_config(
            d, lambda c: c.update(quantization_config={"quant_method": "awq", "bits": 4})
        ),
        QuantFormatError,
        "open",
        ("quant_method", "'awq'", "modelopt"),
        "config.json",
    ),
    "nan-in-nvfp4-weight-scale": Case(
        lambda d: _edit_tensors(d, _nan_weight_scale),
        QuantFormatError,
        "load",
        (f"'{DOWN0}.weight_scale'", "NaN or Inf"),
        ST,
        base="nvfp4",
    ),
    "inf-in-nvfp4-weight-scale-2": Case(
        lambda d: _edit_tensors(
            d, lambda t: t.update({f"{DOWN0}.weight_scale_2": torch.tensor(float("inf"))})
        ),
        QuantFormatError,
        "load",
        (f"'{DOWN0}.weight_scale_2'", "NaN or Inf"),
        ST,
        base="nvfp4",
    ),
    "nvfp4-weight-scale-wrong-dtype": Case(
        lambda d: _edit_tensors(
            d,
            lambda t: t.update(
                {f"{DOWN0}.weight_scale": t[f"{DOWN0}.weight_scale"].to(torch.bfloat16)}
            ),
        ),
        QuantFormatError,
        "load",
        (f"'{DOWN0}.weight_scale'", "float8_e4m3fn"),
        ST,
        base="nvfp4",
    ),
}


def _make_case(name: str, case: Case, tmp_path: Path, bases: dict[str, Path]) -> Path:
    d = tmp_path / name
    shutil.copytree(bases[case.base], d)
    case.mutate(d)
    return d


@pytest.fixture
def bases(bf16_dir, nvfp4_dir) -> dict[str, Path]:
    return {"bf16": bf16_dir, "nvfp4": nvfp4_dir}


def _expected_path(d: Path, case: Case) -> str:
    return str(d / case.file) if case.file else str(d)


def test_corpus_is_large_enough():
    assert len(CASES) >= 15


@pytest.mark.parametrize("name", sorted(CASES))
def test_malformed_checkpoint_fails_with_edgebuild_error(name, tmp_path, bases):
    case = CASES[name]
    d = _make_case(name, case, tmp_path, bases)
    if case.stage == "open":
        with pytest.raises(EdgebuildError) as info:
            WeightSource(d)
    else:
        source = WeightSource(d)  # opening succeeds: the problem is in the model's tensors/config
        with pytest.raises(EdgebuildError) as info:
            LlamaForCausalLM.from_source(source)
    exc = info.value
    assert type(exc) is case.error, f"{type(exc).__name__}: {exc}"
    msg = str(exc)
    assert _expected_path(d, case) in msg, msg
    for needle in case.needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    assert "Traceback" not in msg
    assert exc.__cause__ is None or isinstance(exc.__cause__, EdgebuildError)


@pytest.mark.parametrize("name", sorted(CASES))
def test_cli_inspect_reports_error_and_exits_2(name, tmp_path, bases):
    case = CASES[name]
    d = _make_case(name, case, tmp_path, bases)
    result = CliRunner().invoke(main, ["inspect", str(d)])
    assert result.exit_code == 2, (result.exit_code, result.output, result.exc_info)
    assert isinstance(result.exception, SystemExit)
    err = result.stderr
    assert err.startswith("error: "), err
    assert _expected_path(d, case) in err
    for needle in case.needles:
        assert needle in err
    assert "Traceback" not in result.output
    assert result.stdout == ""  # no partial report before the error


def test_cli_subprocess_prints_no_traceback(tmp_path, bf16_dir):
    """The real console script path (`python -m edgebuild`, edgebuild/__main__.py): stderr
    holds one `error:` line, no Python traceback."""
    d = tmp_path / "bad"
    shutil.copytree(bf16_dir, d)
    _edit_tensors(d, lambda t: t.pop(UP1))
    proc = subprocess.run(
        [sys.executable, "-m", "edgebuild", "inspect", str(d)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"error: {d}: missing tensors ['{UP1}']")
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


# ----------------------------------------------------------------------------- draft vs target


def _write_tokenizer(d: Path, n_tokens: int, unigram: bool = False) -> None:
    """A minimal tokenizer.json with `n_tokens` real tokens (ids 0..n_tokens-1)."""
    n_base = n_tokens - 2
    if unigram:
        model = {"type": "Unigram", "vocab": [[f"t{i}", -1.0] for i in range(n_base)]}
    else:
        model = {"type": "BPE", "vocab": {f"t{i}": i for i in range(n_base)}, "merges": []}
    added = [{"id": n_base + i, "content": f"<s{i}>", "special": True} for i in range(2)]
    (d / "tokenizer.json").write_text(json.dumps({"model": model, "added_tokens": added}))


@pytest.fixture(scope="module")
def target_dir(bf16_dir, tmp_path_factory) -> Path:
    """The BF16 target (vocab 1000) with a 990-token tokenizer: ids 990..999 are padding."""
    d = tmp_path_factory.mktemp("target") / "target"
    shutil.copytree(bf16_dir, d)
    _write_tokenizer(d, 990)
    return d


PAIR_ERRORS = {
    "hidden-size-mismatch": (
        {"hidden_size": 128},
        ("draft hidden_size 128", "target hidden_size 64"),
    ),
    "vocab-mismatch-not-padding": (
        {"vocab_size": 980},  # smaller than the 990 real tokens: not padding
        ("draft vocab_size 980", "target vocab_size 1000", "not padding", "990"),
    ),
    "vocab-mismatch-without-tokenizer": (
        {"vocab_size": 1024},
        ("draft vocab_size 1024", "target vocab_size 1000", "not padding"),
    ),
}


@pytest.mark.parametrize("name", sorted(PAIR_ERRORS))
def test_draft_target_mismatch_is_refused_naming_both_files(name, tmp_path, target_dir):
    overrides, needles = PAIR_ERRORS[name]
    target = target_dir
    if name == "vocab-mismatch-without-tokenizer":
        target = tmp_path / "target-no-tok"
        shutil.copytree(target_dir, target)
        (target / "tokenizer.json").unlink()
    draft = make_random_draft(tmp_path / "draft", target, overrides=overrides)
    pair = PairedSources(draft, target)
    with pytest.raises(PairingError) as info:
        pair.validate()
    msg = str(info.value)
    assert str(draft / "config.json") in msg and str(target / "config.json") in msg, msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"

    result = CliRunner().invoke(main, ["inspect", str(target), "--draft", str(draft)])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ")
    assert str(draft / "config.json") in result.stderr
    assert str(target / "config.json") in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("draft_vocab", "unigram"), [(1024, False), (992, False), (1024, True), (990, False)]
)
def test_padding_only_vocab_difference_is_refused_naming_the_padding(
    draft_vocab, unigram, tmp_path, target_dir
):
    """Only padding, yet refused: verify compares draft and target rows over one vocabulary.

    Accepting it let decoding crash later with a raw torch size mismatch (issue 16, item 11).
    """
    target = target_dir
    if unigram:
        target = tmp_path / "target-unigram"
        shutil.copytree(target_dir, target)
        _write_tokenizer(target, 990, unigram=True)
    draft = make_random_draft(tmp_path / "draft", target, overrides={"vocab_size": draft_vocab})
    pair = PairedSources(draft, target)
    with pytest.raises(PairingError) as info:
        pair.validate()
    msg = str(info.value)
    assert "only padding" in msg and "990 tokens" in msg, msg
    assert str(draft / "config.json") in msg and str(target / "config.json") in msg
    result = CliRunner().invoke(main, ["inspect", str(target), "--draft", str(draft)])
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: {msg}\n"

    # one token fewer than the tokenizer's real vocabulary is not even padding
    cfg_path = draft / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["vocab_size"] = 989
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(PairingError, match="not padding"):
        PairedSources(draft, target).validate()
