"""The differentiable training forward of a DSpark draft, on edgebuild's own draft module.

The parameters live in an :class:`edgebuild.models.dspark.DSparkDraft` (so names and shapes are
the checkpoint's, spec/draft-checkpoint-formats.md section 1.2); this module re-states its
inference math without the paged cache, for many anchor blocks at once:

* context rows ``C = hidden_norm(fc(F))`` at positions ``0 .. T-1`` feed every layer's k/v
  projections directly (K after ``k_norm`` and RoPE, V as projected; spec section 2.2, 7);
* anchor block ``j`` = ``[x[s_j], mask x (B-1)]`` at positions ``s_j .. s_j+B-1``;
* dense masked attention: a row of block ``j`` sees context rows ``< s_j`` and every row of
  its own block (non-causal), nothing else (DeepSpec ``create_dspark_attention_mask``);
* ``h = norm(x)``; logits = ``lm_head(h)`` (the target's tied head, frozen) + the vanilla
  Markov bias ``W2 W1[prev_k]`` with teacher forcing (``prev_0`` = anchor, ``prev_k`` = the
  true token at ``s_j + k``).

``tests/test_train_dspark_forward.py`` checks this forward against ``DSparkDraft``'s paged
``context_update`` + ``block_forward``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from edgebuild.checkpoint.config import ModelConfig
from edgebuild.models.dspark import DSparkConfig, DSparkDraft
from edgebuild.ops.rope import apply_rope

# Resolved from the target at load time; never saved (SpecForge / RadixArk packaging).
BORROWED = ("lm_head.weight", "embed_tokens.weight")


def draft_config_dict(
    target_cfg: dict,
    *,
    num_layers: int,
    target_layer_ids: list[int],
    block_size: int,
    markov_rank: int,
    mask_token_id: int,
    markov_topk: int = 64,
) -> dict:
    """A ``DSparkDraftModel``-packaged config.json (fields in ``dflash_config``) for the target.

    ``markov_topk`` (vLLM's hf_config key) is the Markov walk's recommended candidate count,
    the runtime's default ``draft_top_k`` for this draft.
    """
    d = target_cfg["hidden_size"]
    heads = target_cfg["num_attention_heads"]
    kv = target_cfg.get("num_key_value_heads", heads)
    return {
        "architectures": ["DSparkDraftModel"],
        "model_type": "qwen3",
        "hidden_size": d,
        "intermediate_size": target_cfg["intermediate_size"],
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": target_cfg.get("head_dim") or d // heads,
        "vocab_size": target_cfg["vocab_size"],
        "rms_norm_eps": target_cfg.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": target_cfg.get("max_position_embeddings", 8192),
        "rope_parameters": target_cfg["rope_parameters"],
        "tie_word_embeddings": False,
        "attention_bias": False,
        "hidden_act": "silu",
        "layer_types": ["full_attention"] * num_layers,
        "block_size": block_size,
        "num_target_layers": target_cfg["num_hidden_layers"],
        "markov_topk": markov_topk,
        "dtype": "bfloat16",
        "dflash_config": {
            "projector_type": "dspark",
            "mask_token_id": mask_token_id,
            "target_layer_ids": list(target_layer_ids),
            "markov_rank": markov_rank,
            "markov_head_type": "vanilla",
            "enable_confidence_head": True,
            "confidence_head_with_markov": True,
            "attention_mode": "gqa" if kv < heads else "mha",
        },
    }


def build_draft(
    draft_cfg: dict,
    target_cfg: dict,
    target_tensors: dict[str, torch.Tensor],
    *,
    init_layers_from: list[int] | None,
    seed: int,
) -> DSparkDraft:
    """A trainable fp32 draft: embed_tokens / lm_head = the target's (tied), frozen.

    ``init_layers_from[i]`` = the target layer whose attention projections, MLP and norms
    initialise draft layer ``i`` (None: random init, std 0.02); q_norm / k_norm start at 1.
    The final ``norm`` starts as the target's ``model.norm`` (same head, same logit scale).
    The Markov head starts as W1 ~ N(0, 0.02), W2 = 0 (zero bias); the confidence head at 0.
    """
    torch.manual_seed(seed)
    tcfg = ModelConfig.from_dict(target_cfg, "target config.json")
    cfg = DSparkConfig.from_dict(draft_cfg, tcfg, "draft config.json")
    model = DSparkDraft(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() == 2:
                p.normal_(0.0, 0.02)
            else:
                p.zero_()
        embed = target_tensors["model.embed_tokens.weight"].float()
        model.embed_tokens.weight.copy_(embed)
        head = target_tensors.get("lm_head.weight", embed)
        model.lm_head.weight.copy_(head.float())
        # the draft's h goes through the target's head: start from the target's final norm
        model.norm.weight.copy_(target_tensors["model.norm.weight"].float())
        model.markov_head.markov_w2.weight.zero_()
        model.confidence_head.proj.weight.zero_()
        for i, src in enumerate(init_layers_from or []):
            prefix = f"model.layers.{src}."
            for name, p in model.layers[i].named_parameters():
                if prefix + name in target_tensors:
                    p.copy_(target_tensors[prefix + name].float())
    model.embed_tokens.weight.requires_grad_(False)
    model.lm_head.weight.requires_grad_(False)
    return model


def trainable_state(model: DSparkDraft) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint ships: everything but the borrowed head and embedding."""
    return {k: v for k, v in model.state_dict().items() if k not in BORROWED}


def save_checkpoint(model: DSparkDraft, draft_cfg: dict, out: Path, dtype=torch.bfloat16) -> None:
    """``model.safetensors`` (``dtype``, no lm_head / embed_tokens) + ``config.json``.

    Each file is written under a temporary name and renamed into place, so a reader (or an
    interruption) never sees a torn file.
    """
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in trainable_state(model).items()}
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")
    tmp = out / "config.json.tmp"
    tmp.write_text(json.dumps(draft_cfg, indent=2) + "\n")
    tmp.replace(out / "config.json")


