"""Multimodal RoPE (Qwen2-VL / Qwen2.5-VL "mrope"): config parsing, 3-axis positions, cos/sin rows.

Every token of a multimodal prompt has three position ids (t, h, w). Text tokens have equal
ids on all three axes, so for them mrope *is* the 1-D rope of :mod:`edgebuild.ops.rope`
(same inverse frequencies, same table). Image tokens get their grid coordinates; the rotary
channels are split by ``mrope_section = [s_t, s_h, s_w]`` (``s_t + s_h + s_w = rotary_dim / 2``):
frequency ``j`` of a head rotates with the t position if ``j < s_t``, with h if
``j < s_t + s_h``, else with w (HF ``apply_multimodal_rotary_pos_emb``: ``mrope_section * 2``
split of ``cat(freqs, freqs)``, chunk ``i`` taken from axis ``i % 3``).

How the attention consumes it (no change to the attention op or plugin): the model computes,
on the host, one cos/sin row per new token (:func:`mrope_cos_sin_rows`, the same
``[cos half | sin half]`` layout as ``rope_cos_sin_table``) and passes that per-row table as
``rope_cos_sin`` with ``positions[b, i] = b * S + i`` (the row index). Decode and verify rows are
text, so they use the ordinary table at position ``slot + rope_delta`` (see
:func:`mrope_position_ids`). The exported multimodal base graph builds the same per-row table
by gathering column ``j`` of the ordinary table at the position of ``j``'s axis
(:meth:`edgebuild.export.graphs.BaseGraph._rope`): equal values, as the row at equal positions
is the table row.

Sources: transformers 5.14 ``models/qwen2_5_vl/modeling_qwen2_5_vl.py``
(``Qwen2_5_VLModel.get_rope_index``, ``get_vision_position_ids``, ``Qwen2_5_VLRotaryEmbedding``,
``apply_multimodal_rotary_pos_emb``) and ``configuration_qwen2_5_vl.py``
(``convert_rope_params_to_dict``: rope type ``mrope`` means ``default``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from edgebuild.errors import ConfigError
from edgebuild.ops.rope import RopeScaling, compute_inv_freq

__all__ = [
    "mrope_cos_sin_rows",
    "mrope_position_ids",
    "parse_mrope",
]


def parse_mrope(cfg: dict, source: str = "config.json") -> tuple[RopeScaling, tuple[int, int, int]]:
    """Read a multimodal-RoPE text config: the 1-D rope parameters and ``mrope_section``.

    Layouts (both load to identical models in transformers):
        * hub (flat): ``rope_scaling: {"type": "mrope", "mrope_section": [16, 24, 24]}`` and
          ``rope_theta`` at the top level;
        * transformers 5 (``text_config``): ``rope_parameters: {"rope_type": "default",
          "mrope_section": [...], "rope_theta": ...}``.
    ``mrope`` as a rope type means ``default`` frequencies (HF ``convert_rope_params_to_dict``);
    ``mrope_interleaved`` (Qwen3-VL) is refused.

    Args:
        cfg: the text config dict (flat hub config or the nested ``text_config``).
        source: file name for messages.

    Returns:
        ``(rope, mrope_section)``: the parsed frequencies (any supported rope type) and the
        three section widths.

    Raises:
        ConfigError: no ``mrope_section``, a section that is not three positive integers,
            interleaved mrope, or any error of :meth:`RopeScaling.from_hf_config`.
    """
    key = next(
        (k for k in ("rope_parameters", "rope_scaling") if isinstance(cfg.get(k), dict) and cfg[k]),
        None,
    )
    params = dict(cfg[key]) if key else {}
    section = params.pop("mrope_section", None)
    if section is None:
        raise ConfigError(
            f"{source}: a multimodal-RoPE model needs rope_parameters.mrope_section (or "
            "rope_scaling.mrope_section), e.g. [16, 24, 24]"
        )
    if params.pop("mrope_interleaved", False):
        raise ConfigError(
            f"{source}: {key}.mrope_interleaved is set (Qwen3-VL layout); only the sectioned "
            "Qwen2-VL / Qwen2.5-VL layout is supported"
        )
    if (
        not isinstance(section, list | tuple)
        or len(section) != 3
        or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in section)
    ):
        raise ConfigError(
            f"{source}: {key}.mrope_section must be three positive integers (t, h, w), "
            f"got {section!r}"
        )
    kind = params.get("rope_type", params.get("type"))
    if kind == "mrope":
        params.pop("type", None)
        params["rope_type"] = "default"
    text = dict(cfg)
    text[key] = params
    return RopeScaling.from_hf_config(text, source=source), tuple(section)


def check_mrope_section(section: Sequence[int], rotary_dim: int, source: str) -> None:
    """Raise ConfigError unless ``sum(section) == rotary_dim // 2`` (HF splits by these widths)."""
    if sum(section) != rotary_dim // 2:
        raise ConfigError(
            f"{source}: mrope_section {list(section)} sums to {sum(section)} but the rotary "
            f"dimension {rotary_dim} has {rotary_dim // 2} frequencies; they must be equal"
        )


