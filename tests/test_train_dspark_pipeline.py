"""The example draft's data / feature / training pipeline (tools/train_dspark), each against
an independent oracle:

* cached feature shards == a direct, unpadded transformers pass of each sequence alone
  (taps, final hidden, the target's top-k from its full logits), and a deleted shard is
  rebuilt identically (resume);
* the vocabulary-subset loss == the full-vocabulary loss when the subset covers the vocab,
  and its CE is never above the full CE otherwise (renormalised on fewer ids);
* an interrupted training run (``--stop-after``, then rerun) ends with exactly the weights,
  AdamW moments and step of the uninterrupted run;
* the prompt pool and the committed self-instruct prompts never mention an eval topic
  (held-out topics recomputed from ``prompts.py``'s seeded split) nor equal an eval prompt;
* pack / unpack of the committed answers round-trips the token ids, prompt ids = the chat
  template's, and ``limit_tokens`` gives nested prefixes;
* ``gpu.sh`` dry run on the CPU with a tiny budget writes a draft in the repo layout whose
  tensors are the shipped draft's (names, shapes, bf16, no lm_head / embed_tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tools.train_dspark import cache_features, datagen, train  # noqa: E402
from tools.train_dspark.prompts import DATA_DIR, TOPICS, read_jsonl  # noqa: E402

transformers = pytest.importorskip("transformers")
from test_train_dspark_forward import _tiny_target  # noqa: E402  (one tiny target for both)


def _sequences(n: int, seed: int = 0) -> list[dict]:
    g = random.Random(seed)
    out = []
    for _ in range(n):
        p, a = g.randint(3, 9), g.randint(8, 20)
        out.append(
            {
                "prompt_ids": [g.randrange(20, 96) for _ in range(p)],
                "answer_ids": [g.randrange(20, 96) for _ in range(a)],
            }
        )
    return out


def _cache(target: Path, rows: list[dict], out: Path, shard: int = 3) -> None:
    """cache_features.main on an answers jsonl (fp32, batch 2, small shards)."""
    answers = out.parent / f"{out.name}.jsonl"
    answers.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [
        "cache_features", "--target", str(target), "--answers", str(answers), "--out", str(out),
        "--taps", "0", "2", "--topk", "5", "--batch", "2", "--shard", str(shard),
        "--dtype", "float32", "--threads", "1",
    ]  # fmt: skip
    old = sys.argv
    sys.argv = argv
    try:
        cache_features.main()
    finally:
        sys.argv = old


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipe")
    target = _tiny_target(root / "target")
    # cache_features / train load a tokenizer only through load_target: give the tiny one none
    return root, target


def test_cached_shards_equal_a_direct_target_pass_and_resume(tiny, monkeypatch):
    root, target = tiny
    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    monkeypatch.setattr(cache_features, "load_target", lambda p, dt: (None, model.to(dt)))
    rows = _sequences(7)
    out = root / "feats"
    _cache(target, rows, out)
    got = cache_features.load_shards(out)
    assert len(got) == len(rows)
    by_ids = {tuple(s["ids"].tolist()): s for s in got}
    for r in rows:
        ids = r["prompt_ids"] + r["answer_ids"]
        s = by_ids[tuple(ids)]
        assert s["prompt_len"] == len(r["prompt_ids"])
        with torch.no_grad():
            o = model(torch.tensor([ids]), output_hidden_states=True)
        taps = torch.cat([o.hidden_states[1], o.hidden_states[3]], dim=-1)[0]
        torch.testing.assert_close(s["taps"].float(), taps, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(s["final"].float(), o.hidden_states[-1][0], atol=2e-3, rtol=2e-3)
        top = torch.topk(o.logits[0], 5, dim=-1).indices
        assert torch.equal(s["topk"].long().sort(-1).values, top.sort(-1).values)
    # resume: a deleted shard is rebuilt, the others are kept as they are
    shard1 = out / "shard-0001"
    before = {p.name: p.read_bytes() for p in shard1.iterdir()}
    kept = (out / "shard-0000" / "taps.npy").stat().st_mtime_ns
    for p in shard1.iterdir():
        p.unlink()
    shard1.rmdir()
    _cache(target, rows, out)
    assert {p.name: p.read_bytes() for p in shard1.iterdir()} == before
    assert (out / "shard-0000" / "taps.npy").stat().st_mtime_ns == kept
    # a prefix of the data: whole sequences in answer order until the token budget is met
    first = cache_features.load_shards(out, max_answer_tokens=20)
    assert 1 <= len(first) < len(rows)
    assert sum(len(s["ids"]) - s["prompt_len"] for s in first[:-1]) < 20


def _draft(target: Path, layers: int = 1):
    from tools.train_dspark.model import build_draft, draft_config_dict

    tcfg = json.loads((target / "config.json").read_text())
    dcfg = draft_config_dict(
        tcfg, num_layers=layers, target_layer_ids=[0, 2], block_size=4, markov_rank=8,
        mask_token_id=3,
    )  # fmt: skip
    tensors = load_file(str(target / "model.safetensors"))
    return build_draft(dcfg, tcfg, tensors, init_layers_from=None, seed=0)


def test_subset_loss_equals_full_loss_when_it_covers_the_vocabulary(tiny):
    root, target = tiny
    seqs = cache_features.load_shards(root / "feats")
    model = _draft(target)
    with torch.no_grad():  # a non-trivial Markov head and a trained-looking backbone
        model.markov_head.markov_w2.weight.normal_(0, 0.3)
    batch, final, topk = train.make_batch(seqs, [0, 1, 2], 4, random.Random(0))
    full, f = train.block_losses(model, batch, final, 1.0)
    gen = torch.Generator().manual_seed(0)
    cover, c = train.block_losses(model, batch, final, 1.0, topk, vocab_subset=5000, generator=gen)
    torch.testing.assert_close(cover, full, atol=1e-4, rtol=1e-4)
    for k in ("ce", "l1", "bce"):
        assert abs(c[k] - f[k]) < 1e-4, k
    assert torch.equal(c["hit"], f["hit"])
    small, s = train.block_losses(model, batch, final, 1.0, topk, vocab_subset=4, generator=gen)
    assert s["ce"] <= f["ce"] + 1e-6 and s["ce"] > 0
    with pytest.raises(ValueError):
        train.block_losses(model, batch, final, 1.0, None, vocab_subset=4)


def _train(target: Path, feats: Path, out: Path, *extra: str) -> None:
    argv = [
        "train", "--target", str(target), "--features", str(feats), "--out", str(out),
        "--layers", "1", "--block-size", "4", "--markov-rank", "8", "--mask-token-id", "3",
        "--steps", "6", "--seqs-per-step", "2", "--anchors", "3", "--lr", "1e-2",
        "--warmup", "2", "--save-every", "2", "--threads", "1", "--vocab-subset", "16", *extra,
    ]  # fmt: skip
    old = sys.argv
    sys.argv = argv
    try:
        train.main()
    finally:
        sys.argv = old


def test_an_interrupted_training_run_resumes_to_the_same_weights(tiny):
    root, target = tiny
    feats = root / "feats"
    _train(target, feats, root / "straight")
    _train(target, feats, root / "cut", "--stop-after", "3")
    cut = torch.load(root / "cut" / "train_state.pt", weights_only=False)
    assert cut["step"] == 3
    _train(target, feats, root / "cut")  # resumes from its own train_state.pt
    a = torch.load(root / "straight" / "train_state.pt", weights_only=False)
    b = torch.load(root / "cut" / "train_state.pt", weights_only=False)
    assert a["step"] == b["step"] == 6
    assert set(a["model"]) == set(b["model"])
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert not any(torch.equal(a["model"][k], cut["model"][k]) for k in a["model"] if "fc" in k)
    sa, sb = a["opt"]["state"], b["opt"]["state"]
    for i in sa:
        assert torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"])
    steps = [json.loads(x)["step"] for x in (root / "cut" / "train_log.jsonl").open()]
    assert steps == list(range(1, 7))
    ckpt = load_file(str(root / "cut" / "checkpoint" / "model.safetensors"))
    assert "lm_head.weight" not in ckpt and "embed_tokens.weight" not in ckpt


def test_a_time_budget_sets_the_step_count_after_the_timed_steps(tiny):
    """--budget-minutes: steps 5..25 are timed, then the run is cut to what fits. A budget far
    below 25 steps' time leaves exactly step 26 (the schedule then ends at it); an ample one
    runs every --steps."""
    root, target = tiny
    feats = root / "feats"
    _train(target, feats, root / "short", "--steps", "200", "--budget-minutes", "1e-5")
    log = [json.loads(x) for x in (root / "short" / "train_log.jsonl").open()]
    assert [r["step"] for r in log] == list(range(1, 27))
    assert log[-1]["lr"] < 0.11 * 1e-2  # the cosine ended at step 26, not at --steps 200
    assert json.loads((root / "short" / "summary.json").read_text())["steps"] == 26
    assert torch.load(root / "short" / "train_state.pt", weights_only=False)["step"] == 26
    # the same command again resumes the finished run: it keeps its 26 steps
    _train(target, feats, root / "short", "--steps", "200", "--budget-minutes", "1e-5")
    log = [json.loads(x) for x in (root / "short" / "train_log.jsonl").open()]
    assert [r["step"] for r in log] == list(range(1, 27))
    _train(target, feats, root / "ample", "--steps", "30", "--budget-minutes", "60")
    steps = [json.loads(x)["step"] for x in (root / "ample" / "train_log.jsonl").open()]
    assert steps == list(range(1, 31))


def _held_out_topics() -> list[str]:
    rng = random.Random(0)  # prompts.make_prompts(seed=0): shuffle, the first sixth held out
    topics = list(TOPICS)
    rng.shuffle(topics)
    return topics[: max(1, len(topics) // 6)]


def test_training_prompts_keep_the_eval_topics_out():
    held = _held_out_topics()
    evals = [r["prompt"] for r in read_jsonl(DATA_DIR / "eval_prompts.jsonl")]
    # the oracle is right: every template eval prompt names a held-out topic
    assert sum(any(t in p for t in held) for p in evals) >= 56
    pool = [r["prompt"] for r in datagen.make_pool(0)]
    si_path = datagen.DISTILL_DIR / "selfinstruct_prompts.jsonl"
    si = [r["prompt"] for r in read_jsonl(si_path)] if si_path.exists() else []
    assert len(pool) > 20_000
    for p in pool + si:
        low = p.lower()
        assert not any(t.lower().removeprefix("the ") in low for t in held), p
    assert not set(pool + si) & set(evals)
    assert len(set(pool)) == len(pool) and len(set(si)) == len(si)


def test_pack_unpack_round_trips_the_answers(smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    from tools.train_dspark.regenerate import chat_ids

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir), local_files_only=True)
    g = random.Random(1)
    rows = []
    for r in datagen.make_pool(0)[:9]:
        a = [g.randrange(0, 49152) for _ in range(g.randint(1, 30))]
        rows.append({**r, "prompt_ids": chat_ids(tok, r["prompt"]), "answer_ids": a})
    # two --part files, written out of order: pack merges them in the prompt order
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[4:7]))
    (cache / "answers.part0of2.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows[7:] + rows[:2])
    )
    (cache / "answers.part1of2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[2:4]))
    merged = datagen.merged_answers(datagen.answer_files(cache), datagen.make_pool(0))
    assert merged == rows
    with pytest.raises(SystemExit, match="repeated"):
        datagen.merged_answers(datagen.answer_files(cache) * 2, datagen.make_pool(0))
    info = datagen.pack(merged, tmp_path / "data")
    assert info == {"answers": 9, "answer_tokens": sum(len(r["answer_ids"]) for r in rows)}
    back = datagen.unpack(tmp_path / "data", tok)
    assert back == rows
    prev = []
    for n in (1, 20, 60, 10**6):
        pre = datagen.unpack(tmp_path / "data", tok, n)
        assert pre[: len(prev)] == prev and sum(len(r["answer_ids"]) for r in pre) >= min(
            n, info["answer_tokens"]
        )
        prev = pre


def test_gpu_script_dry_run_on_the_cpu_writes_a_repo_layout_draft(smollm2_dir, tmp_path):
    env = {
        **os.environ,
        "PY": sys.executable, "DEVICE": "cpu", "OUT": str(tmp_path / "gpu"),
        "TARGET": str(smollm2_dir), "SI": "4", "SI_BATCH": "8", "VARIANTS": "1",
        "BUDGET_TOKENS": "60", "GEN_BATCH": "4", "MAX_NEW": "12", "STEPS": "2", "SEQS": "2",
        "ANCHORS": "4", "THREADS": "1", "EVAL_LIMIT": "4", "VAL_LIMIT": "4",
        "PYTHONPATH": str(ROOT),
    }  # fmt: skip
    res = subprocess.run(
        ["bash", str(ROOT / "tools/train_dspark/gpu.sh")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    draft = tmp_path / "gpu" / "draft"
    got = load_file(str(draft / "model.safetensors"))
    shipped = load_file(str(ROOT / "edgebuild/data/smollm2-135m-dspark/model.safetensors"))
    assert {k: tuple(v.shape) for k, v in got.items()} == {
        k: tuple(v.shape) for k, v in shipped.items()
    }
    assert all(v.dtype == torch.bfloat16 for v in got.values())
    cfg = json.loads((draft / "config.json").read_text())
    ref = json.loads((ROOT / "edgebuild/data/smollm2-135m-dspark/config.json").read_text())
    assert cfg["architectures"] == ["DSparkDraftModel"]
    assert cfg["dflash_config"] == ref["dflash_config"]
    data = tmp_path / "gpu" / "data"
    assert (data / "answers.npz").is_file() and (data / "prompts.jsonl.gz").is_file()
    log = [json.loads(x) for x in (tmp_path / "gpu" / "run" / "train_log.jsonl").open()]
    assert [r["step"] for r in log] == [1, 2] and "val" in log[-1]


def test_self_instruct_prompts_take_their_share_of_every_prefix():
    pool = [{"id": f"p{i}", "source": "template", "prompt": f"p{i}"} for i in range(300)]
    si = [{"id": f"s{i}", "source": "self-instruct", "prompt": f"s{i}"} for i in range(50)]
    rows = datagen.mixed_prompts(pool, si, 0, 0.25)
    assert sorted(r["id"] for r in rows) == sorted(r["id"] for r in pool + si)
    for n in (4, 40, 160):
        share = sum(r["source"] == "self-instruct" for r in rows[:n]) / n
        assert abs(share - 0.25) <= 1 / n + 1e-9, (n, share)
    assert all(r["source"] == "template" for r in rows[-50:])  # self-instruct ran out


def test_dev_prompts_are_the_unanswered_tail_and_part_specs_are_checked(tmp_path):
    order = [{"id": f"p{i}", "source": "template", "prompt": f"q{i}"} for i in range(20)]
    done = tmp_path / "answers.jsonl"
    done.write_text("".join(json.dumps({"id": f"p{i}"}) + "\n" for i in range(12)))
    dev = datagen.dev_prompts(order, [done], 5)
    assert [r["id"] for r in dev] == [f"p{i}" for i in range(15, 20)]
    with pytest.raises(SystemExit, match="already answered"):
        datagen.dev_prompts(order, [done], 10)  # p10, p11 are training data
    assert datagen.parse_part("1/2") == (1, 2)
    for bad in ("2/2", "x", "1/0", "-1/3"):
        with pytest.raises(argparse.ArgumentTypeError, match="--part"):
            datagen.parse_part(bad)


def test_walk_follows_the_runtime_anchors_and_the_token_budget():
    from tools.train_dspark.walk_tau import walk_steps

    chain = [2, 9, 9, 0, 6, 9, 9, 9, 9, 9, 9, 1, 0]  # accepted drafts at answer anchor j
    # anchors 0 -> 3 (2 accepted + bonus) -> 4 -> 11 -> 13: the skipped anchors never count
    assert walk_steps(chain, 100) == [3, 1, 7, 2]
    # 8 tokens: the prefill's first token + 7 from the steps, the last step cut to fit
    assert walk_steps(chain, 8) == [3, 1, 3] and 1 + sum(walk_steps(chain, 8)) == 8
    assert walk_steps([], 64) == [] and walk_steps([0, 0], 64) == [1, 1]