@dataclass
class AnchorBatch:
    """A padded training batch: B sequences, A anchor blocks each, block size Bs.

    features: [B, T, n_t*d] target taps (fp32 or fp16), zero past ``lengths``.
    ids: int64 [B, T] tokens (prompt + answer).
    lengths: int64 [B] valid rows.
    anchors: int64 [B, A] anchor positions s (rows with ``anchor_valid`` False are padding).
    anchor_valid: bool [B, A].
    """

    features: torch.Tensor
    ids: torch.Tensor
    lengths: torch.Tensor
    anchors: torch.Tensor
    anchor_valid: torch.Tensor

    def to(self, device) -> AnchorBatch:
        """The same batch on ``device``."""
        return AnchorBatch(
            self.features.to(device),
            self.ids.to(device),
            self.lengths.to(device),
            self.anchors.to(device),
            self.anchor_valid.to(device),
        )


def block_ids_and_positions(
    batch: AnchorBatch, block_size: int, mask_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block input ids [B, A, Bs] (anchor then masks) and their positions s+i [B, A, Bs]."""
    anchors = batch.anchors
    anchor_ids = batch.ids.gather(1, anchors)  # [B, A]
    ids = torch.full((*anchors.shape, block_size), mask_id, dtype=torch.long, device=anchors.device)
    ids[..., 0] = anchor_ids
    pos = anchors[..., None] + torch.arange(block_size, device=anchors.device)
    return ids, pos


def attention_mask(batch: AnchorBatch, block_size: int) -> torch.Tensor:
    """bool [B, A*Bs, T + A*Bs]: block rows see context < s and their own block."""
    b, t = batch.ids.shape
    a = batch.anchors.shape[1]
    dev = batch.ids.device
    ctx = torch.arange(t, device=dev)[None, None, :] < batch.anchors[..., None]  # [B, A, T]
    ctx = ctx[:, :, None, :].expand(b, a, block_size, t).reshape(b, a * block_size, t)
    own = torch.eye(a, dtype=torch.bool, device=dev).repeat_interleave(block_size, 0)
    own = own.repeat_interleave(block_size, 1)  # [A*Bs, A*Bs]
    mask = torch.cat([ctx, own[None].expand(b, -1, -1)], dim=-1)
    # padding anchors: let them see themselves only (their loss is masked out)
    return mask


def _heads(x: torch.Tensor, n: int, hd: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], n, hd)


def train_forward(model: DSparkDraft, batch: AnchorBatch) -> torch.Tensor:
    """Post-``norm`` draft hidden ``h`` [B, A, Bs, d] of every anchor block (see module doc)."""
    cfg = model.config
    bs, hq, hkv, hd = cfg.block_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    b, t = batch.ids.shape
    a = batch.anchors.shape[1]
    ids, pos = block_ids_and_positions(batch, bs, cfg.mask_token_id)
    table = model.rope_table(int(max(t, int(pos.max()) + 1))).to(ids.device)
    ctx_pos = torch.arange(t, device=ids.device)[None].expand(b, t)
    blk_pos = pos.reshape(b, a * bs)
    context = model.hidden_norm(F.linear(batch.features.float(), model.fc.weight.float()))
    x = model.embed_tokens(ids.reshape(b, a * bs))  # [B, A*Bs, d]
    mask = attention_mask(batch, bs)[:, None]  # [B, 1, A*Bs, T + A*Bs]
    for layer in model.layers:
        attn = layer.self_attn
        xn = layer.input_layernorm(x)
        q = apply_rope(attn.q_norm(_heads(attn.q_proj(xn), hq, hd)), blk_pos, table)
        k_blk = apply_rope(attn.k_norm(_heads(attn.k_proj(xn), hkv, hd)), blk_pos, table)
        k_ctx = apply_rope(attn.k_norm(_heads(attn.k_proj(context), hkv, hd)), ctx_pos, table)
        v = torch.cat([attn.v_proj(context), attn.v_proj(xn)], dim=1)
        k = torch.cat([k_ctx, k_blk], dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2).float(),
            k.transpose(1, 2).float(),
            _heads(v, hkv, hd).transpose(1, 2).float(),
            attn_mask=mask,
            scale=hd**-0.5,
            enable_gqa=hkv != hq,
        )  # [B, Hq, A*Bs, hd]
        out = out.transpose(1, 2).reshape(b, a * bs, hq * hd).to(x.dtype)
        x = x + attn.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x).reshape(b, a, bs, -1)


def markov_prev_ids(batch: AnchorBatch, block_size: int) -> torch.Tensor:
    """Teacher-forced previous tokens [B, A, Bs]: ``prev_k = x[s + k]`` (anchor for k = 0)."""
    pos = batch.anchors[..., None] + torch.arange(block_size, device=batch.ids.device)
    pos = pos.clamp_max(batch.ids.shape[1] - 1)
    return batch.ids.gather(1, pos.reshape(pos.shape[0], -1)).reshape(pos.shape)


def labels_and_valid(batch: AnchorBatch, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row k of block j predicts ``x[s_j + k + 1]``: labels and validity, each [B, A, Bs]."""
    pos = batch.anchors[..., None] + torch.arange(1, block_size + 1, device=batch.ids.device)
    valid = (pos < batch.lengths[:, None, None]) & batch.anchor_valid[..., None]
    pos = pos.clamp_max(batch.ids.shape[1] - 1)
    labels = batch.ids.gather(1, pos.reshape(pos.shape[0], -1)).reshape(pos.shape)
    return labels, valid
