"""DSpark draft model: config, backbone (context update + non-causal block) and the small heads.

A DSpark draft (spec/draft-checkpoint-formats.md, cited below as "spec §N") is a few Qwen3
layers that read two sources: the *context* (target hidden states of committed tokens, projected
by ``fc`` + ``hidden_norm``, whose K/V persist in the draft's paged cache) and the *block*
``[anchor, mask x (B-1)]`` at positions ``s .. s+B-1`` (whose K/V never persist). Every block
row sees every context row and every block row (non-causal). Row ``i`` predicts the token at
``s+i+1`` (all-predicting, spec §3), so a block of ``B`` rows yields ``B`` drafts. The logits are
``lm_head(norm(h))`` plus, during the left-to-right walk, a low-rank Markov bias that depends
on the previous token (spec §1.3); an optional confidence head estimates acceptance (spec §1.4).

This module owns:

* :class:`DSparkConfig` (re-exported; it lives in :mod:`edgebuild.checkpoint.dspark_config`
  with :func:`read_dspark_field`, the one reader of draft config fields).
* :func:`check_draft`, :func:`canonical_name`, :func:`expected_shapes` (re-exported; they
  live in :mod:`edgebuild.checkpoint.draft` with :func:`~edgebuild.checkpoint.draft.pair_draft`,
  the one validation of a draft against its target that run, serve, build and ``inspect
  --draft`` share).
* :class:`DSparkDraft`: parameter names are the checkpoint names without a ``model.`` prefix
  (spec §1.2, mapped by :func:`canonical_name`); :meth:`DSparkDraft.from_plan` loads a
  validated plan.
* :class:`DSparkMarkovHead` (vanilla / gated / rnn) and :class:`DSparkConfidenceHead`.

Attention goes through :func:`edgebuild.ops.attention.paged_attention` (the attention plugin's
CPU reference), like the target model in :mod:`edgebuild.models.llama`.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from edgebuild.checkpoint.config import ModelConfig
from edgebuild.checkpoint.draft import (
    CheckedDraft,
    DraftPlan,
    canonical_name,
    check_draft,
    checked_config,
    expected_shapes,
)
from edgebuild.checkpoint.dspark_config import (
    DSparkConfig,
    DSparkPackaging,
    MarkovHeadType,
    default_target_layer_ids,
    read_dspark_field,
)
from edgebuild.checkpoint.quant import QuantizedWeight
from edgebuild.checkpoint.source import WeightSource
from edgebuild.errors import ConfigError
from edgebuild.models.common import (
    FusedLayers,
    GatedMLP,
    PagedBatch,
    PreNormDecoderLayer,
    RMSNorm,
    add_linear_args,
    attention,
    dense,
)
from edgebuild.ops import f32_linear
from edgebuild.ops.attention import AttentionSpec
from edgebuild.ops.linear import PackedLinear, use_packed
from edgebuild.ops.rope import rope_cos_sin_table

log = logging.getLogger("edgebuild.models")

__all__ = [
    "CheckedDraft",
    "DSparkConfidenceHead",
    "DSparkConfig",
    "DSparkDraft",
    "DSparkMarkovHead",
    "DSparkPackaging",
    "MarkovHeadType",
    "canonical_name",
    "check_draft",
    "default_target_layer_ids",
    "expected_shapes",
    "read_dspark_field",
]


# ---------------------------------------------------------------------------- heads
class DSparkMarkovHead(nn.Module):
    """Low-rank previous-token logit bias (spec §1.3, [DS] ``markov_head.py``).

    Notation: ``e = W1[prev]`` ``[B, r]`` (``markov_w1``, an Embedding ``[V, r]``), ``W2`` =
    ``markov_w2.weight`` ``[V, r]`` (a Linear r -> V), ``h`` the post-final-norm draft hidden of
    the row being decided.

    * vanilla: ``bias = W2 e``
    * gated: ``g = sigmoid(gate_proj([h; e]))`` (gate_proj ``[r, d+r]``), ``bias = W2 (g * e)``
    * rnn: ``[a; c; o] = chunk3(joint_proj([s_prev; e; h]))`` (joint_proj ``[3r, 2r+d]``),
      ``s = sigmoid(a) * s_prev + (1 - sigmoid(a)) * tanh(c)``, ``bias = W2 tanh(o)``; the state
      starts at zero for row 0 and is carried from row to row within one proposal (spec §7).

    The latent and the bias are computed in fp32 from the stored weights.
    """

    def __init__(self, head_type: MarkovHeadType, vocab_size: int, rank: int, hidden_size: int):
        super().__init__()
        self.head_type, self.rank = head_type, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if head_type is MarkovHeadType.GATED:
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif head_type is MarkovHeadType.RNN:
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def prev_embedding(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """``W1[prev_ids]``: int ``[...]`` -> fp32 ``[..., r]``."""
        return self.markov_w1(prev_ids.long()).float()

    def latent(
        self, prev_ids: torch.Tensor, h_k: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The vector ``u`` with ``bias = W2 u``, and the new rnn state.

        Args:
            prev_ids: int ``[B]``, the token before row k (anchor for k = 0).
            h_k: ``[B, d]`` post-norm draft hidden of row k (unused by vanilla).
            state: fp32 ``[B, r]`` rnn state after row k-1, or None (= zeros, row 0).

        Returns:
            ``(u fp32 [B, r], new_state)``; ``new_state`` is fp32 ``[B, r]`` for rnn, None else.
        """
        e = self.prev_embedding(prev_ids)
        if self.head_type is MarkovHeadType.VANILLA:
            return e, None
        h = h_k.float()
        if self.head_type is MarkovHeadType.GATED:
            p = self.gate_proj
            gate = torch.sigmoid(F.linear(torch.cat([h, e], -1), p.weight.float(), p.bias.float()))
            return gate * e, None
        s_prev = torch.zeros_like(e) if state is None else state.float()
        p = self.joint_proj
        joint = F.linear(torch.cat([s_prev, e, h], -1), p.weight.float(), p.bias.float())
        a, c, o = joint.chunk(3, dim=-1)
        keep = torch.sigmoid(a)
        new_state = keep * s_prev + (1.0 - keep) * torch.tanh(c)
        return torch.tanh(o), new_state

    @torch.no_grad()
    def step(
        self, prev_ids: torch.Tensor, h_k: torch.Tensor, state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Full-vocab bias of row k: ``(bias fp32 [B, V], new_state)``; args as :meth:`latent`.

        The decoder adds ``bias`` to ``base_logits[:, k]``, samples ``x_k`` and passes
        ``prev = x_k`` and ``new_state`` to row k+1 (spec §3 "Drafting").
        """
        u, new_state = self.latent(prev_ids, h_k, state)
        return F.linear(u, self.markov_w2.weight.float()), new_state

    @torch.no_grad()
    def candidate_bias(
        self,
        prev_ids: torch.Tensor,
        h_k: torch.Tensor,
        state: torch.Tensor | None,
        cand_ids: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Bias of row k on candidate tokens only (top-k walk, spec §3 "Top-k pruning").

        Reads only the candidates' ``W2`` rows. The rnn state update depends on ``prev`` and
        ``h_k``, not on the candidates, so ``new_state`` equals :meth:`step`'s.

        Args:
            cand_ids: int ``[B, K]`` candidate token ids; other args as :meth:`latent`.

        Returns:
            ``(bias fp32 [B, K], new_state)`` with ``bias[b, j] = step(...)[0][b, cand_ids[b, j]]``.
        """
        u, new_state = self.latent(prev_ids, h_k, state)
        rows = self.markov_w2.weight[cand_ids.long()].float()  # [B, K, r]
        return torch.einsum("bkr,br->bk", rows, u), new_state


class DSparkConfidenceHead(nn.Module):
    """Acceptance predictor ``proj`` ``[1, d(+r)]`` + bias ``[1]`` (spec §1.4)."""

    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1)


