"""Train the example DSpark draft on cached target features (CPU, seeded, reproducible).

Loss (DSpark paper, DeepSpec ``loss.py``), per block row k = 0..B-1 with weight exp(-k/4):

* cross-entropy of the Markov-corrected draft logits against the true next token;
* L1 between the draft and target distributions, ``||p_draft - p_target||_1`` (the target's
  logits = its tied ``lm_head`` on the cached post-norm hidden);
* BCE of the confidence head against ``a_k = clamp(1 - 0.5 * L1, 0, 1)`` (its inputs
  ``[h_k; W1[prev_k]]`` detached: a probe that never pulls the backbone).

``--vocab-subset N`` computes CE and L1 on a candidate vocabulary instead of all 49,152 ids:
the union, over the step's rows, of the labels and the target's cached top-k next tokens,
plus ``N`` uniformly sampled ids (both distributions renormalised on that set). The lm_head
matmuls dominate a CPU step; the subset makes them several times cheaper. Validation always
uses the full vocabulary.

The frozen target ``embed_tokens`` / ``lm_head`` stay in the module but are not trained and
never saved. Every ``--save-every`` steps the run writes its draft (``checkpoint/``) and its
full state (``train_state.pt``: weights, AdamW moments, step, RNG, data order); a run whose
``--out`` holds a state resumes from it (``--resume-from RUN_DIR`` too), so an interrupted
run continues and ends with the same weights. Validation reports the greedy accepted length the runtime would measure
(teacher-forced chain = the greedy walk while every draft matches), ``tau = 1 + E[accepted]``.

    python -m tools.train_dspark.train --features .cache/train_dspark/features \
        --val-features .cache/train_dspark/eval_features --out .cache/train_dspark/run
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tools.train_dspark.cache_features import load_shards
from tools.train_dspark.model import (
    AnchorBatch,
    build_draft,
    draft_config_dict,
    labels_and_valid,
    markov_prev_ids,
    save_checkpoint,
    train_forward,
    trainable_state,
)

POSITION_DECAY = 4.0  # w_k = exp(-k / 4)


def make_batch(seqs: list[dict], picks: list[int], anchors_per_seq: int, rng: random.Random):
    """Sequences ``picks`` with up to ``anchors_per_seq`` random answer anchors each.

    Returns (AnchorBatch, final [B, T, d] fp16, topk [B, T, k] int64 or None).
    """
    chosen = [seqs[i] for i in picks]
    t = max(len(s["ids"]) for s in chosen)
    b = len(chosen)
    n_feat = chosen[0]["taps"].shape[1]
    feats = torch.zeros(b, t, n_feat, dtype=torch.float16)
    final = torch.zeros(b, t, chosen[0]["final"].shape[1], dtype=torch.float16)
    ids = torch.zeros(b, t, dtype=torch.long)
    anchors = torch.zeros(b, anchors_per_seq, dtype=torch.long)
    valid = torch.zeros(b, anchors_per_seq, dtype=torch.bool)
    has_topk = all("topk" in s for s in chosen)
    topk = torch.zeros(b, t, chosen[0]["topk"].shape[1], dtype=torch.long) if has_topk else None
    for i, s in enumerate(chosen):
        n = len(s["ids"])
        feats[i, :n], final[i, :n], ids[i, :n] = s["taps"], s["final"], s["ids"]
        if topk is not None:
            topk[i, :n] = s["topk"]
        # anchor s sees prompt + answer[:s]; it must have at least one label (s + 1 < n)
        pool = list(range(s["prompt_len"], n - 1))
        pick = sorted(rng.sample(pool, min(anchors_per_seq, len(pool))))
        anchors[i, : len(pick)] = torch.tensor(pick)
        valid[i, : len(pick)] = True
    lengths = torch.tensor([len(s["ids"]) for s in chosen])
    return AnchorBatch(feats, ids, lengths, anchors, valid), final, topk


def block_losses(
    model,
    batch: AnchorBatch,
    final: torch.Tensor,
    l1_weight: float,
    topk: torch.Tensor | None = None,
    vocab_subset: int = 0,
    generator: torch.Generator | None = None,
):
    """Per-row CE, L1, BCE, draft argmax and validity, all [B, A, Bs].

    ``vocab_subset`` > 0 (needs ``topk``): CE / L1 on the candidate set described in the
    module docstring, with ``vocab_subset`` random ids drawn from ``generator``.
    """
    cfg = model.config
    bs = cfg.block_size
    dev = batch.ids.device
    amp = dict(device_type=dev.type, dtype=torch.bfloat16)
    with torch.autocast(**amp):
        h = train_forward(model, batch)  # [B, A, Bs, d]
    labels, valid = labels_and_valid(batch, bs)
    prev = markov_prev_ids(batch, bs)
    rows = valid.nonzero(as_tuple=True)
    h_v, y, prev_v = h[rows], labels[rows], prev[rows]  # [R, d], [R], [R]
    # the target distribution of the same positions: row k of anchor s predicts s + k + 1
    pos = (batch.anchors[..., None] + torch.arange(bs, device=dev)).clamp_max(
        batch.ids.shape[1] - 1
    )
    tgt_h = final[rows[0], pos[rows]]  # [R, d]
    head = model.lm_head.weight
    w2 = model.markov_head.markov_w2.weight  # [V, r]
    if vocab_subset > 0:
        if topk is None:
            raise ValueError("vocab_subset needs the features' target top-k ids")
        rand = torch.randint(0, head.shape[0], (vocab_subset,), generator=generator)
        cand = torch.cat([y, topk[rows[0], pos[rows]].reshape(-1), rand.to(dev)])
        cand, inv = torch.unique(cand, return_inverse=True)
        y_col = inv[: y.shape[0]]
        head, w2 = head[cand], w2[cand]
    else:
        y_col = y
    with torch.autocast(**amp):
        e = model.markov_head.markov_w1(prev_v)  # [R, r]
        z = F.linear(h_v, head) + F.linear(e, w2)
        with torch.no_grad():
            z_t = F.linear(tgt_h.to(torch.bfloat16), head.to(torch.bfloat16))
    logp = torch.log_softmax(z.float(), dim=-1)
    ce = -logp.gather(1, y_col[:, None]).squeeze(1)
    p_t = torch.softmax(z_t.float(), dim=-1)
    l1 = (logp.exp() - p_t).abs().sum(-1)
    a = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)
    proj = model.confidence_head.proj
    conf_in = torch.cat([h_v.detach().float(), e.detach().float()], dim=-1)
    conf_logit = F.linear(conf_in, proj.weight, proj.bias).squeeze(-1)
    bce = F.binary_cross_entropy_with_logits(conf_logit, a, reduction="none")
    k = rows[2].float()
    w = torch.exp(-k / POSITION_DECAY)
    loss = (w * (ce + l1_weight * l1)).sum() / w.sum() + bce.mean()
    hit = torch.zeros_like(valid)
    hit[rows] = logp.argmax(-1) == y_col
    return loss, {
        "ce": float(ce.detach().mean()),
        "l1": float(l1.detach().mean()),
        "bce": float(bce.detach().mean()),
        "hit": hit,
        "valid": valid,
        "conf": torch.sigmoid(conf_logit.detach()),
        "accept": a,
    }


def accepted_lengths(hit: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Greedy accepted drafts per block: the first miss ends the chain. [B, A] -> [N]."""
    blocks = valid[..., 0]
    chain = (hit & valid).long().cumprod(-1).sum(-1)
    return chain[blocks]


