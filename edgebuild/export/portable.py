"""The portable translation of the attention op: standard ONNX ops over a dense per-sequence KV.

Portable graphs run where the ``EdgebuildAttention`` plugin cannot be loaded: onnxruntime on a
CPU (the planned ``onnxruntime`` backend, and the parity tests) and TensorRT-RTX's parser and
builder (a real engine build on a CPU-only machine). They keep the plugin graph's inputs and
outputs except the paging:

* **Dense per-sequence cache.** ``kv_cache_{i}`` is ``[B, 2, Hkv, T, D]``: sequence ``b`` owns
  row ``b``, slot ``t`` of the sequence is ``[b, :, :, t]`` and ``T`` (``kv_capacity``) is a
  dynamic axis. This *is* the paged contract with one page per sequence (``num_pages = B``,
  ``page_size = T``, ``page_table[b] = [b]``), so the torch models produce the reference
  results unchanged and the graph needs no ``page_table`` input.
* **Explicit masks.** Keys are ``[cached slots 0..T-1 ; new rows 0..S-1]``. Row ``i`` of
  sequence ``b`` sees cached slot ``t`` iff ``t < past_lengths[b]``, and new row ``j`` iff
  ``j < input_lengths[b]`` and (``j <= i`` when causal); with a sliding window ``w`` also
  ``(past + i) - slot < w``. Scores, softmax and ``P @ V`` run in fp32 (contract numerics);
  padding rows (``i >= input_lengths[b]``) output zeros.
* **Exact cache update.** With ``write_kv`` the present cache is
  ``Where(past <= t < past + len, new_row[t - past], cache[t])`` built with ``GatherND``
  (``batch_dims=1``): no scatter, so padding rows and other sequences are never touched and no
  two writes can collide. Requirement (checked by the runtime that feeds the graph):
  ``T >= past_lengths[b] + input_lengths[b]`` for every written sequence.

The q/k RMSNorm and the rotate-half RoPE follow :mod:`edgebuild.ops.attention` (norm in fp32,
cast back, gamma product; RoPE in fp32, cast back); positions are clamped into the table so a
garbage position on a padding row cannot make ``Gather`` fail.
"""

from __future__ import annotations

from typing import Any

from edgebuild.errors import ConfigError

_LOWEST = -3.4028234663852886e38  # float32 lowest: a masked score (softmax stays finite)


def _op():
    from onnxscript import opset23

    return opset23


def _ints(*values: int):
    return _op().Constant(value_ints=list(values))


def _int(value: int):
    return _op().Constant(value_int=value)


def _float(value: float):
    return _op().Constant(value_float=float(value))


def _slice(x, start: int, end: int, axis: int):
    return _op().Slice(x, _ints(start), _ints(end), _ints(axis))


def _rms_norm(x, weight, eps: float):
    """HF RMSNorm over the last axis: fp32 variance, cast back, times ``weight``."""
    op = _op()
    x32 = op.Cast(x, to=1)
    variance = op.ReduceMean(op.Mul(x32, x32), _ints(-1), keepdims=1)
    normed = op.Mul(x32, op.Reciprocal(op.Sqrt(op.Add(variance, _float(eps)))))
    return op.CastLike(op.Mul(weight, op.CastLike(normed, x)), x)


def _rope(x, cos, sin, rotary_dim: int, head_dim: int):
    """Rotate-half RoPE of the first ``rotary_dim`` channels of ``x`` [B, S, H, D] in fp32."""
    op = _op()
    half = rotary_dim // 2
    x32 = op.Cast(x, to=1)
    x1, x2 = _slice(x32, 0, half, 3), _slice(x32, half, rotary_dim, 3)
    parts = [op.Sub(op.Mul(x1, cos), op.Mul(x2, sin)), op.Add(op.Mul(x2, cos), op.Mul(x1, sin))]
    if rotary_dim < head_dim:
        parts.append(_slice(x32, rotary_dim, head_dim, 3))
    return op.CastLike(op.Concat(*parts, axis=3), x)


def _heads(qkv, start: int, count: int):
    """Heads ``start .. start+count-1`` of the packed qkv reshaped to [B, S, H, D]."""
    return _slice(qkv, start, start + count, 2)