# ---------------------------------------------------------------------------- backbone
class DSparkAttention(nn.Module):
    """Dual-source attention of one draft layer (Qwen3 names: q/k/v/o_proj, q_norm, k_norm)."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.cfg = cfg
        hq, hkv, hd, d = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.hidden_size,
        )
        self.q_proj = nn.Linear(d, hq * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, hkv * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, hkv * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(hq * hd, d, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        # the context update: causal, writes K/V; the block pass: non-causal, writes nothing
        self.context_spec = AttentionSpec(
            num_q_heads=hq,
            num_kv_heads=hkv,
            head_dim=hd,
            causal=True,
            write_kv=True,
            scale=hd**-0.5,
            rms_norm_eps=cfg.rms_norm_eps,
        )
        # a windowed draft (cfg.sliding_window = W): block row at slot P + i sees slots
        # t > P + i - W (the op's window; context slots map to positions affinely, ring too)
        self.block_spec = self.context_spec.replace(
            causal=False, write_kv=False, sliding_window=cfg.sliding_window or 0
        )
        self.packed_qkv: PackedLinear | None = None  # set by pack_for_cpu
        self.packed_kv: PackedLinear | None = None
        self.packed_o: PackedLinear | None = None

    def pack_for_cpu(self, quant: str | None = None) -> None:
        """Packed q/k/v, k/v (context rows) and o_proj for eager CPU inference."""
        self.packed_qkv = PackedLinear([self.q_proj, self.k_proj, self.v_proj], quant)
        self.packed_kv = PackedLinear([self.k_proj, self.v_proj], quant)
        self.packed_o = PackedLinear([self.o_proj], quant)

    def write_context(
        self,
        context: torch.Tensor,  # [B, M, d] C = hidden_norm(fc(F)) (fc(F) with norm), not
        # input_layernorm'ed
        kv_cache: torch.Tensor,  # [num_pages, 2, Hkv, page_size, D], written in place
        batch: PagedBatch,  # the context rows: past = cached rows, positions absolute
        rope_table: torch.Tensor,  # fp32 [max_position, head_dim]
        norm: nn.Module | None = None,  # applied to context first (hidden_norm: C = norm(fc(F)))
    ) -> None:
        """Store K = rope(k_norm(k_proj(C))) and V = v_proj(C) of the context rows."""
        q = context.new_zeros(*context.shape[:2], self.q_proj.out_features)  # queries unused
        if use_packed(self.packed_kv):
            qkv = torch.cat([q, self.packed_kv(context, norm)], dim=-1)
        else:
            c = context if norm is None else norm(context).to(self.k_proj.weight.dtype)
            qkv = torch.cat([q, self.k_proj(c), self.v_proj(c)], dim=-1)
        attention(
            qkv, kv_cache, batch, rope_table, None, self.k_norm.weight, self.context_spec, False
        )

    def forward(
        self,
        x: torch.Tensor,  # [B, Bs, d] block rows
        kv_cache: torch.Tensor,  # [num_pages, 2, Hkv, page_size, D], read only
        batch: PagedBatch,  # the block rows: past = context rows, positions s..s+Bs-1
        rope_table: torch.Tensor,  # fp32 [max_position, head_dim]
        norm: nn.Module | None = None,  # applied to x first (the layer's input_layernorm)
        residual: torch.Tensor | None = None,  # [B, Bs, d] added to the output
    ) -> torch.Tensor:  # [B, Bs, d]
        """Block rows attend to all cached context rows and all block rows (non-causal):
        ``residual + o_proj(attention(qkv(norm(x))))`` (norm / residual optional)."""
        if use_packed(self.packed_qkv):
            qkv = self.packed_qkv(x, norm)
        else:
            h = x if norm is None else norm(x)
            qkv = torch.cat([self.q_proj(h), self.k_proj(h), self.v_proj(h)], dim=-1)
        out = attention(
            qkv,
            kv_cache,
            batch,
            rope_table,
            self.q_norm.weight,
            self.k_norm.weight,
            self.block_spec,
        )
        if use_packed(self.packed_o):
            return self.packed_o(out, residual=residual)
        y = self.o_proj(out)
        return y if residual is None else residual + y


class DSparkMLP(GatedMLP):
    """SwiGLU MLP without biases: ``down(silu(gate(x)) * up(x))`` (Qwen3MLP names)."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__(cfg.hidden_size, cfg.intermediate_size, bias=False)


