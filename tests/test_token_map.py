"""The draft's token map (FR-Spec's hot-token vocabulary, edgebuild.speculative.token_map).

Oracles: the whole head's logits at the map's rows (bit for bit: each row is packed and
computed on its own), a full-vocabulary draft whose base logits outside the map are -inf (a
walk over the map must propose exactly what that draft proposes, with the same q), greedy
DSpark equal to target-only token for token, a brute-force ranking, and the files' contents.
"""

from __future__ import annotations

import json

import pytest
import torch
from dspark_fixtures import assert_greedy_dspark_equals_target_only, make_random_draft
from serve_fixtures import torch_threads, write_tiny_chat_model

from edgebuild.errors import ConfigError
from edgebuild.runtime.dspark_backend import TorchDraft
from edgebuild.runtime.llm import LLM, RuntimeOptions
from edgebuild.runtime.markov_walk import rescue
from edgebuild.runtime.sampling import SamplingParams
from edgebuild.speculative.config import SpeculativeConfig
from edgebuild.speculative.token_map import (
    TOKEN_MAP_FILE,
    rank_tokens,
    read_token_map,
    write_token_map,
)

MAP = sorted({1, *range(0, 256, 3), *range(100, 140)})  # EOS (t1) plus a spread of ids


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = write_tiny_chat_model(root / "tiny")
    draft = make_random_draft(root / "draft", target, block_size=4, scale=0.2)
    path = root / "map.json"
    write_token_map(path, torch.tensor(MAP))
    return target, draft, path


def spec(draft, **extra) -> dict:
    return {"method": "dspark", "model": str(draft), "num_speculative_tokens": 3,
            "confidence_scheduling": False, **extra}  # fmt: skip


def opts() -> RuntimeOptions:
    return RuntimeOptions(dtype=torch.float32, max_kv_rows=512, page_size=8)


# ------------------------------------------------------------------------------ files
def test_read_token_map_sorts_and_reads_json_and_pt(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([9, 2, 5]))
    torch.save(torch.tensor([7, 3], dtype=torch.int32), tmp_path / "b.pt")
    torch.save([4, 0], tmp_path / "c.pt")
    assert read_token_map(tmp_path / "a.json", 10).tolist() == [2, 5, 9]
    assert read_token_map(tmp_path / "b.pt", 10).tolist() == [3, 7]
    assert read_token_map(tmp_path / "c.pt", 10).tolist() == [0, 4]
    assert read_token_map(tmp_path / "a.json", 10).dtype == torch.int64


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("[]", "non-empty 1-D list"),
        ('{"ids": [1]}', "non-empty 1-D list"),
        ("[1, 2.5]", "non-empty 1-D list"),
        ("[true]", "non-empty 1-D list"),
        ("[1, 10]", r"token id 10 is outside the draft's vocabulary \[0, 10\)"),
        ("[-1]", "token id -1 is outside"),
        ("[3, 1, 3]", "token id 3 is listed twice"),
        ("[1,", "cannot read the token map"),
    ],
)
def test_bad_token_maps_are_refused_naming_the_file(tmp_path, content, match):
    path = tmp_path / "m.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=match) as err:
        read_token_map(path, 10)
    assert str(path) in str(err.value)


def test_bad_pt_token_maps_are_refused(tmp_path):
    for i, bad in enumerate([torch.zeros(2, 2, dtype=torch.long), torch.tensor([1.0])]):
        torch.save(bad, tmp_path / f"{i}.pt")
        with pytest.raises(ConfigError, match="non-empty 1-D list"):
            read_token_map(tmp_path / f"{i}.pt", 10)


def test_rank_tokens_equals_a_brute_force_ranking():
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 6, (300,), generator=g)  # many ties
    for size, always in [(1, ()), (17, ()), (40, (299, 250)), (300, (5,))]:
        order = sorted(range(300), key=lambda i: (i not in always, -int(counts[i]), i))
        assert rank_tokens(counts, size, always).tolist() == sorted(order[:size])
    with pytest.raises(ValueError):
        rank_tokens(counts, 0)
    with pytest.raises(ValueError):
        rank_tokens(counts, 1, (1, 2))


def test_write_token_map_round_trips_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "m.json"
    write_token_map(path, torch.tensor([5, 1, 3]))
    assert json.loads(path.read_text()) == [5, 1, 3]
    assert read_token_map(path, 6).tolist() == [1, 3, 5]
    assert [p.name for p in path.parent.iterdir()] == ["m.json"]