def _visibility(past, lengths, t_cache, s_new, causal: bool, window: int):
    """bool [B, 1, S|1, T + S]: row i may see key column t (module docstring rule)."""
    op = _op()
    zero = _int(0)
    total = op.Add(t_cache, s_new)
    cols = op.Range(zero, total, _int(1))  # [T+S]
    rows = op.Range(zero, s_new, _int(1))  # [S]
    past_b = op.Reshape(past, _ints(-1, 1, 1))  # [B, 1, 1]
    len_b = op.Reshape(lengths, _ints(-1, 1, 1))
    cols_2d = op.Unsqueeze(cols, _ints(0))  # [1, T+S]
    rows_2d = op.Unsqueeze(rows, _ints(1))  # [S, 1]
    is_cache = op.Less(cols_2d, t_cache)  # [1, T+S]
    j = op.Sub(cols_2d, t_cache)  # new-row index of a column
    see_cache = op.Less(cols_2d, past_b)  # [B, 1, T+S]
    see_new = op.Less(j, len_b)  # [B, 1, T+S]
    if causal:
        see_new = op.And(see_new, op.LessOrEqual(j, rows_2d))  # [B, S, T+S]
    # bool select as And/Or: onnxruntime's CPU Where has no bool kernel
    visible = op.Or(op.And(is_cache, see_cache), op.And(op.Not(is_cache), see_new))
    if window > 0:
        key_slot = op.Where(is_cache, cols_2d, op.Add(past_b, j))  # [B, 1, T+S]
        query_slot = op.Add(past_b, rows_2d)  # [B, S, 1]
        visible = op.And(visible, op.Less(op.Sub(query_slot, key_slot), _int(window)))
    return op.Unsqueeze(visible, _ints(1))  # [B, 1, S or 1, T+S], broadcast over heads


def _merge_cache(cache, new, past, lengths, t_cache, s_new):
    """[B, Hkv, T, D]: ``new`` [B, S, Hkv, D] placed at slots past..past+len-1 of ``cache``."""
    op = _op()
    slots = op.Unsqueeze(op.Range(_int(0), t_cache, _int(1)), _ints(0))  # [1, T]
    rel = op.Sub(slots, op.Unsqueeze(past, _ints(1)))  # [B, T]
    inside = op.And(op.GreaterOrEqual(rel, _int(0)), op.Less(rel, op.Unsqueeze(lengths, _ints(1))))
    index = op.Max(op.Min(rel, op.Sub(s_new, _int(1))), _int(0))
    rows = op.GatherND(new, op.Unsqueeze(index, _ints(2)), batch_dims=1)  # [B, T, Hkv, D]
    rows = op.Transpose(rows, perm=[0, 2, 1, 3])
    return op.Where(op.Unsqueeze(inside, _ints(1, 3)), rows, cache)


