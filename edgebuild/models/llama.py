"""One decoder for Llama, Qwen2 (q/k/v bias) and Qwen3 (per-head q_norm/k_norm) targets.

Parameter names are the HF checkpoint names (`model.layers.{i}.self_attn.q_proj.weight`, ...).
Attention follows the paged contract of :mod:`edgebuild.ops.attention` (via
:func:`edgebuild.models.common.attention`: the custom op under export, a vectorized path eagerly; RoPE fused, GQA, sliding window), so the same module runs eagerly on the CPU and exports to
the attention plugin node. The model can return the hidden states of chosen layers: the output
of layer l equals transformers' `hidden_states[l + 1]` (pre final norm), which is what DSpark /
DFlash / EAGLE-3 drafts consume (spec/draft-checkpoint-formats.md section 1.5).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from edgebuild.checkpoint.config import ModelConfig
from edgebuild.checkpoint.quant import QuantizedWeight, quant_tensor_suffixes
from edgebuild.checkpoint.source import WeightSource
from edgebuild.errors import CheckpointError
from edgebuild.models.common import (
    FusedLayers,
    GatedMLP,
    PagedBatch,
    PreNormDecoderLayer,
    RMSNorm,
    attention,
    check_shape,
    dense,
    layer_linear_shapes,
)
from edgebuild.models.vision import VISION_PREFIX
from edgebuild.ops.attention import AttentionSpec
from edgebuild.ops.linear import PackedLinear, use_packed
from edgebuild.ops.mrope import mrope_cos_sin_rows
from edgebuild.ops.rope import rope_cos_sin_table
from edgebuild.ops.threads import converted

log = logging.getLogger("edgebuild.models")


class LlamaAttention(nn.Module):
    """Self-attention of one decoder layer over the paged KV cache."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        hq, hkv, hd, d = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.hidden_size,
        )
        self.q_proj = nn.Linear(d, hq * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, hkv * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, hkv * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(hq * hd, d, bias=cfg.attention_bias and cfg.family.value == "llama")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.window = cfg.window_for_layer(layer_idx)
        self.rotary_dim = int(hd * cfg.rope.partial_rotary_factor)
        self.spec = AttentionSpec(  # causal self-attention that writes its rows' K/V
            num_q_heads=hq,
            num_kv_heads=hkv,
            head_dim=hd,
            causal=True,
            write_kv=True,
            scale=hd**-0.5,
            sliding_window=self.window,
            rms_norm_eps=cfg.rms_norm_eps,
        )
        self.packed_qkv: PackedLinear | None = None  # set by LlamaForCausalLM.pack_for_cpu
        self.packed_o: PackedLinear | None = None

    def forward(
        self,
        x: torch.Tensor,  # [B, S, d]
        kv_cache: torch.Tensor,  # [num_pages, 2, Hkv, page_size, D], updated in place
        batch: PagedBatch,
        rope_table: torch.Tensor,  # fp32 [max_position, rotary_dim]
        norm: nn.Module | None = None,  # applied to x first (the layer's input_layernorm)
        residual: torch.Tensor | None = None,  # [B, S, d] added to the output
    ) -> torch.Tensor:  # [B, S, d]
        cfg = self.cfg
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
            self.q_norm.weight if cfg.qk_norm else None,
            self.k_norm.weight if cfg.qk_norm else None,
            self.spec,
        )
        if use_packed(self.packed_o):
            return self.packed_o(out, residual=residual)
        y = self.o_proj(out)
        return y if residual is None else residual + y

    def pack_for_cpu(self, quant: str | None = None) -> None:
        """Fuse q/k/v and pack q/k/v and o_proj for eager CPU inference (ops/linear.py)."""
        self.packed_qkv = PackedLinear([self.q_proj, self.k_proj, self.v_proj], quant)
        self.packed_o = PackedLinear([self.o_proj], quant)


class LlamaMLP(GatedMLP):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)) (biases as ``mlp_bias``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)


