"""The exported graphs, one ``nn.Module`` per engine role: their inputs, outputs and forward.

Each role's engine inputs and outputs are declared once, in its ``io()`` method (names,
dtypes, dims with symbolic axis names); example inputs for tracing and the dynamic shapes
for ``torch.export`` are derived from it. The modules reuse the models' own submodules
(``LlamaDecoderLayer``, ``DSparkDecoderLayer``, heads), so parameter names are the checkpoint
names and the math is the models'. Only the outer loops are restated here, because the
models' ``forward`` grows its RoPE table from ``int(positions.max())`` (a data-dependent
value ``torch.export`` cannot trace); the graphs take a fixed fp32 table buffer instead.

Graph kinds (:class:`GraphKind`):
* ``plugin``: the paged KV cache of the attention contract, ``page_table`` input, a fixed
  ``page_size``; attention becomes ``EdgebuildAttention`` plugin nodes.
* ``portable``: one dense cache row per sequence ``[B, 2, Hkv, T, D]`` (see
  :mod:`edgebuild.export.portable`), no ``page_table``; standard ONNX ops only.

Roles:
* :class:`BaseGraph` (``base``): the target. Logits of the requested rows only
  (``logits_rows``), the tapped hidden states the draft needs, KV caches in/out. The base
  graph of a vision-language target (``multimodal``) also takes the image embeddings, in the
  prompt-table style of TensorRT-LLM: an image pad row carries the id ``vocab_size + k`` and
  gets row ``k`` of the ``image_embeds`` input (the gather stays inside the engine; text-only
  calls pass a 1-row table that no id selects), and its RoPE positions are the 3-axis
  ``mrope_positions`` (t, h, w) instead of ``positions``. A text target's graph is unchanged.
* :class:`DraftGraph` (``draft``): DSpark context update + block pass + heads, returning the
  top-k candidate lattice of spec section 3 ("Top-k pruning", the onnxruntime-genai form):
  ``draft_candidate_ids`` [B, n, K], ``draft_scores`` [B, n, K, K] with
  ``scores[b, l, i, j] = base[b, l, cand_l_j] + bias(prev = cand_{l-1, i}, h_l)[cand_l_j]``
  (slot 0: prev = the anchor for every ``i``) and ``draft_confidence`` [B, n, K] (the
  acceptance probability of slot l when the previous token is ``cand_{l-1, i}``). The runtime
  walks the chain (greedy: ``j_0 = argmax scores[0, 0]``, ``j_l = argmax scores[l, j_{l-1}]``)
  without any vocabulary-sized tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor, nn

from edgebuild.errors import ConfigError
from edgebuild.export.plugin import FunctionalAttention
from edgebuild.models.common import PagedBatch
from edgebuild.models.dspark import DSparkDraft, MarkovHeadType
from edgebuild.models.llama import LlamaForCausalLM

ROPE_BUFFER = "rope_cos_sin"

# Sizes used for the example inputs of tracing. Dynamic axes must not be 0 or 1 there
# (torch.export specializes those values), and distinct axes get distinct sizes.
_EXAMPLE_SIZES = {
    "batch": 2,
    "seq": 3,
    "logits_rows": 2,
    "max_pages": 3,
    "num_pages": 7,
    "kv_capacity": 11,
    "context_len": 5,
    "image_tokens": 4,
}


class GraphKind(str, Enum):
    """How attention is exported: the TensorRT plugin node or standard ONNX ops."""

    PLUGIN = "plugin"
    PORTABLE = "portable"


@dataclass(frozen=True)
class TensorSpec:
    """One engine input or output: name, torch dtype and dims (int = static, str = axis)."""

    name: str
    dtype: torch.dtype
    dims: tuple[int | str, ...]

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": str(self.dtype).split(".")[-1], "dims": list(self.dims)}


def _example(spec: TensorSpec) -> Tensor:
    shape = [d if isinstance(d, int) else _EXAMPLE_SIZES[d] for d in spec.dims]
    return torch.zeros(shape, dtype=spec.dtype, device="meta")


def _cache_dims(kind: GraphKind, kv_heads: int, head_dim: int, page_size: int) -> tuple:
    if kind is GraphKind.PORTABLE:
        return ("batch", 2, kv_heads, "kv_capacity", head_dim)
    return ("num_pages", 2, kv_heads, page_size, head_dim)


class _RoleGraph(nn.Module):
    """Shared plumbing: I/O specs, example inputs, dynamic shapes, the paging inputs."""

    role = ""

    def io(self) -> tuple[list[TensorSpec], list[TensorSpec]]:
        raise NotImplementedError

    def input_names(self) -> list[str]:
        return [s.name for s in self.io()[0]]

    def output_names(self) -> list[str]:
        return [s.name for s in self.io()[1]]

    def example_inputs(self) -> tuple[Tensor, ...]:
        """Meta tensors shaped like the inputs (for ``torch.export``)."""
        return tuple(_example(s) for s in self.io()[0])

    def dynamic_shapes(self) -> tuple[tuple[dict, ...]]:
        """``torch.export`` dynamic shapes: one ``Dim`` per named axis, shared by name.

        ``forward(*flat)`` takes the inputs as one varargs tuple, hence the outer 1-tuple.
        """
        dims: dict[str, torch.export.Dim] = {}
        out = []
        for spec in self.io()[0]:
            entry = {}
            for i, d in enumerate(spec.dims):
                if isinstance(d, str):
                    entry[i] = dims.setdefault(d, torch.export.Dim(d, min=1))
            out.append(entry)
        return (tuple(out),)

    def _page_table(self, named: dict[str, Tensor], batch_size) -> Tensor:
        """The plugin graphs' page table input, or one page per sequence (portable)."""
        if self.kind is GraphKind.PLUGIN:
            return named["page_table"]
        return torch.arange(batch_size, dtype=torch.int32).unsqueeze(1)