@torch.no_grad()
def validate(
    model, seqs: list[dict], anchors_per_seq: int, batch: int, seed: int, device: str = "cpu"
) -> dict:
    """Teacher-forced greedy acceptance on held-out sequences (fixed anchors, full vocab)."""
    rng = random.Random(seed)
    model.eval()
    lens, ces, hits, counts = [], [], None, None
    for i in range(0, len(seqs), batch):
        picks = list(range(i, min(i + batch, len(seqs))))
        ab, final, _ = make_batch(seqs, picks, anchors_per_seq, rng)
        _, out = block_losses(model, ab.to(device), final.to(device), 1.0)
        lens.append(accepted_lengths(out["hit"], out["valid"]))
        ces.append(out["ce"])
        h = (out["hit"] & out["valid"]).long().cumprod(-1).sum((0, 1))
        c = out["valid"].long().sum((0, 1))
        hits = h if hits is None else hits + h
        counts = c if counts is None else counts + c
    model.train()
    acc = torch.cat(lens).float()
    return {
        "tau": round(1.0 + float(acc.mean()), 4),
        "ce": round(sum(ces) / len(ces), 4),
        "chain_by_position": [round(float(x), 4) for x in (hits / counts.clamp_min(1))],
    }


class OnlineFeatures:
    """Target features made in the training step (no cache): taps, final hidden, top-k.

    The same quantities as ``cache_features`` (fp16 like the cache), from the target in bf16
    on ``device``; used by the GPU path, where running the target is cheaper than storing
    ~4.6 KB of features per token.
    """

    def __init__(self, target: Path, taps: list[int], topk: int, device: str):
        from tools.train_dspark.regenerate import load_target

        _, self.model = load_target(target, torch.bfloat16)
        self.model.to(device)
        self.taps, self.topk, self.device = taps, topk, device

    @staticmethod
    def sequences(answers: Path, max_answer_tokens: int) -> list[dict]:
        """Token ids and prompt lengths of an answers jsonl (a prefix of it, if limited)."""
        from tools.train_dspark.prompts import read_jsonl

        out, n = [], 0
        for r in read_jsonl(answers):
            if max_answer_tokens and n >= max_answer_tokens:
                break
            out.append(
                {
                    "ids": torch.tensor(r["prompt_ids"] + r["answer_ids"]),
                    "prompt_len": len(r["prompt_ids"]),
                }
            )
            n += len(r["answer_ids"])
        return out

    def attach(self, seqs: list[dict]) -> list[dict]:
        """Copies of ``seqs`` with ``taps``, ``final`` (fp16) and ``topk`` filled in."""
        from tools.train_dspark.cache_features import hidden_features, target_topk

        if not seqs:
            return []
        feats = hidden_features(
            self.model, [s["ids"].tolist() for s in seqs], self.taps, self.device
        )
        out = []
        for s, (tap, fin) in zip(seqs, feats, strict=True):
            top = target_topk(self.model, fin, self.topk)
            out.append(
                {**s, "taps": tap.half().cpu(), "final": fin.half().cpu(), "topk": top.cpu()}
            )
        return out


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine from ``peak`` to 10 % of it."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t)))