class LlamaDecoderLayer(PreNormDecoderLayer):
    """Pre-norm decoder layer (HF `LlamaDecoderLayer` names): causal self-attention + MLP."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(
            LlamaAttention(cfg, layer_idx), LlamaMLP(cfg), cfg.hidden_size, cfg.rms_norm_eps
        )


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF prefix `model.`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """A decoder LLM target: `model.*` + `lm_head`, run over a paged KV cache.

    `forward` returns logits for the requested rows only and, when `tap_layers` is given, the
    concatenated hidden states of those layers (layer output, pre final norm).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._rope_table = torch.empty(0, 0)
        self.packed_lm_head: PackedLinear | None = None  # set by pack_for_cpu
        self.fused_layers: FusedLayers | None = None  # set by pack_for_cpu where it can run

    def pack_for_cpu(self, quant: str | None = None) -> LlamaForCausalLM:
        """Pack every linear once for the eager CPU runtime (fused q/k/v and gate/up).

        The modules and ``state_dict`` keep the checkpoint's names and tensors; the packed
        copies (ops/linear.py) are used by eager forwards only, never under export. Costs one
        extra copy of the linear weights in memory. ``quant="int8"`` / ``"int4"``: weight-only
        (:class:`edgebuild.ops.linear.PackedLinear`), opt-in. Returns self.
        """
        for layer in self.model.layers:
            layer.pack_for_cpu(quant)
        self.packed_lm_head = PackedLinear([self.lm_head], quant)
        self.fused_layers = FusedLayers.build(self.model.layers)
        return self

    # ------------------------------------------------------------------ running
    def rope_table(self, max_position: int) -> torch.Tensor:
        """fp32 [>= max_position, rotary_dim] cos|sin table, grown on demand (power of 2)."""
        if self._rope_table.shape[0] < max_position:
            n = max(1024, 1 << (max_position - 1).bit_length())
            cfg = self.config
            rotary_dim = int(cfg.head_dim * cfg.rope.partial_rotary_factor)
            self._rope_table = rope_cos_sin_table(rotary_dim, n, cfg.rope)
        return self._rope_table

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids int [B, S] -> embeddings [B, S, d] in the model dtype."""
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        kv_caches: list[torch.Tensor],  # per layer [num_pages, 2, Hkv, page_size, D]
        batch: PagedBatch,
        input_ids: torch.Tensor | None = None,  # int [B, S]
        inputs_embeds: torch.Tensor | None = None,  # [B, S, d] (multimodal prefill)
        logits_rows: torch.Tensor | None = None,  # int64 [B, R] row indices into S; None = all
        tap_layers: tuple[int, ...] = (),
        mrope_positions: torch.Tensor | None = None,  # int [3, B, S] (t, h, w); mrope models
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run new rows through the decoder, appending their K/V to the cache.

        RoPE positions are `batch.positions` (1-D; for a multimodal-RoPE model that is the
        text case, t = h = w), or `mrope_positions` for a multimodal prefill: then the 3-axis
        cos/sin rows are built here and the attention reads them as a per-row table
        (positions = row index b * S + i; see :mod:`edgebuild.ops.mrope`).

        Returns:
            logits: fp32 [B, R, vocab] (R = S when `logits_rows` is None).
            taps: [B, S, len(tap_layers) * d] concatenated layer outputs, or None.
        """
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if mrope_positions is not None:
            batch, table = self._mrope_rows(batch, mrope_positions)
        else:
            table = self.rope_table(int(batch.positions.max()) + 1)
        valid = None
        if mrope_positions is None and not torch.compiler.is_exporting():
            valid = batch.packed_rows()  # unequal short rows: run the valid rows only
        if valid is not None:
            batch = dataclasses.replace(batch, flat_valid=valid, _plans={})
            x = x[valid].unsqueeze(0)  # [1, N, d]
        taps: dict[int, torch.Tensor] = {}
        wanted = set(tap_layers)
        if -1 in wanted:
            taps[-1] = x
        fused = self.fused_layers
        plan = None if fused is None else fused.plan_for(x, kv_caches, batch)
        if plan is not None:  # a decode / verify step as flat kernel calls (same bits)
            x = fused.run(x, kv_caches, batch, table, plan, taps, wanted)
        else:
            for i, layer in enumerate(self.model.layers):
                x = layer(x, kv_caches[i], batch, table)
                if i in wanted:
                    taps[i] = x
        tap = torch.cat([taps[i] for i in tap_layers], dim=-1) if tap_layers else None
        if valid is not None:
            x, tap = _unflatten(x, valid), (None if tap is None else _unflatten(tap, valid))
        if logits_rows is not None:
            idx = logits_rows.unsqueeze(-1).expand(-1, -1, x.shape[-1])
            x = torch.gather(x, 1, idx)
        head = self.packed_lm_head
        if use_packed(head):  # the final norm runs inside the head's call (PackedLinear)
            logits = converted(head(x, self.model.norm), torch.float32)  # ops/threads.py
        else:
            logits = self.lm_head(self.model.norm(x)).float()
        return logits, tap

    def _mrope_rows(
        self, batch: PagedBatch, positions: torch.Tensor
    ) -> tuple[PagedBatch, torch.Tensor]:
        """(batch with row-index positions, fp32 [B * S, rotary_dim] per-row cos/sin table)."""
        cfg = self.config
        if cfg.mrope_section is None:
            raise ValueError(
                f"mrope_positions given but {cfg.source} has no mrope_section (1-D RoPE model)"
            )
        bsz, rows = batch.positions.shape
        if tuple(positions.shape) != (3, bsz, rows):
            raise ValueError(
                f"mrope_positions must be [3, B, S] = [3, {bsz}, {rows}], "
                f"got {tuple(positions.shape)}"
            )
        rotary_dim = int(cfg.head_dim * cfg.rope.partial_rotary_factor)
        table = mrope_cos_sin_rows(
            positions.reshape(3, bsz * rows), rotary_dim, cfg.rope, cfg.mrope_section
        )
        row_ids = torch.arange(bsz * rows, dtype=torch.int32).view(bsz, rows)
        per_row = PagedBatch(
            batch.page_table, batch.past_lengths, batch.input_lengths, row_ids, batch._plans
        )
        return per_row, table

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_source(
        cls, source: WeightSource, dtype: torch.dtype = torch.float32
    ) -> LlamaForCausalLM:
        """Build the model from a checkpoint, checking every tensor first.

        NVFP4 / FP8 weights are dequantized to `dtype` (the CPU path).

        Raises:
            CheckpointError: a missing or unexpected tensor, a shape that does not match the
                config, or `tie_word_embeddings: false` with no `lm_head.weight`; each message
                names the file and tensor.
        """
        cfg = ModelConfig.from_dict(source.config, source=str(source.config_path))
        expected = expected_shapes(cfg)
        check_tensors(source, cfg, expected)
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to_empty(device="cpu").to(dtype)
        params = dict(model.named_parameters())
        for name in expected:
            prefix, _, leaf = name.rpartition(".")
            if name == "lm_head.weight" and name not in source:
                continue  # tied: filled below
            if (
                leaf == "weight"
                and f"{prefix}.weight_scale" in source
                or (leaf == "weight" and f"{prefix}.weight_scale_inv" in source)
            ):
                value = dense(source.linear(prefix), dtype)
            else:
                value = source.get(name).to(dtype)
            with torch.no_grad():
                params[name].copy_(value)
        if "lm_head.weight" not in source:
            with torch.no_grad():
                params["lm_head.weight"].copy_(params["model.embed_tokens.weight"])
        model._rope_table = torch.empty(0, 0)
        model.eval()
        return model