def mrope_cos_sin_rows(
    positions: torch.Tensor,  # int [3, N] (t, h, w) position ids of N rows
    rotary_dim: int,
    rope: RopeScaling,
    section: Sequence[int],
) -> torch.Tensor:  # fp32 [N, rotary_dim]
    """Per-row RoPE table for 3-axis positions, in the ``rope_cos_sin_table`` layout.

    Row ``n`` is ``[cos(p_a(j) * inv_freq[j]) * s | sin(...) * s]`` for ``j < rotary_dim / 2``
    where ``a(j)`` is the axis of frequency ``j`` given by ``section``. With equal positions on
    the three axes the row equals ``rope_cos_sin_table(rotary_dim, ., rope)[p]`` bit for bit.

    Raises:
        ConfigError: section widths that do not add up to ``rotary_dim / 2``.
        ValueError: ``positions`` not an integer ``[3, N]`` tensor.
    """
    check_mrope_section(section, rotary_dim, "mrope")
    if positions.dim() != 2 or positions.shape[0] != 3 or positions.is_floating_point():
        raise ValueError(
            f"mrope positions must be an integer [3, N] tensor, got {positions.dtype} "
            f"{tuple(positions.shape)}"
        )
    inv_freq, scaling = compute_inv_freq(rotary_dim, rope)  # fp32 [rotary_dim / 2]
    axis = torch.repeat_interleave(torch.arange(3), torch.tensor(list(section)))  # [rd / 2]
    pos = positions.to(torch.int64).to(torch.float32)  # [3, N]
    freqs = pos[axis].T * inv_freq[None, :]  # [N, rd / 2]: frequency j at its axis' position
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)


def mrope_position_ids(
    input_ids: Sequence[int],
    image_token_id: int,
    image_grids: Sequence[tuple[int, int, int]],
    spatial_merge_size: int,
) -> tuple[torch.Tensor, int]:
    """Qwen2.5-VL 3-axis positions of a prompt with still images (``get_rope_index``).

    Text runs count up by one on all axes. A run of image pad tokens (one image, grid
    ``(t, h, w)`` in patches; ``t * (h/m) * (w/m)`` pads with ``m = spatial_merge_size``) starting
    at position ``p`` gets ``(p + t_i, p + h_i, p + w_i)`` for its merged grid coordinates
    (still images: temporal interval 1); the text after it resumes at ``p + max(h, w) / m``
    (not ``p + h*w``). Decode step ``j`` (token ``S + j``) then has position ``S + j + delta`` on
    every axis.

    Args:
        input_ids: prompt token ids with the image pads already expanded.
        image_token_id: id of the image pad token.
        image_grids: per image (in prompt order) its patch grid ``(t, h, w)``.
        spatial_merge_size: patches merged per side into one token (``m``).

    Returns:
        ``(positions, delta)``: int64 ``[3, S]`` and ``delta = max(positions) + 1 - S``.

    Raises:
        ValueError: the pad runs do not match the grids (count or length).
    """
    ids = torch.as_tensor(list(input_ids), dtype=torch.int64)
    is_pad = ids == image_token_id
    pieces: list[torch.Tensor] = []
    pos, i, n, k = 0, 0, len(ids), 0
    while i < n:
        j = i
        while j < n and bool(is_pad[j]) == bool(is_pad[i]):
            j += 1
        if not bool(is_pad[i]):
            pieces.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos += j - i
            i = j
            continue
        if k >= len(image_grids):
            raise ValueError(f"prompt has more image pad runs than the {len(image_grids)} images")
        t, h, w = (int(x) for x in image_grids[k])
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        count = t * gh * gw
        if j - i < count:
            raise ValueError(f"image {k}: {j - i} pad tokens in a run, expected {count}")
        tt, hh, ww = torch.meshgrid(
            torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij"
        )
        pieces.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        pos += max(gh, gw)
        i += count  # a following image may be adjacent: the rest of the run is the next image
        k += 1
    if k != len(image_grids):
        raise ValueError(f"prompt has {k} images' pad tokens but {len(image_grids)} images")
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.int64)
    delta = int(positions.max()) + 1 - n if n else 0
    return positions, delta