def _rotate_qk(q, k, positions, rope_cos_sin, rotary_dim: int, d: int):
    """RoPE on q and k ``[B, S, H, D]`` from the table rows at ``positions`` (clamped)."""
    op = _op()
    rows = op.Shape(rope_cos_sin, start=0, end=1)
    pos = op.Max(op.Min(op.Cast(positions, to=7), op.Sub(rows, _int(1))), _int(0))
    table = op.Unsqueeze(op.Gather(rope_cos_sin, pos, axis=0), _ints(2))  # [B, S, 1, R]
    cos, sin = (
        _slice(table, 0, rotary_dim // 2, 3),
        _slice(table, rotary_dim // 2, rotary_dim, 3),
    )
    return _rope(q, cos, sin, rotary_dim, d), _rope(k, cos, sin, rotary_dim, d)


def _repeat_kv(kv, hq: int, hkv: int, d: int):
    """GQA: ``[B, Hkv, T, D]`` -> ``[B, Hq, T, D]`` (q head h reads KV head h // group)."""
    group = hq // hkv
    if group == 1:
        return kv
    op = _op()
    return op.Reshape(
        op.Expand(op.Unsqueeze(kv, _ints(2)), _ints(1, 1, group, 1, 1)), _ints(0, hq, -1, d)
    )


def portable_attention(
    qkv,
    kv_cache,
    page_table,
    past_lengths,
    input_lengths,
    positions,
    rope_cos_sin,
    q_norm_weight=None,
    k_norm_weight=None,
    tree_mask=None,
    num_q_heads: int = 0,
    num_kv_heads: int = 0,
    head_dim: int = 0,
    rotary_dim: int = 0,
    causal: bool = True,
    write_kv: bool = True,
    sliding_window: int = 0,
    scale: float = 1.0,
    rms_norm_eps: float = 1e-6,
    page_size: int = 0,
) -> tuple[Any, Any]:
    """Translate the functional attention op into standard ONNX ops (module docstring).

    ``kv_cache`` is the dense per-sequence cache ``[B, 2, Hkv, T, D]``; ``page_table`` and
    ``page_size`` are ignored (one page per sequence by construction). Returns
    ``(attn_out [B, S, Hq*D], present_kv_cache [B, 2, Hkv, T, D])``.

    Raises:
        ConfigError: a tree mask (tree verification is not exported yet).
    """
    if tree_mask is not None:
        raise ConfigError("tree verification (tree_mask) is not exported yet; use chain verify")
    op = _op()
    hq, hkv, d = num_q_heads, num_kv_heads, head_dim
    heads = op.Reshape(qkv, _ints(0, 0, hq + 2 * hkv, d))  # [B, S, Hq+2Hkv, D]
    q, k, v = _heads(heads, 0, hq), _heads(heads, hq, hkv), _heads(heads, hq + hkv, hkv)
    if q_norm_weight is not None:
        q = _rms_norm(q, q_norm_weight, rms_norm_eps)
    if k_norm_weight is not None:
        k = _rms_norm(k, k_norm_weight, rms_norm_eps)
    if rotary_dim:
        q, k = _rotate_qk(q, k, positions, rope_cos_sin, rotary_dim, d)
    k, v = op.CastLike(k, kv_cache), op.CastLike(v, kv_cache)  # rounded to the cache dtype
    past = op.Cast(past_lengths, to=7)
    lengths = op.Cast(input_lengths, to=7)
    t_cache = op.Squeeze(op.Shape(kv_cache, start=3, end=4), _ints(0))
    s_new = op.Squeeze(op.Shape(qkv, start=1, end=2), _ints(0))
    cache_k = op.Squeeze(_slice(kv_cache, 0, 1, 1), _ints(1))  # [B, Hkv, T, D]
    cache_v = op.Squeeze(_slice(kv_cache, 1, 2, 1), _ints(1))
    keys = op.Concat(cache_k, op.Transpose(k, perm=[0, 2, 1, 3]), axis=2)  # [B, Hkv, T+S, D]
    values = op.Concat(cache_v, op.Transpose(v, perm=[0, 2, 1, 3]), axis=2)
    keys, values = _repeat_kv(keys, hq, hkv, d), _repeat_kv(values, hq, hkv, d)
    q32 = op.Transpose(op.Cast(q, to=1), perm=[0, 2, 1, 3])  # [B, Hq, S, D]
    keys_t = op.Transpose(op.Cast(keys, to=1), perm=[0, 1, 3, 2])  # [B, Hq, D, T+S]
    scores = op.Mul(op.MatMul(q32, keys_t), _float(scale))  # [B, Hq, S, T+S]
    visible = _visibility(past, lengths, t_cache, s_new, causal, sliding_window)
    probs = op.Softmax(op.Where(visible, scores, _float(_LOWEST)), axis=-1)
    out = op.MatMul(probs, op.Cast(values, to=1))  # [B, Hq, S, D]
    out = op.Reshape(op.Transpose(out, perm=[0, 2, 1, 3]), _ints(0, 0, hq * d))
    row = op.Unsqueeze(op.Range(_int(0), s_new, _int(1)), _ints(0))  # [1, S]
    valid = op.Unsqueeze(op.Less(row, op.Unsqueeze(lengths, _ints(1))), _ints(2))  # [B, S, 1]
    attn_out = op.CastLike(op.Where(valid, out, _float(0.0)), qkv)
    if not write_kv:
        return attn_out, op.Identity(kv_cache)
    merged_k = _merge_cache(cache_k, k, past, lengths, t_cache, s_new)
    merged_v = _merge_cache(cache_v, v, past, lengths, t_cache, s_new)
    present = op.Concat(op.Unsqueeze(merged_k, _ints(1)), op.Unsqueeze(merged_v, _ints(1)), axis=1)
    return attn_out, present