def _unflatten(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[1, N, F] valid rows back to [B, S, F] (padding rows zero)."""
    out = x.new_zeros(*valid.shape, x.shape[-1])
    out[valid] = x[0]
    return out


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Logical tensor shapes (name -> shape) that a checkpoint of `cfg` must hold."""
    d, hq, hkv, hd, i = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
    )
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, d)}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}"
        linears = layer_linear_shapes(d, hq, hkv, hd, i)
        for name, shape in linears.items():
            out[f"{p}.{name}.weight"] = shape
        if cfg.attention_bias:
            for name in ("q_proj", "k_proj", "v_proj"):
                out[f"{p}.self_attn.{name}.bias"] = (linears[f"self_attn.{name}"][0],)
            if cfg.family.value == "llama":
                out[f"{p}.self_attn.o_proj.bias"] = (d,)
        if cfg.mlp_bias:
            for name in ("gate_proj", "up_proj", "down_proj"):
                out[f"{p}.mlp.{name}.bias"] = (linears[f"mlp.{name}"][0],)
        if cfg.qk_norm:
            out[f"{p}.self_attn.q_norm.weight"] = (hd,)
            out[f"{p}.self_attn.k_norm.weight"] = (hd,)
        out[f"{p}.input_layernorm.weight"] = (d,)
        out[f"{p}.post_attention_layernorm.weight"] = (d,)
    out["model.norm.weight"] = (d,)
    out["lm_head.weight"] = (cfg.vocab_size, d)
    return out