class BaseGraph(_RoleGraph):
    """The target LLM as the ``base`` engine.

    Args:
        model: a :class:`LlamaForCausalLM` (meta for export, real weights for checks).
        tap_layers: target layers whose outputs feed the draft (empty: no taps output).
        kind: plugin or portable graph.
        page_size: rows per KV page (plugin graphs).
        rope_rows: rows of the RoPE table buffer (positions ``0 .. rope_rows-1``).
        multimodal: the graph of a vision-language target: ``image_embeds`` and
            ``mrope_positions`` inputs (see :meth:`io`).

    Raises:
        ConfigError: a tap layer out of range; ``multimodal`` for a target without
            multimodal RoPE (``mrope_section``).
    """

    role = "base"

    def __init__(
        self,
        model: LlamaForCausalLM,
        tap_layers: tuple[int, ...],
        kind: GraphKind,
        page_size: int,
        rope_rows: int,
        multimodal: bool = False,
    ):
        super().__init__()
        cfg = model.config
        self.config, self.kind, self.page_size = cfg, GraphKind(kind), page_size
        self.tap_layers = tuple(tap_layers)
        self.multimodal = bool(multimodal)
        if self.multimodal and cfg.mrope_section is None:
            raise ConfigError(
                f"{cfg.source}: a multimodal base graph needs a multimodal-RoPE target "
                "(rope_parameters.mrope_section); this config has 1-D RoPE"
            )
        bad = [t for t in self.tap_layers if not 0 <= t < cfg.num_hidden_layers - 1]
        if bad:
            raise ConfigError(
                f"tap layers {list(self.tap_layers)}: {bad} outside 0..{cfg.num_hidden_layers - 2} "
                f"for the {cfg.num_hidden_layers}-layer target ({cfg.source})"
            )
        self.model, self.lm_head = model.model, model.lm_head
        self.rotary_dim = int(cfg.head_dim * cfg.rope.partial_rotary_factor)
        device = next(model.parameters()).device
        self.register_buffer(
            ROPE_BUFFER, torch.zeros(rope_rows, self.rotary_dim, device=device), persistent=True
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def io(self) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """Engine inputs and outputs of ``base`` (names, dtypes, dims).

        Inputs: ``input_ids`` int32 [B, S]; ``positions`` int32 [B, S] (RoPE position of each
        row); ``past_lengths`` / ``input_lengths`` int32 [B]; ``logits_rows`` int32 [B, R];
        ``page_table`` int32 [B, max_pages] (plugin graphs); ``kv_cache_i`` per layer.
        A ``multimodal`` graph has, instead of ``positions``: ``image_embeds`` [image_tokens,
        hidden] (graph dtype; row k replaces the embedding of a row whose id is
        ``vocab_size + k``; ids past the table read its last row) and ``mrope_positions``
        int32 [3, B, S] (t, h, w positions; text rows have three equal values).
        Outputs: ``logits`` fp32 [B, R, V], ``target_hidden_states`` [B, S, n_taps * hidden]
        (with taps), ``present_kv_cache_i`` (aliasing ``kv_cache_i``).
        """
        cfg, i32 = self.config, torch.int32
        inputs = [TensorSpec("input_ids", i32, ("batch", "seq"))]
        if self.multimodal:
            inputs += [
                TensorSpec("image_embeds", self.dtype, ("image_tokens", cfg.hidden_size)),
                TensorSpec("mrope_positions", i32, (3, "batch", "seq")),
            ]
        else:
            inputs.append(TensorSpec("positions", i32, ("batch", "seq")))
        inputs += [
            TensorSpec("past_lengths", i32, ("batch",)),
            TensorSpec("input_lengths", i32, ("batch",)),
            TensorSpec("logits_rows", i32, ("batch", "logits_rows")),
        ]
        if self.kind is GraphKind.PLUGIN:
            inputs.append(TensorSpec("page_table", i32, ("batch", "max_pages")))
        cache = _cache_dims(self.kind, cfg.num_key_value_heads, cfg.head_dim, self.page_size)
        layers = range(cfg.num_hidden_layers)
        inputs += [TensorSpec(f"kv_cache_{i}", self.dtype, cache) for i in layers]
        outputs = [TensorSpec("logits", torch.float32, ("batch", "logits_rows", cfg.vocab_size))]
        if self.tap_layers:
            width = len(self.tap_layers) * cfg.hidden_size
            outputs.append(TensorSpec("target_hidden_states", self.dtype, ("batch", "seq", width)))
        outputs += [TensorSpec(f"present_kv_cache_{i}", self.dtype, cache) for i in layers]
        return inputs, outputs

    def forward(self, *flat: Tensor) -> tuple[Tensor, ...]:
        """Inputs and outputs in :meth:`io` order (see the module docstring)."""
        named = dict(zip(self.input_names(), flat, strict=True))
        ids = named["input_ids"]
        caches = [named[f"kv_cache_{i}"] for i in range(self.config.num_hidden_layers)]
        positions, table = self._rope(named)
        batch = PagedBatch(
            self._page_table(named, ids.shape[0]),
            named["past_lengths"],
            named["input_lengths"],
            positions,
        )
        with FunctionalAttention(self.kind is GraphKind.PORTABLE) as attention:
            x = self._embed(named)  # [B, S, d]
            taps = {}
            for i, layer in enumerate(self.model.layers):
                x = layer(x, caches[i], batch, table)
                if i in self.tap_layers:
                    taps[i] = x
            rows = named["logits_rows"].long().unsqueeze(-1).expand(-1, -1, x.shape[-1])
            logits = self.lm_head(self.model.norm(torch.gather(x, 1, rows))).float()  # [B, R, V]
        out = [logits]
        if self.tap_layers:
            out.append(torch.cat([taps[i] for i in self.tap_layers], dim=-1))
        return tuple(out + [attention.present(c) for c in caches])

    def _embed(self, named: dict[str, Tensor]) -> Tensor:
        """Token embeddings [B, S, d]; image rows (id >= vocab) from ``image_embeds``."""
        ids = named["input_ids"]  # int32 [B, S]
        if not self.multimodal:
            return self.model.embed_tokens(ids)
        table = named["image_embeds"]  # [N, d]
        vocab = self.config.vocab_size
        is_image = ids >= vocab  # [B, S]
        text = self.model.embed_tokens(torch.where(is_image, torch.zeros_like(ids), ids))
        k = torch.clamp(ids - vocab, 0, table.shape[0] - 1).long()  # [B, S] table row
        image = torch.nn.functional.embedding(k, table)  # [B, S, d]
        return torch.where(is_image.unsqueeze(-1), image.to(text.dtype), text)

    def _rope(self, named: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """(positions int32 [B, S], fp32 cos/sin table) for the attention.

        Text graphs: the ``positions`` input and the table buffer. Multimodal graphs: one
        table row per new row, gathered from the buffer (frequency j of a row at its axis'
        position, the ``mrope_section`` split of :mod:`edgebuild.ops.mrope`), and the row
        index as position (what :meth:`LlamaForCausalLM._mrope_rows` does in torch).
        """
        table = getattr(self, ROPE_BUFFER)  # fp32 [rope_rows, rotary_dim]
        if not self.multimodal:
            return named["positions"], table
        pos = named["mrope_positions"]  # int32 [3, B, S]
        bsz, rows = pos.shape[1], pos.shape[2]
        half = torch.cat(
            [
                pos[a].unsqueeze(-1).expand(-1, -1, w)
                for a, w in enumerate(self.config.mrope_section)
            ],
            dim=-1,
        )  # [B, S, rotary_dim / 2]: the position each frequency rotates with
        index = torch.cat([half, half], dim=-1).reshape(bsz * rows, self.rotary_dim).long()
        per_row = torch.gather(table, 0, index)  # [B * S, rotary_dim]
        row_ids = torch.arange(bsz * rows, dtype=torch.int32, device=pos.device)
        return row_ids.reshape(bsz, rows), per_row


class DraftGraph(_RoleGraph):
    """The DSpark draft as the ``draft`` engine: context update, block pass, top-k lattice.

    Args:
        model: a :class:`DSparkDraft` (meta for export, real weights for checks).
        kind: plugin or portable graph.
        page_size: rows per KV page (plugin graphs).
        rope_rows: rows of the RoPE table buffer.
        top_k: candidates per block row, K (clamped to the vocabulary).

    Raises:
        ConfigError: an ``rnn`` Markov head (its state depends on the path taken, so it has
            no per-slot K x K lattice; the torch runtime runs it).

    A sliding-window draft's block attention carries its window (the plugin's
    ``sliding_window`` attribute, the portable mask): slot-based, so a runtime that keeps a
    ring passes its rotated page table (:mod:`edgebuild.runtime.dspark_backend`).
    """

    role = "draft"

    def __init__(
        self, model: DSparkDraft, kind: GraphKind, page_size: int, rope_rows: int, top_k: int
    ):
        super().__init__()
        cfg = model.config
        if cfg.head_type is MarkovHeadType.RNN:
            raise ConfigError(
                f"{cfg.source}: field '{cfg.where('markov_head_type')}' = 'rnn' cannot be "
                "exported as a top-k lattice (its state depends on the path taken); supported "
                "for engines: vanilla, gated. Run this draft with the torch backend."
            )
        if top_k < 1:
            raise ConfigError(f"draft top_k must be >= 1 for the exported lattice, got {top_k}")
        self.config, self.kind, self.page_size = cfg, GraphKind(kind), page_size
        self.top_k = min(top_k, cfg.vocab_size)
        object.__setattr__(self, "_draft", model)  # methods only; children registered below
        for name, child in model.named_children():
            if child is not None:
                self.add_module(name, child)
        device = next(model.parameters()).device
        self.register_buffer(
            ROPE_BUFFER, torch.zeros(rope_rows, cfg.head_dim, device=device), persistent=True
        )

    @property
    def dtype(self) -> torch.dtype:
        return self._draft.fc.weight.dtype

    def io(self) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """Engine inputs and outputs of ``draft`` (names, dtypes, dims)."""
        cfg, i32, f32 = self.config, torch.int32, torch.float32
        n, k = cfg.block_size, self.top_k
        inputs = [
            TensorSpec(
                "context_features", self.dtype, ("batch", "context_len", cfg.fc_in_features)
            ),
            TensorSpec("context_positions", i32, ("batch", "context_len")),
            TensorSpec("context_lengths", i32, ("batch",)),
            TensorSpec("past_lengths", i32, ("batch",)),
            TensorSpec("anchor_ids", i32, ("batch",)),
            TensorSpec("block_positions", i32, ("batch", n)),
        ]
        if self.kind is GraphKind.PLUGIN:
            inputs.append(TensorSpec("page_table", i32, ("batch", "max_pages")))
        cache = _cache_dims(self.kind, cfg.num_key_value_heads, cfg.head_dim, self.page_size)
        layers = range(cfg.num_hidden_layers)
        inputs += [TensorSpec(f"kv_cache_{i}", self.dtype, cache) for i in layers]
        outputs = [
            TensorSpec("draft_candidate_ids", i32, ("batch", n, k)),
            TensorSpec("draft_scores", f32, ("batch", n, k, k)),
        ]
        if cfg.enable_confidence_head:
            outputs.append(TensorSpec("draft_confidence", f32, ("batch", n, k)))
        outputs += [TensorSpec(f"present_kv_cache_{i}", self.dtype, cache) for i in layers]
        return inputs, outputs

    def forward(self, *flat: Tensor) -> tuple[Tensor, ...]:
        """Inputs and outputs in :meth:`io` order (see the module docstring)."""
        named = dict(zip(self.input_names(), flat, strict=True))
        draft, cfg = self._draft, self.config
        caches = [named[f"kv_cache_{i}"] for i in range(cfg.num_hidden_layers)]
        anchors = named["anchor_ids"]
        page_table = self._page_table(named, anchors.shape[0])
        table = getattr(self, ROPE_BUFFER)
        past, ctx_len = named["past_lengths"], named["context_lengths"]
        n = cfg.block_size
        with FunctionalAttention(self.kind is GraphKind.PORTABLE) as attention:
            # 1. context update: K/V of the new target features at their absolute positions
            ctx = PagedBatch(page_table, past, ctx_len, named["context_positions"])
            context = draft.project_context(named["context_features"])  # [B, M, d]
            for layer, cache in zip(self.layers, caches, strict=True):
                layer.self_attn.write_context(context, cache, ctx, table)
            # 2. block pass over [anchor, mask x (n-1)]: non-causal, reads the updated caches
            block_len = torch.full_like(past, n)
            block = PagedBatch(page_table, past + ctx_len, block_len, named["block_positions"])
            masks = torch.full_like(anchors, cfg.mask_token_id).unsqueeze(1).expand(-1, n - 1)
            x = self.embed_tokens(torch.cat([anchors.unsqueeze(1), masks], dim=1))  # [B, n, d]
            for layer, cache in zip(self.layers, caches, strict=True):
                x = layer(x, cache, block, table)
            h = self.norm(x)  # [B, n, d]
        return (*self._lattice(draft, h, anchors), *[attention.present(c) for c in caches])

    def _lattice(self, draft: DSparkDraft, h: Tensor, anchors: Tensor) -> tuple[Tensor, ...]:
        """Top-k candidates, K x K Markov scores and confidences per slot (module docstring)."""
        base = self.lm_head(h).float()  # [B, n, V]
        top, cand = base.topk(self.top_k, dim=-1)  # [B, n, K]
        # [B, n, K(i)]: the token before slot l: the anchor for l = 0, candidate i of slot l-1
        prev = torch.cat(
            [anchors.long().unsqueeze(1).expand(-1, self.top_k).unsqueeze(1), cand[:, :-1]], 1
        )
        h_rows = h.unsqueeze(2).expand(-1, -1, self.top_k, -1)  # [B, n, K(i), d]
        scores = top.unsqueeze(2).expand(-1, -1, self.top_k, -1)  # [B, n, K(i), K(j)]
        if draft.markov_head is not None:
            u, _ = draft.markov_head.latent(prev, h_rows, None)  # [B, n, K(i), r]
            w2 = draft.markov_head.markov_w2.weight[cand].float()  # [B, n, K(j), r]
            scores = scores + torch.matmul(u, w2.transpose(-1, -2))
        out = [cand.to(torch.int32), scores.contiguous()]
        if draft.confidence_head is not None:
            if self.config.confidence_head_with_markov:
                conf = draft.confidence(h_rows, prev)  # [B, n, K(i)]
            else:
                conf = draft.confidence(h, prev[..., 0]).unsqueeze(-1).expand(-1, -1, self.top_k)
            out.append(conf.contiguous())
        return tuple(out)