# ----------------------------------------------------------------------------- config
def test_the_config_takes_the_drafts_own_map_a_given_path_or_null(pair, tmp_path):
    _, draft, path = pair
    assert SpeculativeConfig.parse(spec(draft)).token_map is None  # the draft ships none
    given = SpeculativeConfig.parse(spec(draft, token_map=str(path)))
    assert (given.token_map, given.token_map_given) == (path, True)
    own = tmp_path / "draft"
    own.mkdir()
    for f in draft.iterdir():
        (own / f.name).symlink_to(f)
    (own / TOKEN_MAP_FILE).write_text("[1, 2]")
    auto = SpeculativeConfig.parse(spec(own))
    assert (auto.token_map, auto.token_map_given) == (own / TOKEN_MAP_FILE, False)
    off = SpeculativeConfig.parse(spec(own, token_map=None))
    assert (off.token_map, off.token_map_given) == (None, False)
    with pytest.raises(ConfigError, match="token_map 'nope.json' is not a file"):
        SpeculativeConfig.parse(spec(draft, token_map="nope.json"))
    for bad in (3, "", ["a"], True):
        with pytest.raises(ConfigError, match="token_map must be the path"):
            SpeculativeConfig.parse(spec(draft, token_map=bad))


def test_a_map_for_another_vocabulary_is_refused_at_load(pair, tmp_path):
    target, draft, _ = pair
    bad = tmp_path / "big.json"
    bad.write_text("[1, 300]")
    with pytest.raises(ConfigError, match="token id 300 is outside the draft's vocabulary"):
        LLM(target, speculative=spec(draft, token_map=str(bad)), options=opts())


# ------------------------------------------------------------------------------ model
@pytest.mark.parametrize("quantization", ["none", "int4", "int8"])
def test_base_logits_over_the_map_are_the_whole_heads_columns(pair, quantization):
    target, draft, path = pair
    with torch_threads(1):
        full = LLM(target, speculative=spec(draft, quantization=quantization), options=opts())
        cut = LLM(target, speculative=spec(draft, quantization=quantization,
                                           token_map=str(path)), options=opts())  # fmt: skip
        h = torch.randn(2, 3, full.draft.config.hidden_size, generator=torch.Generator())
        want = full.draft.model.base_logits(h)[..., MAP]
        got = cut.draft.model.base_logits(h)
    assert got.shape == (2, 3, len(MAP))
    assert torch.equal(got, want)  # the same rows, packed and computed row by row
    assert cut.draft.model.token_map.tolist() == MAP


def masked_walk(draft: TorchDraft, h, base_full, *args):
    """The oracle: the full-vocabulary draft with every token outside MAP at -inf."""
    keep = torch.zeros(base_full.shape[-1], dtype=torch.bool)
    keep[MAP] = True
    return draft.walk(h, base_full.masked_fill(~keep, float("-inf")), *args)


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("top_k", [5, 0])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_walk_over_the_map_proposes_what_a_masked_full_vocabulary_draft_does(
    tmp_path, head, top_k, temperature
):
    target = write_tiny_chat_model(tmp_path / "tiny")
    draft = make_random_draft(tmp_path / "d", target, block_size=4, scale=0.5,
                              markov_head_type=head)  # fmt: skip
    path = tmp_path / "map.json"
    write_token_map(path, torch.tensor(MAP))
    extra = {"draft_top_k": top_k, "quantization": "none"}
    with torch_threads(1):
        full = LLM(target, speculative=spec(draft, **extra), options=opts()).draft
        cut = LLM(target, speculative=spec(draft, token_map=str(path), **extra),
                  options=opts()).draft  # fmt: skip
        g = torch.Generator().manual_seed(3)
        h = full.model.norm(torch.randn(3, 4, full.config.hidden_size, generator=g))
        base = full.model.base_logits(h)
        params = [SamplingParams(temperature=temperature, seed=s) for s in (1, 2, 3)]

        def args():
            gens = [torch.Generator().manual_seed(s) for s in (5, 6, 7)]
            return [2, 7, 40], [4, 3, 2], params, gens

        want = masked_walk(full, h, base, *args())
        got = cut.walk(h, base[..., MAP], *args())
    for w, g_ in zip(want, got, strict=True):
        assert g_.tokens == w.tokens and set(g_.tokens) <= set(MAP)
        torch.testing.assert_close(g_.confidence, w.confidence, rtol=0, atol=0)
        torch.testing.assert_close(g_.dense_q(256), w.dense_q(256), rtol=1e-5, atol=1e-6)
        assert set(g_.q_ids.flatten().tolist()) <= set(MAP)


def test_rescue_returns_token_ids_of_the_map():
    class Allow:  # a grammar's DraftMask stand-in: only even token ids
        def allowed(self, ids):
            return ids % 2 == 0

    base = torch.tensor([5.0, 1.0, 4.0, 3.0, 2.0])
    ids = torch.tensor([3, 10, 11, 20, 21])  # column j is token ids[j]
    tok, top = rescue(base, Allow(), 2, ids)
    assert tok.tolist() == [20, 10] and top.tolist() == [3.0, 1.0]
    tok, _ = rescue(base, Allow(), 2)  # without a map: column j is token j
    assert tok.tolist() == [0, 2]


