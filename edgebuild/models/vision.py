"""The Qwen2.5-VL vision tower (`visual.*` of a VLM checkpoint): patch embedding, 2-D rotary
positions, window / full attention blocks and the 2x2 patch merger.

Data flow for a batch of still images (``N`` patches, ``M = N / m^2`` merged tokens):

1. ``pixel_values`` fp32 ``[N, C * T * P * P]`` rows in 2x2 merge-block order
   (:mod:`edgebuild.models.image_processing` makes them, identical to transformers');
2. a host-side :class:`VisionPlan` (from the image grids only) gives the window permutation,
   the per-patch 2-D RoPE rows, the attention segments and the inverse permutation;
3. :meth:`VisionTower.forward` runs patch embed (the Conv3d as one linear), the blocks (full
   attention inside each image on ``fullatt_block_indexes``, else inside each window of
   ``window_size`` pixels) and the merger, and returns ``[M, out_hidden_size]`` in prompt
   (raster) order: image ``k`` owns rows ``cu_tokens[k] : cu_tokens[k+1]``.

Attention is "each segment attends to itself": segments are gathered into a padded batch
``[n_seg, L, H, D]`` with a key mask (padding keys masked out, padding queries dropped when
scattered back); only standard ops, so the tower exports to ONNX as is (the vision phase has
no KV cache). All grid-dependent indices are plan tensors (graph inputs on export), never
Python control flow.

Parameter names are the checkpoint's without the ``visual.`` prefix (``VISION_PREFIX``).
Sources: transformers 5.14 ``models/qwen2_5_vl/modeling_qwen2_5_vl.py``
(``Qwen2_5_VisionTransformerPretrainedModel`` and its parts) and ``vision_utils.py``
(``get_vision_position_ids``, ``get_vision_window_index``, ``get_vision_cu_seqlens``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgebuild.checkpoint.quant import quant_tensor_suffixes
from edgebuild.checkpoint.source import WeightSource
from edgebuild.errors import CheckpointError, ConfigError
from edgebuild.models.common import RMSNorm, check_shape, dense

log = logging.getLogger("edgebuild.models")

VISION_PREFIX = "visual."
VISION_RMS_EPS = 1e-6  # hard-coded in HF (Qwen2_5_VLRMSNorm(..., eps=1e-6))

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


@dataclass(frozen=True)
class VisionConfig:
    """Vision tower geometry (HF ``vision_config`` keys) plus the prompt token ids it needs.

    Attributes:
        depth, hidden_size, intermediate_size, num_heads: the ViT blocks.
        in_channels (hub: ``in_chans``), patch_size, temporal_patch_size: one patch row has
            ``in_channels * temporal_patch_size * patch_size ** 2`` values.
        spatial_merge_size: m, patches merged per side into one LLM token.
        window_size: window side in pixels for the windowed blocks.
        fullatt_block_indexes: blocks with full (per-image) attention.
        out_hidden_size: merger output width (= the language model's hidden size).
        hidden_act: MLP activation (``silu`` for Qwen2.5-VL).
        image_token_id, vision_start_token_id, vision_end_token_id: top-level config ids.
    """

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    image_token_id: int = 151655
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    source: str = "config.json"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per pixel row: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2

    @property
    def window_tokens(self) -> int:
        """Merged tokens in one full attention window: ``(window_size // m // patch_size)^2``."""
        return (self.window_size // self.spatial_merge_size // self.patch_size) ** 2

    @classmethod
    def from_model_config(cls, cfg: dict, source: str = "config.json") -> VisionConfig:
        """Parse ``cfg["vision_config"]`` and the top-level token ids of a VLM ``config.json``.

        Raises:
            ConfigError: missing ``vision_config``, a missing / mistyped field, or geometry
                that does not fit (see :meth:`validate`).
        """
        vis = cfg.get("vision_config")
        if not isinstance(vis, dict):
            raise ConfigError(f"{source}: no 'vision_config' object; not a vision-language model")
        fields: dict = {"source": source}
        ints = ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size")
        optional = ("patch_size", "temporal_patch_size", "spatial_merge_size", "window_size")
        for key in ints + optional:
            value = vis.get(key)
            if value is None:
                if key in ints:
                    raise ConfigError(f"{source}: required field 'vision_config.{key}' is missing")
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{source}: 'vision_config.{key}' must be int, got {value!r}")
            fields[key] = value
        channels = vis.get("in_channels", vis.get("in_chans"))
        if channels is not None:
            fields["in_channels"] = int(channels)
        if vis.get("fullatt_block_indexes") is not None:
            fields["fullatt_block_indexes"] = tuple(int(i) for i in vis["fullatt_block_indexes"])
        if vis.get("hidden_act") is not None:
            fields["hidden_act"] = str(vis["hidden_act"])
        for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
            if cfg.get(key) is not None:
                fields[key] = int(cfg[key])
        config = cls(**fields)
        config.validate()
        return config

    def validate(self) -> None:
        """Raise ConfigError naming the field when the geometry cannot work."""
        s = self.source
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ConfigError(
                f"{s}: vision_config.hidden_size ({self.hidden_size}) / num_heads "
                f"({self.num_heads}) must give a head_dim divisible by 4 (2-D rotary)"
            )
        if self.window_size // self.spatial_merge_size // self.patch_size < 1:
            raise ConfigError(
                f"{s}: vision_config.window_size {self.window_size} px is smaller than one "
                f"merged patch ({self.spatial_merge_size} x {self.patch_size} px)"
            )
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            raise ConfigError(
                f"{s}: vision_config.fullatt_block_indexes {bad} outside [0, depth={self.depth})"
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise ConfigError(
                f"{s}: vision_config.hidden_act {self.hidden_act!r} is not supported; "
                f"supported: {', '.join(sorted(_ACTIVATIONS))}"
            )


# ---------------------------------------------------------------------------- the host plan
@dataclass
class Segments:
    """Rows attending to each other, as a padded batch.

    index: long [n_seg, L] row (window order) of slot (s, i); padding slots point at row 0.
    valid: bool [n_seg, L] real slots.
    slot: long [N] flat slot ``s * L + i`` of each row (to scatter results back).
    """

    index: Tensor
    valid: Tensor
    slot: Tensor

    @classmethod
    def from_lengths(cls, lengths: Sequence[int]) -> Segments:
        """Consecutive segments of the given lengths (all > 0)."""
        lens = torch.tensor(list(lengths), dtype=torch.int64)
        width = int(lens.max())
        starts = torch.cumsum(lens, 0) - lens
        ar = torch.arange(width)
        valid = ar[None, :] < lens[:, None]
        index = torch.where(valid, starts[:, None] + ar[None, :], 0)
        slot = (torch.arange(len(lens)) * width).repeat_interleave(lens)
        slot = slot + torch.cat([torch.arange(int(n)) for n in lens])
        return cls(index, valid, slot)


@dataclass
class VisionPlan:
    """Everything grid-dependent of one vision pass, computed on the host.

    Attributes:
        grids: per image ``(t, h, w)`` in patches.
        patch_order: long [N], pixel row at each window-order position.
        rope: fp32 [N, head_dim], ``[cos | sin]`` 2-D rotary rows in window order.
        full: per-frame segments (full-attention blocks).
        windows: per-window segments (the other blocks).
        merge_order: long [M], merger output row of each token in prompt order.
        cu_tokens: per-image token offsets, [num_images + 1].
    """

    grids: tuple[tuple[int, int, int], ...]
    patch_order: Tensor
    rope: Tensor
    full: Segments
    windows: Segments
    merge_order: Tensor
    cu_tokens: tuple[int, ...]

    @classmethod
    def build(cls, cfg: VisionConfig, grids: Sequence[Sequence[int]]) -> VisionPlan:
        """Plan a pass over images with patch grids ``grids`` (each ``(t, h, w)``).

        Raises:
            ValueError: an empty grid list, or h / w not multiples of ``spatial_merge_size``.
        """
        m = cfg.spatial_merge_size
        grids = tuple(tuple(int(x) for x in g) for g in grids)
        if not grids:
            raise ValueError("VisionPlan needs at least one image grid")
        for t, h, w in grids:
            if t < 1 or h < m or w < m or h % m or w % m:
                raise ValueError(
                    f"image grid {(t, h, w)} must have t >= 1 and h, w multiples of {m}"
                )
        window_index, window_lengths = _window_index(cfg, grids)
        unit = cfg.merge_unit
        patch_order = (window_index[:, None] * unit + torch.arange(unit)).reshape(-1)
        rope = _rope_rows(cfg, grids)[patch_order]
        frames = [h * w for t, h, w in grids for _ in range(t)]
        tokens = [t * h * w // unit for t, h, w in grids]
        cu = [0]
        for n in tokens:
            cu.append(cu[-1] + n)
        return cls(
            grids=grids,
            patch_order=patch_order,
            rope=rope,
            full=Segments.from_lengths(frames),
            windows=Segments.from_lengths([n * unit for n in window_lengths]),
            merge_order=torch.argsort(window_index),
            cu_tokens=tuple(cu),
        )

    @property
    def num_patches(self) -> int:
        return int(self.patch_order.shape[0])

    @property
    def num_tokens(self) -> int:
        """Language-model tokens (merged patches) of the pass, all images."""
        return self.cu_tokens[-1]

    def engine_inputs(self, pixel_values: Tensor) -> dict[str, Tensor]:
        """The ``visual`` engine's inputs (name -> tensor; the names of ``VisualGraph.io()``).

        Args:
            pixel_values: ``[N, patch_dim]`` patch rows of all images, in the graph's dtype
                (:mod:`edgebuild.models.image_processing` order).
        """
        return {
            "pixel_values": pixel_values,
            "patch_order": self.patch_order,
            "rope_cos_sin": self.rope,
            "full_index": self.full.index,
            "full_valid": self.full.valid,
            "full_slot": self.full.slot,
            "window_index": self.windows.index,
            "window_valid": self.windows.valid,
            "window_slot": self.windows.slot,
            "merge_order": self.merge_order,
        }


def _rope_rows(cfg: VisionConfig, grids) -> Tensor:
    """fp32 [N, head_dim] cos|sin rows of the (h, w) patch positions in merge-block order.

    HF: ``Qwen2_5_VisionRotaryEmbedding(head_dim // 2)``: inv_freq over head_dim/4 pairs;
    ``rpe = cat(h * inv_freq, w * inv_freq)``; cos/sin of ``cat(rpe, rpe)``.
    """
    dim = cfg.head_dim // 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    m = cfg.spatial_merge_size
    rows = []
    for t, h, w in grids:
        hpos, wpos = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // m, m, w // m, m)
        hpos = hpos.reshape(shape).transpose(1, 2).flatten()
        wpos = wpos.reshape(shape).transpose(1, 2).flatten()
        rows.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))
    pos = torch.cat(rows)  # [N, 2] long
    rpe = (pos.unsqueeze(-1) * inv_freq).flatten(1)  # [N, head_dim / 2]
    return torch.cat((rpe.cos(), rpe.sin()), dim=-1)


def _window_index(cfg: VisionConfig, grids) -> tuple[Tensor, list[int]]:
    """Merge-unit permutation into window order and the non-empty window sizes (in units).

    HF ``get_vision_window_index``: windows of ``window_size // m // patch_size`` merged units
    per side, row-major over windows, row-major inside a window, per frame.
    """
    m = cfg.spatial_merge_size
    win = cfg.window_size // m // cfg.patch_size
    order, lengths, base = [], [], 0
    for t, h, w in grids:
        gh, gw = h // m, w // m
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        nh, nw = -(-gh // win), -(-gw // win)
        padded = F.pad(index, (0, nw * win - gw, 0, nh * win - gh), value=-1)
        padded = padded.reshape(t, nh, win, nw, win).permute(0, 1, 3, 2, 4)
        padded = padded.reshape(t * nh * nw, win * win)
        keep = padded >= 0
        lengths += [int(n) for n in keep.sum(1) if int(n) > 0]
        order.append(padded[keep] + base)
        base += t * gh * gw
    return torch.cat(order), lengths


# ---------------------------------------------------------------------------- the modules
def _rotate(x: Tensor, rope: Tensor) -> Tensor:
    """Rotate-half RoPE of ``x`` [N, H, D] with per-row ``rope`` fp32 [N, D] (cos | sin)."""
    half = rope.shape[-1] // 2
    cos, sin = rope[:, None, :half], rope[:, None, half:]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def segment_attention(q: Tensor, k: Tensor, v: Tensor, seg: Segments, scale: float) -> Tensor:
    """Non-causal attention inside each segment: q/k/v [N, H, D] -> [N, H, D].

    Scores, softmax and the weighted sum run in fp32. Under export the math is written out as
    MatMul / Where / Softmax so the graph is plain ONNX (no fused attention op needed by the
    parser); eagerly ``scaled_dot_product_attention`` avoids the [n_seg, H, L, L] scores.
    """
    n_seg, width = seg.index.shape
    heads, dim = q.shape[1], q.shape[2]
    qs, ks, vs = (t[seg.index].transpose(1, 2).float() for t in (q, k, v))  # [n_seg, H, L, D]
    keys_visible = seg.valid[:, None, None, :]  # [n_seg, 1, 1, L]
    if torch.compiler.is_exporting():
        scores = torch.matmul(qs, ks.transpose(-1, -2)) * scale  # [n_seg, H, L, L]
        scores = scores.masked_fill(~keys_visible, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), vs)  # [n_seg, H, L, D]
    else:
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=keys_visible, scale=scale)
    out = out.transpose(1, 2).reshape(n_seg * width, heads, dim)
    return out[seg.slot].to(q.dtype)


class VisionAttention(nn.Module):
    """Fused-qkv attention of one block (HF names ``qkv``, ``proj``)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: Tensor, rope: Tensor, seg: Segments) -> Tensor:  # x [N, d]
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, rope), _rotate(k, rope)
        out = segment_attention(q, k, v, seg, self.head_dim**-0.5)
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    """Gated MLP with biases: down(act(gate(x)) * up(x))."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, i, bias=True)
        self.up_proj = nn.Linear(d, i, bias=True)
        self.down_proj = nn.Linear(i, d, bias=True)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    """Pre-norm ViT block (HF names ``norm1``, ``attn``, ``norm2``, ``mlp``)."""

    def __init__(self, cfg: VisionConfig, full: bool):
        super().__init__()
        self.full = full
        self.norm1 = RMSNorm(cfg.hidden_size, VISION_RMS_EPS)
        self.norm2 = RMSNorm(cfg.hidden_size, VISION_RMS_EPS)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: Tensor, rope: Tensor, seg: Segments) -> Tensor:
        x = x + self.attn(self.norm1(x), rope, seg)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """The patch Conv3d (kernel = stride = (T, P, P), no bias) applied as one linear per row."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel, kernel, bias=False)

    def forward(self, pixels: Tensor) -> Tensor:  # [N, C*T*P*P] -> [N, d]
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.reshape(weight.shape[0], -1))


class PatchMerger(nn.Module):
    """RMSNorm, then each merge unit's m^2 rows concatenated through a GELU MLP to the LLM width."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        width = cfg.hidden_size * cfg.merge_unit
        self.width = width
        self.ln_q = RMSNorm(cfg.hidden_size, VISION_RMS_EPS)
        self.mlp = nn.Sequential(
            nn.Linear(width, width), nn.GELU(), nn.Linear(width, cfg.out_hidden_size)
        )

    def forward(self, x: Tensor) -> Tensor:  # [N, d] -> [N / m^2, out]
        return self.mlp(self.ln_q(x).reshape(-1, self.width))


class VisionTower(nn.Module):
    """Qwen2.5-VL vision encoder + merger (checkpoint prefix ``visual.``).

    ``forward(pixel_values, plan)`` -> image embeddings ``[M, out_hidden_size]`` in prompt order.
    """

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        full = set(cfg.fullatt_block_indexes)
        self.blocks = nn.ModuleList(VisionBlock(cfg, i in full) for i in range(cfg.depth))
        self.merger = PatchMerger(cfg)

    def forward(
        self,
        pixel_values: Tensor,  # fp32 [N, C*T*P*P], merge-block order (image processor rows)
        plan: VisionPlan,
    ) -> Tensor:  # [M, out_hidden_size], M = N / m^2, prompt order
        return self.run(
            pixel_values,
            plan.patch_order,
            plan.rope,
            plan.full,
            plan.windows,
            plan.merge_order,
        )

    def run(
        self,
        pixel_values: Tensor,  # [N, C*T*P*P]
        patch_order: Tensor,  # long [N]
        rope: Tensor,  # fp32 [N, head_dim]
        full: Segments,
        windows: Segments,
        merge_order: Tensor,  # long [M]
    ) -> Tensor:
        """The forward pass on plain tensors (what the ONNX graph computes)."""
        x = self.patch_embed(pixel_values[patch_order])  # [N, d], window order
        for block in self.blocks:
            x = block(x, rope, full if block.full else windows)
        return self.merger(x)[merge_order]

    def encode(self, images: Sequence) -> list[Tensor]:
        """Embeddings of preprocessed images (objects with ``pixel_values`` and ``grid_thw``).

        Returns one ``[tokens_k, out_hidden_size]`` tensor per image, in order.
        """
        plan = VisionPlan.build(self.config, [im.grid_thw for im in images])
        pixels = torch.cat([im.pixel_values for im in images])
        dtype = next(self.parameters()).dtype
        with torch.inference_mode():
            out = self(pixels.to(dtype), plan)
        cu = plan.cu_tokens
        return [out[cu[k] : cu[k + 1]] for k in range(len(images))]

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_source(cls, source: WeightSource, dtype: torch.dtype = torch.float32) -> VisionTower:
        """Load ``visual.*`` of a VLM checkpoint, checking names and shapes first.

        Raises:
            ConfigError: a bad ``vision_config``.
            CheckpointError: a missing, unexpected or mis-shaped ``visual.*`` tensor (names the
                file and the tensor).
        """
        cfg = VisionConfig.from_model_config(source.config, str(source.config_path))
        expected = check_vision_tensors(source, cfg)
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to_empty(device="cpu").to(dtype)
        params = dict(model.named_parameters())
        for name in expected:
            full = VISION_PREFIX + name
            prefix = full.rpartition(".")[0]
            if name.endswith(".weight") and (
                f"{prefix}.weight_scale" in source or f"{prefix}.weight_scale_inv" in source
            ):
                value = dense(source.linear(prefix), dtype)
            else:
                value = source.get(full).to(dtype)
            with torch.no_grad():
                params[name].copy_(value)
        model.eval()
        return model


def expected_vision_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Tensor shapes (names without ``visual.``) a checkpoint with ``cfg`` must hold."""
    d, i, t, p = cfg.hidden_size, cfg.intermediate_size, cfg.temporal_patch_size, cfg.patch_size
    out: dict[str, tuple[int, ...]] = {"patch_embed.proj.weight": (d, cfg.in_channels, t, p, p)}
    for b in range(cfg.depth):
        pre = f"blocks.{b}"
        out |= {
            f"{pre}.norm1.weight": (d,),
            f"{pre}.norm2.weight": (d,),
            f"{pre}.attn.qkv.weight": (3 * d, d),
            f"{pre}.attn.qkv.bias": (3 * d,),
            f"{pre}.attn.proj.weight": (d, d),
            f"{pre}.attn.proj.bias": (d,),
            f"{pre}.mlp.gate_proj.weight": (i, d),
            f"{pre}.mlp.gate_proj.bias": (i,),
            f"{pre}.mlp.up_proj.weight": (i, d),
            f"{pre}.mlp.up_proj.bias": (i,),
            f"{pre}.mlp.down_proj.weight": (d, i),
            f"{pre}.mlp.down_proj.bias": (d,),
        }
    width = d * cfg.merge_unit
    out |= {
        "merger.ln_q.weight": (d,),
        "merger.mlp.0.weight": (width, width),
        "merger.mlp.0.bias": (width,),
        "merger.mlp.2.weight": (cfg.out_hidden_size, width),
        "merger.mlp.2.bias": (cfg.out_hidden_size,),
    }
    return out


def check_vision_tensors(source: WeightSource, cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Check the ``visual.*`` tensors of ``source`` against ``cfg`` (headers only, no data read).

    Returns:
        :func:`expected_vision_shapes` (names without ``visual.``).

    Raises:
        CheckpointError: a missing, unexpected or mis-shaped tensor (names the file, the tensor
            and the config).
    """
    expected = expected_vision_shapes(cfg)
    where = str(source.path)
    have = {n[len(VISION_PREFIX) :] for n in source.names() if n.startswith(VISION_PREFIX)}
    aux = tuple(f".{s}" for s in quant_tensor_suffixes())
    missing = sorted(set(expected) - have)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(
            f"{where}: missing vision tensors {[VISION_PREFIX + n for n in missing[:5]]}{more}; "
            f"the checkpoint does not match vision_config in {cfg.source} (depth {cfg.depth})"
        )
    unexpected = sorted(n for n in have - set(expected) if not n.endswith(aux))
    if unexpected:
        raise CheckpointError(
            f"{where}: unexpected vision tensors {[VISION_PREFIX + n for n in unexpected[:5]]}; "
            f"check that vision_config in {cfg.source} belongs to these weights"
        )
    for name, shape in expected.items():
        info = source.info(VISION_PREFIX + name)
        got = info.shape
        if info.dtype == torch.uint8 and len(shape) == 2:  # NVFP4: two codes per byte
            got = (got[0], got[1] * 2)
        check_shape(VISION_PREFIX + name, str(info.file), got, shape, "vision_config")
    return expected