def _logical_shape(source: WeightSource, name: str) -> tuple[int, ...]:
    info = source.info(name)
    prefix = name.rpartition(".")[0]
    if info.dtype == torch.uint8 and f"{prefix}.weight_scale" in source:
        return (info.shape[0], info.shape[1] * 2)  # NVFP4 packs two codes per byte
    return info.shape


def check_tensors(source: WeightSource, cfg: ModelConfig, expected: dict) -> None:
    """Fail before loading when tensors are missing, unexpected or mis-shaped.

    Raises:
        CheckpointError: naming the file and the tensor, and the fix.
    """
    where = str(source.path)
    if "lm_head.weight" not in source and not cfg.tie_word_embeddings:
        raise CheckpointError(
            f"{source.config_path}: 'tie_word_embeddings' is false but {where} has no "
            "'lm_head.weight'; add the head or set tie_word_embeddings: true if the model "
            "shares its embedding"
        )
    missing = [n for n in expected if n not in source and n != "lm_head.weight"]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(
            f"{where}: missing tensors {missing[:5]}{more}; the checkpoint is incomplete or "
            f"does not match config.json ({cfg.architecture}, {cfg.num_hidden_layers} layers)"
        )
    aux = tuple(f".{s}" for s in quant_tensor_suffixes())
    vision = VISION_PREFIX if cfg.vision_config is not None else None  # loaded by vision.py
    unexpected = [
        n
        for n in source.names()
        if n not in expected
        and not n.endswith(aux)
        and not n.endswith("rotary_emb.inv_freq")
        and not (vision and n.startswith(vision))
    ]
    if unexpected:
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        raise CheckpointError(
            f"{where}: unexpected tensors {unexpected[:5]}{more} for a {cfg.architecture} "
            "config; check that config.json belongs to these weights"
        )
    for name, shape in expected.items():
        if name in source:
            check_shape(name, str(source.info(name).file), _logical_shape(source, name), shape)
            dtype = source.info(name).dtype
            if not (dtype.is_floating_point or dtype == torch.uint8):
                raise CheckpointError(
                    f"{source.info(name).file}: tensor '{name}' has dtype {dtype}, expected a "
                    "floating-point or packed NVFP4 (uint8) weight"
                )
    for name in expected:
        prefix = name.rpartition(".")[0]
        if name in source and f"{prefix}.weight_scale" in source:
            value = source.linear(prefix)
            if isinstance(value, QuantizedWeight):
                value.validate()