# ------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("quantization", [None, "none"])
def test_greedy_dspark_with_a_map_equals_target_only(pair, quantization):
    target, draft, path = pair
    extra = {"token_map": str(path)} | ({"quantization": quantization} if quantization else {})
    with torch_threads(1):
        llm = LLM(target, speculative=spec(draft, **extra), options=opts())
        assert_greedy_dspark_equals_target_only(llm, ["hello there", "t5 t9 t77 t3", "abc"])


# ------------------------------------------------------------------------ review fixes
def test_bool_masks_huge_ids_and_pth_files(tmp_path):
    torch.save(torch.tensor([True, False, True]), tmp_path / "mask.pt")
    with pytest.raises(ConfigError, match="non-empty 1-D list of integer"):
        read_token_map(tmp_path / "mask.pt", 10)
    (tmp_path / "huge.json").write_text("[1, 99999999999999999999999]")
    with pytest.raises(ConfigError, match="token id 99999999999999999999999 is outside"):
        read_token_map(tmp_path / "huge.json", 10)
    torch.save(torch.tensor([4, 2]), tmp_path / "m.pth")
    assert read_token_map(tmp_path / "m.pth", 10).tolist() == [2, 4]


def test_a_hub_repositorys_file_is_taken_from_the_hub_cache(pair, tmp_path, monkeypatch):
    from hub_fixtures import publish

    _, draft, path = pair
    folder = tmp_path / "repo"
    folder.mkdir()
    torch.save(torch.tensor(MAP), folder / "freq_64.pt")
    cache = tmp_path / "hub"
    publish(cache, "org/fr-spec", folder)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    got = SpeculativeConfig.parse(spec(draft, token_map="org/fr-spec/freq_64.pt"))
    assert got.token_map_given and got.token_map.name == "freq_64.pt"
    assert read_token_map(got.token_map, 256).tolist() == MAP
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set and it is not in the Hub cache"):
        SpeculativeConfig.parse(spec(draft, token_map="org/fr-spec/freq_99.pt"))


def test_packing_keeps_the_state_dict_and_repacks_for_another_map(pair):
    target, draft, path = pair
    with torch_threads(1):
        full = LLM(target, speculative=spec(draft, quantization="none"), options=opts()).draft
        model = full.model
        keys = sorted(model.state_dict())
        h = torch.randn(1, 2, full.config.hidden_size)
        want = model.base_logits(h)
        ids = torch.tensor(MAP)
        cut = TorchDraft(model, 64, 8, quant=None, token_map=ids)
        assert sorted(model.state_dict()) == keys  # no parameter added by the cut head
        assert torch.equal(model.base_logits(h), want[..., MAP])
        TorchDraft(model, 64, 8, quant=None)  # the same model without a map: repacked
        assert model.token_map is None and torch.equal(model.base_logits(h), want)
        assert cut.model is model


def test_a_bad_map_is_refused_before_the_draft_weights_load(pair, tmp_path, monkeypatch):
    from edgebuild.models.dspark import DSparkDraft

    target, draft, _ = pair
    bad = tmp_path / "big.json"
    bad.write_text("[1, 300]")

    def no_load(*a, **k):
        raise AssertionError("the draft's weights were loaded before the map was checked")

    monkeypatch.setattr(DSparkDraft, "from_plan", no_load)
    monkeypatch.setattr(DSparkDraft, "from_source", no_load)
    with pytest.raises(ConfigError, match="token id 300 is outside"):
        LLM(target, speculative=spec(draft, token_map=str(bad)), options=opts())


def test_an_engine_host_refuses_a_given_map_before_building(pair, monkeypatch):
    import edgebuild.deploy as deploy
    from edgebuild.runtime.select import HostProbe
    from edgebuild.serve.config import ServeConfig

    target, draft, path = pair

    def no_build(*a, **k):
        raise AssertionError("engines were built before the map was refused")

    monkeypatch.setattr(deploy, "build_cached", no_build)
    probe = HostProbe.from_mapping({"tensorrt": "10.13.3", "gpu": "sm_110"})
    for extra, key in (({"token_map": str(path)}, "token_map"), ({"quantization": "int4"},
                                                                 "quantization")):  # fmt: skip
        cfg = ServeConfig(model=str(target), speculative_config=json.dumps(spec(draft, **extra)))
        with pytest.raises(ConfigError, match=f"{key} .* applies to the torch"):
            deploy.prepare_serve(cfg, probe)
