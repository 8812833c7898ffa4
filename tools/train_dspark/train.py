"""Train the example DSpark draft on cached target features (CPU, seeded, reproducible).

Loss (DSpark paper, DeepSpec ``loss.py``), per block row k = 0..B-1 with weight exp(-k/4):

* cross-entropy of the Markov-corrected draft logits against the true next token;
* L1 between the draft and target distributions, ``||p_draft - p_target||_1`` (the target's
  logits = its tied ``lm_head`` on the cached post-norm hidden);
* BCE of the confidence head against ``a_k = clamp(1 - 0.5 * L1, 0, 1)`` (its inputs
  ``[h_k; W1[prev_k]]`` detached: a probe that never pulls the backbone).

The frozen target ``embed_tokens`` / ``lm_head`` stay in the module but are not trained and
never saved. Validation reports the greedy accepted length the runtime would measure
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
    """Sequences ``picks`` with up to ``anchors_per_seq`` random answer anchors each."""
    chosen = [seqs[i] for i in picks]
    t = max(len(s["ids"]) for s in chosen)
    b = len(chosen)
    n_feat = chosen[0]["taps"].shape[1]
    feats = torch.zeros(b, t, n_feat, dtype=torch.float16)
    final = torch.zeros(b, t, chosen[0]["final"].shape[1], dtype=torch.float16)
    ids = torch.zeros(b, t, dtype=torch.long)
    anchors = torch.zeros(b, anchors_per_seq, dtype=torch.long)
    valid = torch.zeros(b, anchors_per_seq, dtype=torch.bool)
    for i, s in enumerate(chosen):
        n = len(s["ids"])
        feats[i, :n], final[i, :n], ids[i, :n] = s["taps"], s["final"], s["ids"]
        # anchor s sees prompt + answer[:s]; it must have at least one label (s + 1 < n)
        pool = list(range(s["prompt_len"], n - 1))
        pick = sorted(rng.sample(pool, min(anchors_per_seq, len(pool))))
        anchors[i, : len(pick)] = torch.tensor(pick)
        valid[i, : len(pick)] = True
    lengths = torch.tensor([len(s["ids"]) for s in chosen])
    return AnchorBatch(feats, ids, lengths, anchors, valid), final


def block_losses(model, batch: AnchorBatch, final: torch.Tensor, l1_weight: float):
    """Per-row CE, L1, BCE, draft argmax and validity, all [B, A, Bs]."""
    cfg = model.config
    bs = cfg.block_size
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = train_forward(model, batch)  # [B, A, Bs, d]
    labels, valid = labels_and_valid(batch, bs)
    prev = markov_prev_ids(batch, bs)
    rows = valid.nonzero(as_tuple=True)
    h_v, y, prev_v = h[rows], labels[rows], prev[rows]  # [R, d], [R], [R]
    # the target distribution of the same positions: row k of anchor s predicts s + k + 1
    pos = (batch.anchors[..., None] + torch.arange(bs)).clamp_max(batch.ids.shape[1] - 1)
    tgt_h = final[rows[0], pos[rows]]  # [R, d]
    head = model.lm_head.weight
    with torch.autocast("cpu", dtype=torch.bfloat16):
        e = model.markov_head.markov_w1(prev_v)  # [R, r]
        z = F.linear(h_v, head) + F.linear(e, model.markov_head.markov_w2.weight)
        with torch.no_grad():
            z_t = F.linear(tgt_h.to(torch.bfloat16), head.to(torch.bfloat16))
    logp = torch.log_softmax(z.float(), dim=-1)
    ce = -logp.gather(1, y[:, None]).squeeze(1)
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
    hit[rows] = logp.argmax(-1) == y
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
def validate(model, seqs: list[dict], anchors_per_seq: int, batch: int, seed: int) -> dict:
    """Teacher-forced greedy acceptance on held-out sequences (fixed anchors)."""
    rng = random.Random(seed)
    model.eval()
    lens, ces, hits, counts = [], [], None, None
    for i in range(0, len(seqs), batch):
        picks = list(range(i, min(i + batch, len(seqs))))
        ab, final = make_batch(seqs, picks, anchors_per_seq, rng)
        _, out = block_losses(model, ab, final, 1.0)
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


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
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
    ap.add_argument("--features", type=Path, nargs="+", required=True, help="feature folders")
    ap.add_argument("--val-features", type=Path, default=None)
    ap.add_argument(
        "--resume-from",
        type=Path,
        default=None,
        help="a draft checkpoint folder (e.g. the shipped one) whose weights start training",
    )
    ap.add_argument("--out", type=Path, required=True)
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
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    metas = [json.loads((f / "meta.json").read_text()) for f in args.features]
    if any(m["taps"] != metas[0]["taps"] for m in metas):
        raise SystemExit(f"--features folders tap different layers: {[m['taps'] for m in metas]}")
    meta = metas[0]
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
    if args.resume_from is not None:
        resume_weights(model, draft_cfg, args.resume_from)
    seqs = [s for f in args.features for s in load_shards(f)]
    val = load_shards(args.val_features) if args.val_features else []
    n_tok = sum(len(s["ids"]) - s["prompt_len"] for s in seqs)
    print(f"{len(seqs)} train sequences ({n_tok} answer tokens), {len(val)} val", flush=True)
    params = [p for p in model.parameters() if p.requires_grad]
    print(f"trainable parameters: {sum(p.numel() for p in params) / 1e6:.2f} M", flush=True)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / "train_log.jsonl").open("w")
    order: list[int] = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        if len(order) < args.seqs_per_step:
            more = list(range(len(seqs)))
            rng.shuffle(more)
            order += more
        picks, order = order[: args.seqs_per_step], order[args.seqs_per_step :]
        batch, final = make_batch(seqs, picks, args.anchors, rng)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        loss, out = block_losses(model, batch, final, args.l1_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        rec = {"step": step + 1, "loss": round(float(loss.detach()), 4)}
        rec.update({k: round(out[k], 4) for k in ("ce", "l1", "bce")})
        rec["tau_tf"] = round(
            1.0 + float(accepted_lengths(out["hit"], out["valid"]).float().mean()), 3
        )
        rec["elapsed_s"] = round(time.perf_counter() - t0, 1)
        if val and ((step + 1) % args.val_every == 0 or step + 1 == args.steps):
            rec["val"] = validate(model, val, args.anchors, args.seqs_per_step, args.seed)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if (step + 1) % 20 == 0 or "val" in rec:
            print(json.dumps(rec), flush=True)
        if (step + 1) % args.save_every == 0:  # a usable draft at any time
            save_checkpoint(model, draft_cfg, args.out / "checkpoint")
    save_checkpoint(model, draft_cfg, args.out / "checkpoint")
    summary = {
        "steps": args.steps,
        "train_s": round(time.perf_counter() - t0, 1),
        "sequences": len(seqs),
        "answer_tokens": n_tok,
        "args": {k: _jsonable(v) for k, v in vars(args).items()},
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