def _jsonable(v):
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    return v


def save_state(
    path: Path, model, opt, step: int, rng, order, gen, budget_total: int | None = None
) -> None:
    """Everything a resumed run needs, written atomically. ``budget_total``: the step count a
    ``--budget-minutes`` run settled on (a resumed run keeps it, and its lr schedule)."""
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "model": trainable_state(model),
            "opt": opt.state_dict(),
            "step": step,
            "rng": rng.getstate(),
            "order": order,
            "torch_rng": torch.get_rng_state(),
            "gen": gen.get_state(),
            "budget_total": budget_total,
        },
        tmp,
    )
    tmp.replace(path)


def resume_weights(model, draft_cfg: dict, ckpt: Path) -> None:
    """Load a saved draft's trainable tensors (its ``config.json`` must match ``draft_cfg``)."""
    saved = json.loads((ckpt / "config.json").read_text())
    if saved != draft_cfg:
        diff = sorted(k for k in set(saved) | set(draft_cfg) if saved.get(k) != draft_cfg.get(k))
        raise SystemExit(f"--resume-from {ckpt}: config.json differs from this run in {diff}")
    tensors = load_file(str(ckpt / "model.safetensors"))
    own = trainable_state(model)
    if set(tensors) != set(own):
        raise SystemExit(f"--resume-from {ckpt}: tensors differ: {sorted(set(tensors) ^ set(own))}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in tensors:
                p.copy_(tensors[name].float())
    print(f"resumed {len(tensors)} tensors from {ckpt}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=Path("examples/smollm2-135m"))
    ap.add_argument("--features", type=Path, nargs="+", default=None, help="feature folders")
    ap.add_argument("--val-features", type=Path, default=None)
    ap.add_argument(
        "--answers",
        type=Path,
        default=None,
        help="online features instead of --features: an answers jsonl; the target runs in "
        "each step (the GPU path, where a 10M-token feature cache would not fit the disk)",
    )
    ap.add_argument("--val-answers", type=Path, default=None)
    ap.add_argument("--taps", type=int, nargs="+", default=[1, 14, 27], help="with --answers")
    ap.add_argument("--topk", type=int, default=32, help="with --answers")
    ap.add_argument("--stop-after", type=int, default=0, help="stop (saved) at this step")
    ap.add_argument(
        "--budget-minutes",
        type=float,
        default=0,
        help="wall-clock budget of the training loop: after 20 timed steps the run's step count "
        "(and so its lr schedule) becomes min(--steps, what fits in the budget, 10%% held back "
        "for validation and saving); 0: run --steps",
    )
    ap.add_argument("--val-first", action="store_true", help="also validate before step 1")
    ap.add_argument(
        "--resume-from",
        type=Path,
        default=None,
        help="a draft checkpoint folder (e.g. the shipped one) whose weights start training",
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-train-tokens", type=int, default=0, help="a prefix of the data")
    ap.add_argument("--vocab-subset", type=int, default=0, help="0: full-vocabulary loss")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--val-limit", type=int, default=0, help="validation sequences (0: all)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--init-from", type=int, nargs="*", default=None)
    ap.add_argument("--block-size", type=int, default=7)
    ap.add_argument("--markov-rank", type=int, default=64)
    ap.add_argument("--mask-token-id", type=int, default=16)  # '<empty_output>', unused in chat
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--seqs-per-step", type=int, default=4)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--l1-weight", type=float, default=1.0)
    ap.add_argument("--val-every", type=int, default=500)
    ap.add_argument(
        "--val-anchors", type=int, default=0, help="anchors per validation sequence (0: --anchors)"
    )
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    val_anchors = args.val_anchors or args.anchors  # the same validation blocks across layouts
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    if (args.features is None) == (args.answers is None):
        raise SystemExit("give --features (cached) or --answers (online features)")
    if args.features is not None:
        metas = [json.loads((f / "meta.json").read_text()) for f in args.features]
        if any(m["taps"] != metas[0]["taps"] for m in metas):
            raise SystemExit(
                f"--features folders tap different layers: {[m['taps'] for m in metas]}"
            )
        meta = metas[0]
    else:
        meta = {"taps": args.taps}
    target_cfg = json.loads((args.target / "config.json").read_text())
    target_tensors = load_file(str(args.target / "model.safetensors"))
    draft_cfg = draft_config_dict(
        target_cfg,
        num_layers=args.layers,
        target_layer_ids=meta["taps"],
        block_size=args.block_size,
        markov_rank=args.markov_rank,
        mask_token_id=args.mask_token_id,
    )
    model = build_draft(
        draft_cfg, target_cfg, target_tensors, init_layers_from=args.init_from, seed=args.seed
    )
    del target_tensors
    state_path = args.out / "train_state.pt"
    if args.resume_from is not None and (args.resume_from / "train_state.pt").is_file():
        state_path = args.resume_from / "train_state.pt"  # continue that run
    elif args.resume_from is not None:
        resume_weights(model, draft_cfg, args.resume_from)  # warm start from a draft
    seqs = []
    online = None
    if args.answers is not None:
        online = OnlineFeatures(args.target, args.taps, args.topk, args.device)
        seqs = online.sequences(args.answers, args.max_train_tokens)
        val = online.sequences(args.val_answers, 0) if args.val_answers else []
        val = online.attach(val[: args.val_limit or None])
    else:
        for f in args.features:
            left = args.max_train_tokens - sum(len(s["ids"]) - s["prompt_len"] for s in seqs)
            if args.max_train_tokens and left <= 0:
                break
            seqs += load_shards(f, left if args.max_train_tokens else 0)
        val = load_shards(args.val_features) if args.val_features else []
    if args.val_limit:
        val = val[: args.val_limit]
    model.to(args.device)
    n_tok = sum(len(s["ids"]) - s["prompt_len"] for s in seqs)
    print(f"{len(seqs)} train sequences ({n_tok} answer tokens), {len(val)} val", flush=True)
    params = [p for p in model.parameters() if p.requires_grad]
    print(f"trainable parameters: {sum(p.numel() for p in params) / 1e6:.2f} M", flush=True)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    args.out.mkdir(parents=True, exist_ok=True)
    order: list[int] = []
    first = 0
    budget_total = None  # the step count a --budget-minutes run settled on
    if state_path.is_file():
        st = torch.load(state_path, weights_only=False)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in st["model"]:
                    p.copy_(st["model"][name])
        opt.load_state_dict(st["opt"])
        first, order = st["step"], st["order"]
        budget_total = st.get("budget_total")
        rng.setstate(st["rng"])
        torch.set_rng_state(st["torch_rng"])
        gen.set_state(st["gen"])
        print(f"resumed at step {first} from {state_path}", flush=True)
    log_path = args.out / "train_log.jsonl"
    kept: list[str] = []
    if first and log_path.is_file():  # keep the log of the steps before the state
        kept = [ln for ln in log_path.read_text().splitlines() if json.loads(ln)["step"] <= first]
        log_path.write_text("".join(ln + "\n" for ln in kept))
    log = log_path.open("a" if first else "w")
    t0 = time.perf_counter()
    elapsed0 = json.loads(kept[-1])["elapsed_s"] if kept else 0.0
    if val and args.val_first and first == 0:
        rec0 = {"step": 0, "tokens": 0, "elapsed_s": 0.0}
        rec0["val"] = validate(model, val, val_anchors, args.seqs_per_step, args.seed, args.device)
        log.write(json.dumps(rec0) + "\n")
        log.flush()
        print(json.dumps(rec0), flush=True)
    total = budget_total or args.steps  # a resumed budgeted run keeps its step count
    probe = args.budget_minutes and budget_total is None
    probe_from, probe_t = first + 5, 0.0  # the first steps warm up (allocator, autotuning)
    step = first - 1
    while step + 1 < total:
        step += 1
        if probe and step == probe_from:
            probe_t = time.perf_counter()
        if probe and step == probe_from + 20:
            per_step = (time.perf_counter() - probe_t) / 20
            left = 60 * args.budget_minutes * 0.9 - (time.perf_counter() - t0)
            total = budget_total = max(step + 1, min(args.steps, step + int(left / per_step)))
            print(
                f"budget {args.budget_minutes} min: {per_step * 1e3:.0f} ms a step -> "
                f"{total} steps (of --steps {args.steps})",
                flush=True,
            )
        if len(order) < args.seqs_per_step:
            more = list(range(len(seqs)))
            rng.shuffle(more)
            order += more
        picks, order = order[: args.seqs_per_step], order[args.seqs_per_step :]
        if online is not None:  # the target runs now: features of this step's sequences
            batch, final, topk = make_batch(
                online.attach([seqs[i] for i in picks]), list(range(len(picks))), args.anchors, rng
            )
        else:
            batch, final, topk = make_batch(seqs, picks, args.anchors, rng)
        lr = lr_at(step, total, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        loss, out = block_losses(
            model,
            batch.to(args.device),
            final.to(args.device),
            args.l1_weight,
            topk=None if topk is None else topk.to(args.device),
            vocab_subset=args.vocab_subset,
            generator=gen,
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        rec = {"step": step + 1, "loss": round(float(loss.detach()), 4), "lr": lr}
        rec.update({k: round(out[k], 4) for k in ("ce", "l1", "bce")})
        rec["tau_tf"] = round(
            1.0 + float(accepted_lengths(out["hit"], out["valid"]).float().mean()), 3
        )
        rec["tokens"] = (step + 1) * args.seqs_per_step * args.anchors * args.block_size
        rec["elapsed_s"] = round(elapsed0 + time.perf_counter() - t0, 1)
        if val and ((step + 1) % args.val_every == 0 or step + 1 == total):
            rec["val"] = validate(
                model, val, val_anchors, args.seqs_per_step, args.seed, args.device
            )
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if (step + 1) % 20 == 0 or "val" in rec:
            print(json.dumps(rec), flush=True)
        if (step + 1) % args.save_every == 0:  # a usable draft at any time
            save_checkpoint(model, draft_cfg, args.out / "checkpoint")
            save_state(
                args.out / "train_state.pt", model, opt, step + 1, rng, order, gen, budget_total
            )
        if args.stop_after and step + 1 >= args.stop_after:
            save_checkpoint(model, draft_cfg, args.out / "checkpoint")
            save_state(
                args.out / "train_state.pt", model, opt, step + 1, rng, order, gen, budget_total
            )
            print(f"stopped after step {step + 1} (resumable)", flush=True)
            return
    save_checkpoint(model, draft_cfg, args.out / "checkpoint")
    save_state(args.out / "train_state.pt", model, opt, total, rng, order, gen, budget_total)
    summary = {
        "steps": total,
        "train_s": round(elapsed0 + time.perf_counter() - t0, 1),
        "sequences": len(seqs),
        "answer_tokens": n_tok,
        "args": {k: _jsonable(v) for k, v in vars(args).items()},
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