class DSparkDecoderLayer(PreNormDecoderLayer):
    """Pre-norm Qwen3 layer whose attention also reads the cached context K/V (spec §2.4):
    ``[B, Bs, d]`` block rows -> ``[B, Bs, d]``; args as :meth:`DSparkAttention.forward`."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__(DSparkAttention(cfg), DSparkMLP(cfg), cfg.hidden_size, cfg.rms_norm_eps)


class DSparkDraft(nn.Module):
    """A DSpark draft over a paged KV cache (one pool per draft layer).

    Parameters are named as the checkpoint without ``model.`` (spec §1.2): ``layers.{i}.*``,
    ``fc``, ``hidden_norm``, ``norm``, ``markov_head.*``, ``confidence_head.proj``; plus
    ``embed_tokens`` and ``lm_head`` filled from the resolved (draft or target) tensors.
    ``markov_head`` / ``confidence_head`` are None when the config has none.

    A proposal step (spec §2, §3): :meth:`context_update` with the new target features, then
    :meth:`block_forward` on ``[anchor, mask x (B-1)]`` at positions ``s .. s+B-1`` where ``s`` is
    the anchor's position (= the draft cache length after the update), :meth:`base_logits`,
    and the left-to-right walk with ``markov_head.step`` / :meth:`confidence`. Row ``i``
    predicts the token at ``s+i+1``.
    """

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.config = cfg
        d = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(DSparkDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(cfg.fc_in_features, d, bias=False)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        head = cfg.head_type
        self.markov_head = (
            DSparkMarkovHead(head, cfg.vocab_size, cfg.markov_rank, d) if head else None
        )
        self.confidence_head = (
            DSparkConfidenceHead(cfg.confidence_in_features) if cfg.enable_confidence_head else None
        )
        self._rope_table = torch.empty(0, 0)
        self.packed_lm_head: PackedLinear | None = None  # set by pack_for_cpu
        self.packed_fc: PackedLinear | None = None  # set by pack_for_cpu where fp32 in and out
        self.block_program: FusedLayers | None = None  # set by pack_for_cpu where it can run
        # set by pack_for_cpu: every layer's packed k/v runs on edgebuild's fp32 / int4 kernels,
        # so the context update runs hidden_norm inside those calls (context_update)
        self.kv_norm_in_kernel = False
        # set by pack_for_cpu where it can run: context_layers' per-layer arguments
        # (_context_program), the context update as one C++ call
        self.context_program: dict | None = None
        # set by pack_for_cpu: the Markov / confidence heads' weights as greedy_path passes them
        self.walk_args: tuple | None = None
        # set by pack_for_cpu where it can run: draft_pass' bound arguments (_pass_args)
        self.pass_args: dict | None = None
        # the draft vocabulary (edgebuild.speculative.token_map): int64 [V'] token ids, sorted;
        # base_logits' column j is token token_map[j]. None: the whole vocabulary.
        self.token_map: torch.Tensor | None = None

    def pack_for_cpu(
        self, quant: str | None = None, token_map: torch.Tensor | None = None
    ) -> DSparkDraft:
        """Pack the layers' linears, ``fc`` and ``lm_head`` once for the eager CPU runtime.

        ``token_map`` (int ``[V']``, unique token ids sorted ascending:
        :func:`edgebuild.speculative.token_map.read_token_map`) cuts the draft's vocabulary:
        only those rows of ``lm_head`` are packed for :meth:`base_logits` (quantized row by
        row as the whole head would be, so each kept logit is the whole head's value); the
        module's parameters and ``state_dict`` stay the checkpoint's. Packing again (another
        ``quant`` or map, or None for the whole vocabulary) replaces the previous packing.

        As :meth:`edgebuild.models.llama.LlamaForCausalLM.pack_for_cpu`: names and
        ``state_dict`` unchanged, eager forwards only, one extra copy in memory. ``fc`` is
        packed only where its kernel takes the features in fp32 as they are (spec §2.7:
        target features can exceed 2e4, so no int8 activations): fp32 weights on edgebuild's
        fp32 kernel, or ``int4`` weights on its int4 kernel with fp32 inputs. Where every
        linear of the layers runs on edgebuild's kernels, the block pass runs as one C++
        program (:class:`edgebuild.models.common.FusedLayers` with ``block=True``, the same
        op calls as the modules, so the same bits). Returns self.
        """
        for layer in self.layers:
            layer.pack_for_cpu(quant)
        self.token_map, head = None, self.lm_head
        if token_map is not None:
            ids = token_map.long()
            if ids.dim() != 1 or not len(ids) or bool((ids[1:] <= ids[:-1]).any()):
                raise ValueError("token_map must be unique token ids sorted ascending")
            if int(ids[0]) < 0 or int(ids[-1]) >= self.config.vocab_size:
                raise ValueError(f"token_map ids must be in [0, {self.config.vocab_size})")
            head = nn.Linear(self.lm_head.in_features, len(ids), bias=False, device="meta")
            head.weight = nn.Parameter(self.lm_head.weight.detach()[ids], requires_grad=False)
            self.token_map = ids
        self.packed_lm_head = PackedLinear([head], quant)  # its own copy: `head` is dropped
        self.packed_fc = None  # decided before packing: no quantization done to be dropped
        if quant in (None, "int4") and self.fc.weight.dtype == torch.float32:
            fc = PackedLinear([self.fc], quant, int4_activations="fp32")
            self.packed_fc = fc if fc.f32_kernel or (fc.int4_f32 and not fc.int4_a8) else None
        self.block_program = FusedLayers.build(self.layers, block=True)
        self.kv_norm_in_kernel = all(
            layer.self_attn.packed_kv.kernel_call() is not None for layer in self.layers
        )
        self.context_program = self._context_program() if self.kv_norm_in_kernel else None
        self.walk_args = self._walk_args()
        self.pass_args = self._pass_args()
        return self

    def _pass_args(self) -> dict | None:
        """``edgebuild_attn::draft_pass``' bound arguments (:meth:`draft_pass`: the context
        update, the block pass, ``lm_head`` and the greedy walk in one C++ call), where the
        update and the block already run as one C++ call each (:attr:`context_program`,
        :attr:`block_program`), ``fc`` and ``lm_head`` on the kernels, with an fp32
        embedding and full attention; else None. ``walk`` is None for an rnn head (no
        one-call walk: :meth:`greedy_path`)."""
        prog, block = self.context_program, self.block_program
        fc = None if self.packed_fc is None else self.packed_fc.kernel_call()
        head = None if self.packed_lm_head is None else self.packed_lm_head.kernel_call()
        emb = self.embed_tokens.weight
        if (
            prog is None
            or block is None
            or block.flat is None
            or fc is None
            or head is None
            or emb.dtype != torch.float32
        ):
            return None
        lists = {k: [] for k in ("w", "sl", "bias", "n", "kind")}
        add_linear_args(lists, fc[0].default, fc[1])
        add_linear_args(lists, head[0].default, head[1])
        hq, hkv, _, window, scale, _ = block.layers[0][-1]
        if window:  # a sliding window: the block's masks are the window's (not built here)
            return None
        if (hq, float(scale), block.flat["qk_eps"]) != (prog["hq"], prog["scale"], prog["eps"]):
            return None  # the call's one set of heads, scale and q/k-norm eps serves both
        walk = None if self.walk_args is None else f32_linear.markov_head_args(*self.walk_args)
        return {
            "fc": [lists[k][0] for k in ("kind", "w", "sl", "bias", "n")],
            "head": [lists[k][1] for k in ("kind", "w", "sl", "bias", "n")],
            "walk": walk,
            "ctx": [prog[k] for k in ("w", "sl", "bias", "n", "kind")]
            + [self.hidden_norm.weight, float(self.hidden_norm.eps), prog["k_norm"]],
            "block": [
                block.flat[k]
                for k in ("w", "sl", "bias", "n", "kind", "norm", "eps", "qk_norm", "qk_eps")
            ],  # fmt: skip
            "heads": (hq, hkv, float(scale)),
            "norm": (self.norm.weight, float(self.norm.eps)),
        }

    @torch.no_grad()
    def draft_pass(
        self,
        features: torch.Tensor | None,  # [C, M, n_t*d] the adding sequences' new rows, or None
        ctx_len: list[int],  # valid new context rows of each sequence
        anchors: list[int],
        kv_caches: list[torch.Tensor],
        page_table: torch.Tensor,  # int [B, pages]: each sequence's pages (the new rows' too)
        past: list[int],  # rows each sequence had cached before the new ones
        rows: int,  # the first block rows wanted (the drafted ones)
        one_thread_update: bool,
        walk: tuple[int, list[int]] | None = None,  # (top_k, slots per sequence): greedy walk
    ) -> list[torch.Tensor]:
        """:meth:`context_update` of the new rows, :meth:`block_forward` of the block after
        them, :meth:`base_logits` and, with ``walk``, :meth:`greedy_path`, in one
        ``edgebuild_attn::draft_pass`` call (:attr:`pass_args` must be set): the same op
        calls on the same inputs, so the same cache bits and the same outputs
        (tests/test_draft_program.py). Returns ``[h, base]`` (fp32 ``[B, r, d]``, fp32
        ``[B, r, V or V']``, ``r = min(rows, block_size)``), then with ``walk``
        :meth:`greedy_path`'s ``cand, choice, confidence``. ``features`` holds the new rows of
        the C sequences with ``ctx_len[b] > 0``, in batch order, padded to the most rows M.
        Sequence b's new rows go to cache slots ``past[b] ..`` (their pages reserved in
        ``page_table``), its block sits at positions ``past[b] + ctx_len[b] ..``.
        ``one_thread_update``: the update on one thread
        (:data:`edgebuild.runtime.dspark_backend.ONE_THREAD_ROWS`); the walk always is (as
        :meth:`~edgebuild.runtime.dspark_backend.TorchDraft.propose` runs it).

        Raises:
            RuntimeError: a new row past ``page_table``'s pages or on a page outside the pool,
                a token id outside the embedding, shapes that do not fit (the op's checks name
                the sequence and row).
        """
        a = self.pass_args
        bs = self.config.block_size
        top = max(p + n for p, n in zip(past, ctx_len, strict=True)) + bs
        table = self.rope_table(top)
        if features is not None:
            self._check_features(features)
        hq, hkv, scale = a["heads"]
        if walk is not None and a["walk"] is None:
            raise ValueError("DSparkDraft.draft_pass: this draft's head has no greedy walk")
        k, counts = (0, None) if walk is None else (walk[0], torch.tensor(walk[1]))
        heads = a["walk"] or (None,) * 4 + (None, 0.0)
        return torch.ops.edgebuild_attn.draft_pass(
            features, ctx_len, *a["fc"], *a["ctx"], self.embed_tokens.weight, anchors,
            self.config.mask_token_id, bs, *a["block"], kv_caches, page_table.long(), past,
            table, hq, hkv, scale, rows, *a["norm"], one_thread_update, *a["head"], k, counts,
            self.token_map, *heads,
        )  # fmt: skip

    def _context_program(self) -> dict | None:
        """``edgebuild_attn::context_layers``' per-layer lists (each layer's packed k/v call and
        k norm; its attention's heads, scale and norm eps), when every layer shares those
        settings; else None (the modules' path)."""
        attns = [layer.self_attn for layer in self.layers]
        specs = {
            (a.context_spec.num_q_heads, a.context_spec.head_dim, a.context_spec.scale,
             a.context_spec.rms_norm_eps)
            for a in attns
        }  # fmt: skip
        if len(specs) != 1:
            return None
        prog = {k: [] for k in ("w", "sl", "bias", "n", "kind", "k_norm")}
        for a in attns:
            op, lead = a.packed_kv.kernel_call()
            add_linear_args(prog, op.default, lead)
            prog["k_norm"].append(a.k_norm.weight)
        ((hq, _, scale, eps),) = specs
        prog.update(hq=hq, scale=float(scale), eps=float(eps))
        return prog

    # ------------------------------------------------------------------ running
    def rope_table(self, max_position: int) -> torch.Tensor:
        """fp32 ``[>= max_position, head_dim]`` cos|sin table, grown on demand (power of 2)."""
        if self._rope_table.shape[0] < max_position:
            n = max(1024, 1 << (max_position - 1).bit_length())
            self._rope_table = rope_cos_sin_table(self.config.head_dim, n, self.config.rope)
        return self._rope_table

    def block_input_ids(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """``[anchor, mask x (B-1)]``: int ``[batch]`` -> int64 ``[batch, block_size]``."""
        cfg = self.config
        ids = torch.full((anchor_ids.shape[0], cfg.block_size), cfg.mask_token_id, dtype=torch.long)
        ids[:, 0] = anchor_ids.long()
        return ids

    def _check_caches(self, kv_caches: list[torch.Tensor]) -> None:
        if len(kv_caches) != len(self.layers):
            raise ValueError(
                f"DSparkDraft: got {len(kv_caches)} KV pools for {len(self.layers)} draft layers"
            )

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """``C = hidden_norm(fc(F))``: ``[B, M, n_t*d]`` -> ``[B, M, d]`` in the model dtype.

        fc takes the features in fp32 whatever the model dtype: target features can exceed
        2e4 (spec §2.7). Its weights are the checkpoint's, or packed as the draft's other
        linears where the kernel keeps fp32 inputs (an int4 draft: int4 weights, fp32
        inputs; :meth:`pack_for_cpu`).
        """
        return self.hidden_norm(self._fc(features)).to(self.fc.weight.dtype)

    def _check_features(self, features: torch.Tensor) -> None:
        """ValueError naming the expected width unless ``features`` is ``[..., n_t*d]``."""
        if features.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"DSparkDraft: features must be [B, M, n_t*d = {self.fc.in_features}] (taps "
                f"{list(self.config.target_layer_ids)} concatenated), got {tuple(features.shape)}"
            )

    def _fc(self, features: torch.Tensor) -> torch.Tensor:
        """``fc(F)`` fp32 ``[B, M, d]`` (:meth:`project_context` before ``hidden_norm``)."""
        self._check_features(features)
        if use_packed(self.packed_fc):
            return self.packed_fc(features.float())  # fp32 in, fp32 out (pack_for_cpu)
        return F.linear(features.float(), self.fc.weight.float())

    @torch.no_grad()
    def context_update(
        self,
        features: torch.Tensor,  # [B, M, n_t*d] target taps of the new context rows
        kv_caches: list[torch.Tensor],  # per draft layer [num_pages, 2, Hkv, page_size, D]
        batch: PagedBatch,  # past = rows already cached, input_lengths = valid M, positions
    ) -> None:
        """Append the K/V of new context rows to every layer's cache (spec §2.2, §2.6, §7).

        ``C = hidden_norm(fc(F))`` feeds every layer's k/v projections directly (no
        ``input_layernorm``); K is stored after ``k_norm`` and RoPE at ``batch.positions``
        (the rows' absolute positions), V as projected. Padding rows (``>= input_lengths``)
        are not written. The caller advances ``past_lengths`` by ``input_lengths`` afterwards.

        Raises:
            ValueError: wrong feature width or number of KV pools; any error of
                :func:`edgebuild.ops.attention.paged_attention`.
        """
        self._check_caches(kv_caches)
        table = self.rope_table(int(batch.positions.max()) + 1)
        if self.kv_norm_in_kernel and use_packed(self.layers[0].self_attn.packed_kv):
            # on edgebuild's fp32 / int4 kernels hidden_norm runs inside each layer's packed
            # k/v call (where it was ~6 torch ops)
            context, norm = self._fc(features), self.hidden_norm
            if self._context_in_one_call(context, kv_caches, batch, table):
                return
        else:
            context, norm = self.project_context(features), None
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            layer.self_attn.write_context(context, cache, batch, table, norm)

    def _context_in_one_call(
        self,
        context: torch.Tensor,  # fp32 [B, M, d] fc(F), hidden_norm not yet applied
        kv_caches: list[torch.Tensor],
        batch: PagedBatch,
        table: torch.Tensor,
    ) -> bool:
        """The layers' context writes as one ``edgebuild_attn::context_layers`` call, where the
        modules' path would run each layer's write as the C++ step (the same op calls with
        the same inputs, so the same cache bits; tests/test_draft_program.py); False where it
        would not (nothing done)."""
        from edgebuild.models import common
        from edgebuild.ops import attention_fast

        prog, spec = self.context_program, self.layers[0].self_attn.context_spec
        rows = context.shape[1]
        if (
            prog is None
            or not common.CPP_LAYERS
            or batch.flat_valid is not None
            or torch.compiler.is_exporting()
            or torch.compiler.is_compiling()
            or not all(  # attention()'s own routing of each layer's write
                attention_fast.kernel_route(
                    context,
                    c,
                    spec.head_dim,
                    rows,
                    spec.causal,
                    spec.write_kv,
                    batch.prefill,
                    False,
                )
                for c in kv_caches
            )
        ):
            return False
        plan = batch.kernel_plan(rows, kv_caches[0].shape[3], spec.causal, spec.write_kv)
        if plan.page_table is None:
            return False
        step = attention_fast.write_step_args(plan, batch.positions, table)
        norm = self.hidden_norm
        torch.ops.edgebuild_attn.context_layers(
            context, kv_caches, prog["w"], prog["sl"], prog["bias"], prog["n"], prog["kind"],
            norm.weight, float(norm.eps), prog["k_norm"], prog["eps"], *step, prog["hq"],
            prog["scale"],
        )  # fmt: skip
        return True

    @torch.no_grad()
    def block_forward(
        self,
        block_ids: torch.Tensor,  # int [B, Bs]: [anchor, mask x (Bs-1)]
        kv_caches: list[torch.Tensor],  # per draft layer, holding the context rows
        batch: PagedBatch,  # past = context rows, input_lengths = Bs, positions s..s+Bs-1
        rows: int | None = None,  # the first rows wanted (the drafted ones); None: all Bs
    ) -> torch.Tensor:
        """Run the block through the draft; returns ``h`` ``[B, rows or Bs, d]`` after
        ``norm``.

        Every block row sees all cached context rows and all block rows (non-causal); the
        block's K/V are not written (spec §2.4-§2.6). ``h`` feeds :meth:`base_logits`, the
        Markov head and the confidence head. The target's final norm is never used.
        ``rows``: only the first ``rows`` rows go through the last layer's o_proj and MLP
        and the norm (on the CPU kernels, :meth:`FusedLayers.run`'s ``last_rows``); they
        equal the whole block's first rows bit for bit (row-invariant kernels).

        Raises:
            ValueError: ``rows`` < 1; a wrong number of KV pools.
        """
        self._check_caches(kv_caches)
        if rows is not None and rows < 1:
            raise ValueError(f"DSparkDraft.block_forward: rows must be >= 1, got {rows}")
        x = self.embed_tokens(block_ids.long())
        table = self.rope_table(int(batch.positions.max()) + 1)
        program = self.block_program
        plan = None if program is None else program.plan_for(x, kv_caches, batch)
        keep = x.shape[1] if rows is None else rows
        if plan is not None:  # the layers below as one C++ call (pack_for_cpu)
            x = program.run(x, kv_caches, batch, table, plan, {}, set(), last_rows=keep)
            return self.norm(x)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cache, batch, table)
        return self.norm(x[:, :keep])

    @property
    def vocab_columns(self) -> int:
        """Columns of :meth:`base_logits`: the :attr:`token_map`'s tokens, else ``lm_head``'s
        rows."""
        return len(self.token_map) if self.token_map is not None else self.lm_head.out_features

    @torch.no_grad()
    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        """``lm_head(h)``: ``[B, Bs, d]`` -> fp32 ``[B, Bs, V]`` (before the Markov bias);
        with a :attr:`token_map` ``[V']``, fp32 ``[B, Bs, V']``: column j is token
        ``token_map[j]`` (the other rows of the head are not computed)."""
        head = self.packed_lm_head
        if use_packed(head):
            return head(h).float()
        if self.token_map is not None:  # export / compile: the rows gathered in the graph
            return F.linear(h, self.lm_head.weight[self.token_map]).float()
        return self.lm_head(h).float()

    @torch.no_grad()
    def lattice(
        self, h: torch.Tensor, base: torch.Tensor, anchors: torch.Tensor, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The top-k candidate lattice of a block (spec §3 "Top-k pruning").

        Args:
            h: ``[B, n, d]`` post-norm hidden of the block rows to draft.
            base: fp32 ``[B, n, V]`` their base logits (:meth:`base_logits`; ``[B, n, V']``
                over the :attr:`token_map`, whose ids the candidates are mapped to).
            anchors: int ``[B]`` the anchor token of each block.
            top_k: K candidates per row (1..V, or 1..V' over a :attr:`token_map`).

        Returns:
            ``cand`` int64 ``[B, n, K]``; ``scores`` fp32 ``[B, n, K(i), K(j)]`` =
            ``base[cand_l_j] + bias(prev = cand_{l-1, i}, h_l)[cand_l_j]`` (slot 0: prev = the
            anchor for every i); ``confidence`` fp32 ``[B, n, K(i)]`` or None without a
            confidence head. Walked by :func:`edgebuild.runtime.markov_walk.walk_lattice`.

        Raises:
            ConfigError: an ``rnn`` Markov head (its state depends on the path: no lattice).
        """
        if self.markov_head is not None and self.markov_head.head_type is MarkovHeadType.RNN:
            raise ConfigError(
                f"{self.config.source}: an rnn Markov head has no top-k lattice (its state "
                "depends on the path taken); walk it token by token"
            )
        top, cand = f32_linear.topk(base, top_k)  # [B, n, K], best first (ties: lower id)
        if self.token_map is not None:  # columns -> token ids (sorted: the same tie order)
            cand = self.token_map[cand]
        prev = torch.cat([anchors.long().view(-1, 1, 1).expand(-1, 1, top_k), cand[:, :-1]], 1)
        prev = prev[:, : cand.shape[1]]  # [B, n, K(i)]: the token before slot l
        scores = top.unsqueeze(2).expand(-1, -1, top_k, -1)  # [B, n, K(i), K(j)]
        if self.markov_head is not None:
            h_rows = h.unsqueeze(2).expand(-1, -1, top_k, -1)  # [B, n, K(i), d]
            u, _ = self.markov_head.latent(prev, h_rows, None)  # [B, n, K(i), r]
            w2 = self.markov_head.markov_w2.weight[cand].float()  # [B, n, K(j), r]
            scores = scores + torch.matmul(u, w2.transpose(-1, -2))
        conf = None
        if self.confidence_head is not None:
            if self.config.confidence_head_with_markov:
                conf = self.confidence(h.unsqueeze(2), prev)  # [B, n, K(i)]: h broadcast
            else:
                conf = self.confidence(h, prev[..., 0]).unsqueeze(-1).expand(-1, -1, top_k)
        return cand, scores.contiguous(), conf

    @torch.no_grad()
    def greedy_path(
        self,
        h: torch.Tensor,
        base: torch.Tensor,
        anchors: torch.Tensor,
        counts: list[int],
        top_k: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The greedy walk of the top-k lattice (:meth:`lattice` then the argmax path of
        :func:`edgebuild.runtime.markov_walk.walk_lattice`) as one C++ call that scores only
        the path taken (:func:`edgebuild.ops.f32_linear.markov_greedy`); None where it does
        not run (no kernel, an rnn head, export / compile), and the caller walks the lattice.

        Args: ``h`` ``[B, n, d]``, ``base`` fp32 ``[B, n, V]`` (or ``[B, n, V']`` over the
        :attr:`token_map`), ``anchors`` int ``[B]`` and ``top_k`` as :meth:`lattice`;
        ``counts`` the slots to walk per request (each <= n).

        Returns:
            ``(cand int64 [B, n, K], choice int64 [B, n], confidence fp32 [B, n])``: slot s of
            request b drafts ``cand[b, s, choice[b, s]]``; the confidence is the lattice's at
            the path's previous token (ones without a confidence head). The choices equal the
            lattice walk's except where two scores tie within the lattice's fp32 rounding
            (here they are computed in double).
        """
        args = self.walk_args if self.walk_args is not None else self._walk_args()
        if args is None or torch.compiler.is_exporting() or torch.compiler.is_compiling():
            return None
        w1, w2, gate, conf = args
        return f32_linear.markov_greedy(
            base, anchors, torch.tensor(counts), top_k, self.token_map, w1, w2, gate, h, conf
        )

    def _walk_args(self) -> tuple | None:
        """:func:`edgebuild.ops.f32_linear.markov_greedy`'s head arguments (``w1``, ``w2``,
        ``gate``, ``conf``, detached), or None for an rnn head (no such walk)."""
        head, w1, w2, gate, conf = self.markov_head, None, None, None, None
        if head is not None:
            if head.head_type is MarkovHeadType.RNN:
                return None
            w1, w2 = head.markov_w1.weight.detach(), head.markov_w2.weight.detach()
            if head.head_type is MarkovHeadType.GATED:
                p = head.gate_proj
                gate = (p.weight.detach().float().contiguous(), p.bias.detach().float())
        if self.confidence_head is not None:
            p = self.confidence_head.proj
            conf = (p.weight.detach()[0].float().contiguous(), float(p.bias.detach()[0]))
        return w1, w2, gate, conf

    @torch.no_grad()
    def confidence(self, h_k: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """Acceptance probability of row k (spec §1.4): fp32 ``[B]`` in (0, 1).

        ``sigmoid(proj([h_k; W1[prev_k]]))`` with the Markov input, ``sigmoid(proj(h_k))``
        without. ``h_k`` ``[B, d]`` post-norm hidden; ``prev_ids`` int ``[B]`` as for the
        Markov head (anchor for row 0). Their leading dims broadcast: the lattice passes
        ``h`` ``[B, n, 1, d]`` with ``prev`` ``[B, n, K]`` and gets ``[B, n, K]``. The sum over
        ``[h; W1[prev]]`` runs as its two parts added (within fp32 rounding of one dot).

        Raises:
            ConfigError: the draft has no confidence head.
            ValueError: ``h_k`` is not ``[..., d]`` or (with the Markov input) its leading
                dims do not broadcast to ``prev_ids``' shape.
        """
        cfg = self.config
        if self.confidence_head is None:
            raise ConfigError(
                f"{cfg.source}: this draft has no confidence head "
                f"('{cfg.where('enable_confidence_head')}' is false)"
            )
        x = h_k.float()
        p = self.confidence_head.proj
        markov = cfg.confidence_head_with_markov
        d = p.in_features - (self.markov_head.rank if markov else 0)
        lead = tuple(x.shape[:-1])
        if (
            x.dim() == 0
            or x.shape[-1] != d
            or (markov and torch.broadcast_shapes(lead, prev_ids.shape) != prev_ids.shape)
        ):
            raise ValueError(
                f"DSparkDraft.confidence: h must be [..., {d}] whose leading dims broadcast to "
                f"prev's {tuple(prev_ids.shape)}, got {tuple(x.shape)}"
            )
        w = p.weight.float()[0]
        # proj([h; W1[prev]]) as h . w[:d] + W1[prev] . w[d:]: h may broadcast against prev
        # (the lattice's [B, n, 1, d] against [B, n, K]), so h's term is computed once a row,
        # not once a candidate (a [B, n, K, d + r] concatenation took ~0.1 ms a proposal)
        z = torch.matmul(x, w[:d])
        if markov:
            z = z + torch.matmul(self.markov_head.prev_embedding(prev_ids), w[d:])
        return torch.sigmoid(z + p.bias.float()[0])

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_source(
        cls,
        source: WeightSource,
        target_config: ModelConfig,
        lm_head: torch.Tensor | QuantizedWeight,
        embed_tokens: torch.Tensor | QuantizedWeight,
        dtype: torch.dtype = torch.float32,
        *,
        lm_head_origin: str = "the resolved lm_head",
        embed_origin: str = "the resolved embed_tokens",
    ) -> DSparkDraft:
        """Build the draft from its checkpoint plus the resolved head and embedding.

        ``lm_head`` / ``embed_tokens`` ``[V, d]`` come from ``PairedSources`` (the draft's own
        or the target's; NVFP4 / FP8 dequantized to ``dtype`` here). The draft's own
        ``lm_head.*`` / ``embed_tokens.*`` tensors, if shipped, are ignored. Names are mapped
        by :func:`canonical_name`; geometry comes from tensor shapes where configs inherit
        target fields (:meth:`DSparkConfig.with_tensor_geometry`). ``*_origin`` name the
        resolved tensors in messages (e.g. ``"<file>: lm_head.weight"``).

        Raises:
            ConfigError / PairingError: from :meth:`DSparkConfig.from_dict` / ``validate``
                (fc width included).
            CheckpointError: missing, unexpected, mis-shaped or non-float tensors, or two
                names that map to the same parameter; messages name the file and tensor.
            PairingError: ``lm_head`` / ``embed_tokens`` whose shape does not fit the draft.
        """
        cfg, names = checked_config(
            source,
            target_config,
            (tuple(lm_head.shape), lm_head_origin),
            (tuple(embed_tokens.shape), embed_origin),
        )
        return cls._load_weights(source, cfg, names, lm_head, embed_tokens, dtype)

    @classmethod
    def from_plan(cls, plan: DraftPlan, dtype: torch.dtype = torch.float32) -> DSparkDraft:
        """Build the draft of a validated :class:`~edgebuild.checkpoint.draft.DraftPlan`.

        The plan's config, tensor names and resolved head / embedding are used as they are:
        :func:`~edgebuild.checkpoint.draft.pair_draft` ran every check of :meth:`from_source`.

        Raises:
            CheckpointError: a tensor that cannot be read.
        """
        return cls._load_weights(
            plan.draft, plan.config, plan.names, plan.lm_head.value, plan.embed_tokens.value, dtype
        )

    @classmethod
    def _load_weights(cls, source, cfg, names, lm_head, embed_tokens, dtype) -> DSparkDraft:
        """The model of a checked ``cfg`` with its parameters read from ``source``."""
        expected = expected_shapes(cfg)
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to_empty(device="cpu").to(dtype)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for canon in expected:
                params[canon].copy_(_load(source, names[canon], canon, dtype))
            params["lm_head.weight"].copy_(dense(lm_head, dtype))
            params["embed_tokens.weight"].copy_(dense(embed_tokens, dtype))
        model._rope_table = torch.empty(0, 0)
        model.eval()
        return model


def _load(source: WeightSource, name: str, canon: str, dtype: torch.dtype) -> torch.Tensor:
    """One parameter as a dense ``dtype`` tensor (quantized linears dequantized)."""
    prefix, _, leaf = name.rpartition(".")
    is_linear = leaf == "weight" and source.info(name).dtype in (torch.uint8, torch.float8_e4m3fn)
    if is_linear and canon != "markov_head.markov_w1.weight":
        return dense(source.linear(prefix), dtype)
    return source.get(name).to(dtype)
