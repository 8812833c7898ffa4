"""`generation_config.json` supplies the default stop ids and sampling settings (issue 16.18).

The oracle for stopping is the same model's own output with EOS ignored: declaring one of its
tokens an extra EOS in generation_config.json (not in config.json) must end generation right
after that token. Sampling defaults: a seeded `edgebuild run` without sampling flags equals the
run with the file's values given as flags.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from modelopt_fixtures import make_tiny_qwen3

from edgebuild.cli import main
from edgebuild.runtime.llm import LLM
from edgebuild.runtime.sampling import SamplingParams

EOS = 3  # config.json's eos_token_id and the tokenizer's eos_token "t3"
PROMPT = [10, 11, 12, 13]


def _write_tokenizer(d: Path, n: int = 1000) -> None:
    """A word-level tokenizer: "t{i}" is id i; eos_token "t3"."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(n)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": f"t{EOS}"}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))


def _generation_config(d: Path, **fields) -> None:
    (d / "generation_config.json").write_text(json.dumps(fields))


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    d = make_tiny_qwen3(tmp_path_factory.mktemp("gen"), seed=4)
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = EOS
    (d / "config.json").write_text(json.dumps(cfg))
    _write_tokenizer(d)
    _generation_config(d, eos_token_id=EOS)
    return d


def _extra_eos(reference: list[int]) -> tuple[int, int]:
    """A token of `reference` (not EOS) and the index of its first occurrence, preferably > 0."""
    first = {}
    for i, t in enumerate(reference):
        first.setdefault(t, i)
    candidates = [(i, t) for t, i in first.items() if t != EOS]
    later = [c for c in candidates if c[0] > 0]
    i, t = min(later or candidates)
    return t, i


def test_extra_eos_ids_of_generation_config_end_generation(target):
    llm = LLM(target)
    ref = llm.generate_ids([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    reference = ref.output_ids
    assert len(reference) == 24
    extra, k = _extra_eos(reference)
    assert extra not in llm.eos_ids()  # config.json's id and the tokenizer's only

    _generation_config(target, eos_token_id=[EOS, extra])  # like Qwen3 instruct models
    try:
        llm = LLM(target)
        assert llm.eos_ids() == {EOS, extra}
        st = llm.generate_ids([PROMPT], SamplingParams(max_tokens=24))[0]
        assert st.output_ids == reference[: k + 1]
        assert st.stopper.finish_reason == "stop" and st.stopper.matched_stop == extra

        result = CliRunner().invoke(main, ["inspect", str(target)])
        assert result.exit_code == 0, result.output
        assert f"eos_token_ids: [{EOS}, {extra}] (generation_config.json)" in result.stdout
        assert f"stop_ids: {sorted({EOS, extra})}" in result.stdout
        assert "sampling_defaults: greedy" in result.stdout
    finally:
        _generation_config(target, eos_token_id=EOS)


def test_without_generation_config_the_ids_of_config_json_end_generation(tmp_path, target):
    import shutil

    d = tmp_path / "no-gen"
    shutil.copytree(target, d)
    (d / "generation_config.json").unlink()
    assert LLM(d).eos_ids() == {EOS}
    result = CliRunner().invoke(main, ["inspect", str(d)])
    assert f"eos_token_ids: [{EOS}] (config.json)" in result.stdout, result.output


def test_run_takes_the_sampling_defaults_of_generation_config(tmp_path, target):
    import shutil

    d = tmp_path / "sampled"
    shutil.copytree(target, d)
    _generation_config(
        d, eos_token_id=EOS, do_sample=True, temperature=0.7, top_p=0.8, top_k=20,
        repetition_penalty=1.05,
    )  # fmt: skip
    base = ["run", str(d), "--prompt", "t10 t11 t12 t13", "--max-tokens", "16", "--seed", "3"]
    base += ["--json"]

    def ids(*flags: str) -> list[int]:
        result = CliRunner().invoke(main, [*base, *flags])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["output_ids"][0]

    default = ids()
    assert default == ids("--temperature", "0.7", "--top-p", "0.8", "--top-k", "20")
    assert default != ids("--temperature", "0")  # the defaults are not greedy
    result = CliRunner().invoke(main, ["inspect", str(d)])
    assert "sampling_defaults: sample (temperature 0.7, top_p 0.8, top_k 20)" in result.stdout
    assert "sampling_not_applied: repetition_penalty=1.05 (not implemented)" in result.stdout


def test_a_mistyped_generation_config_is_refused_naming_the_file(tmp_path, target):
    import shutil

    d = tmp_path / "bad"
    shutil.copytree(target, d)
    _generation_config(d, eos_token_id=["</s>"])
    result = CliRunner().invoke(main, ["inspect", str(d)])
    assert result.exit_code == 2, result.output
    assert str(d / "generation_config.json") in result.stderr and "eos_token_id" in result.stderr


@pytest.mark.parametrize("where", ["generation_config.json", "config.json"])
def test_an_eos_id_outside_the_vocabulary_is_refused_naming_the_file(tmp_path, target, where):
    """An EOS id no token can take would let every request run to max_tokens, silently."""
    import shutil

    d = tmp_path / "bad"
    shutil.copytree(target, d)
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    if where == "generation_config.json":
        _generation_config(d, eos_token_id=[EOS, vocab + 7])
    else:
        (d / "generation_config.json").unlink()
        cfg = json.loads((d / "config.json").read_text())
        cfg["eos_token_id"] = vocab
        (d / "config.json").write_text(json.dumps(cfg))
    result = CliRunner().invoke(main, ["run", str(d), "--prompt", "t10 t11", "--max-tokens", "2"])
    assert result.exit_code == 2, result.output
    assert str(d / where) in result.stderr and "outside the vocabulary" in result.stderr
    assert "Traceback" not in result.output


def test_the_server_fills_left_out_sampling_fields_from_generation_config(tmp_path, target):
    """vLLM's `--generation-config auto`: a field the request leaves out takes the file's
    value; fields the file does not set keep the OpenAI defaults; the request's own win."""
    import shutil

    from edgebuild.serve.config import ServeConfig, ServeState
    from edgebuild.serve.protocol import CompletionRequest

    d = tmp_path / "sampled"
    shutil.copytree(target, d)
    _generation_config(d, eos_token_id=EOS, do_sample=True, temperature=0.6, top_k=20)
    state = ServeState.from_llm(ServeConfig(model=d), LLM(d))
    assert state.sampling_defaults == {"temperature": 0.6, "top_k": 20}
    left_out = CompletionRequest(model="m", prompt="t1").sampling_params(8, state.sampling_defaults)
    assert (left_out.temperature, left_out.top_p, left_out.top_k) == (0.6, 1.0, 20)
    given = CompletionRequest(model="m", prompt="t1", temperature=0.0, top_k=0)
    own = given.sampling_params(8, state.sampling_defaults)
    assert (own.temperature, own.top_k) == (0.0, 0)
    plain = ServeState.from_llm(ServeConfig(model=target), LLM(target))
    assert plain.sampling_defaults == {}
    assert CompletionRequest(model="m", prompt="t1").sampling_params(8, {}).temperature == 1.0
