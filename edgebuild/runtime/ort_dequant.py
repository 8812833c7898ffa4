"""FP4 ``DequantizeLinear`` chains folded into float initializers, in memory, for onnxruntime.

A bundle's NVFP4 weights are exported as two ``DequantizeLinear`` nodes per linear
(:mod:`edgebuild.export.weights`, "native" mode)::

    s = DequantizeLinear(weight_scale: FLOAT8E4M3FN [out, in/16], weight_scale_2: FLOAT [])
    w = DequantizeLinear(weight: FLOAT4E2M1 [out, in], s, axis=-1, block_size=16)

TensorRT parses them into dequantize layers; onnxruntime's CPU provider has no FLOAT4E2M1
``DequantizeLinear`` kernel and refuses the graph. The nearest executable equivalent, built by
:func:`fold_fp4_dequantize` on the loaded ``onnx.ModelProto`` (the file on disk is never
changed): every ``DequantizeLinear`` whose input is FLOAT4E2M1, and the ``DequantizeLinear``
nodes computing its scale, are evaluated once here and replaced by their float32 result as an
initializer of the same name; the rest of the graph (MatMuls, the attention plugin node, ...)
runs unchanged. The decoders are ours, written from the formats' definitions
(``../shared/spec/nvfp4-and-fp8-checkpoints.md``; ONNX ``DequantizeLinear``, opset 23):

* FLOAT4E2M1: two codes per byte, the first element in the low nibble; bit 3 sign, bits 0..2
  index the magnitudes ``[0, 0.5, 1, 1.5, 2, 3, 4, 6]`` (:data:`E2M1_VALUES`).
* FLOAT8E4M3FN: sign bit 7, exponent bits 3..6 (bias 7), mantissa bits 0..2; exponent 0 is
  subnormal (``m / 8 * 2**-6``); ``S.1111.111`` is NaN; no infinities (:func:`e4m3fn_values`).
* ``DequantizeLinear``: ``y = (x - zero_point) * scale`` in float32, ``scale`` a scalar, one
  value per slice along ``axis`` (1-D), or, with ``block_size`` B, one value per B elements
  along ``axis`` (the scale has ``x``'s shape with that axis ``ceil(D / B)``).
"""

from __future__ import annotations

import numpy as np

from edgebuild.errors import EngineError

FLOAT4E2M1, FLOAT8E4M3FN, FLOAT = 23, 17, 1  # onnx.TensorProto data types
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
DQ = "DequantizeLinear"


def e2m1_values() -> np.ndarray:
    """The 16 FLOAT4E2M1 codes' values (float32 [16]; code = sign << 3 | magnitude index)."""
    return np.concatenate([E2M1_VALUES, -E2M1_VALUES])


def e4m3fn_values() -> np.ndarray:
    """The 256 FLOAT8E4M3FN codes' values (float32 [256]; NaN for ``S.1111.111``)."""
    code = np.arange(256)
    sign = np.where(code >> 7, -1.0, 1.0)
    exp, man = (code >> 3) & 0xF, code & 0x7
    normal = (1.0 + man / 8.0) * np.exp2(exp - 7.0)
    value = np.where(exp == 0, man / 8.0 * 2.0**-6, normal) * sign
    value[(exp == 15) & (man == 7)] = np.nan
    return value.astype(np.float32)


def _tensor_bytes(t) -> np.ndarray:
    """A FLOAT4E2M1 / FLOAT8E4M3FN tensor's stored bytes (raw_data, else int32_data) as uint8."""
    if t.raw_data:
        return np.frombuffer(t.raw_data, dtype=np.uint8)
    return np.asarray(t.int32_data, dtype=np.uint8)


def decode_tensor(t) -> np.ndarray:
    """An initializer (``onnx.TensorProto`` with its data loaded) as a float32 / int array.

    FLOAT4E2M1 and FLOAT8E4M3FN are decoded here (module docstring); other types through
    ``onnx.numpy_helper``.

    Raises:
        EngineError: the stored byte count does not match the shape.
    """
    from onnx import numpy_helper

    dims = tuple(t.dims)
    n = int(np.prod(dims, dtype=np.int64))
    if t.data_type == FLOAT4E2M1:
        packed = _tensor_bytes(t)
        codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(-1)
        if codes.size not in (n, n + 1):
            raise EngineError(f"initializer {t.name}: {packed.size} bytes for FP4 shape {dims}")
        return e2m1_values()[codes[:n]].reshape(dims)
    if t.data_type == FLOAT8E4M3FN:
        codes = _tensor_bytes(t)
        if codes.size != n:
            raise EngineError(f"initializer {t.name}: {codes.size} bytes for FP8 shape {dims}")
        return e4m3fn_values()[codes].reshape(dims)
    return numpy_helper.to_array(t)


def dequantize(x: np.ndarray, scale: np.ndarray, zero_point=None, axis=1, block_size=0):
    """ONNX ``DequantizeLinear`` on decoded arrays: ``(x - zero_point) * scale`` in float32.

    Args:
        x: the decoded codes, any shape.
        scale: a scalar, a 1-D array of ``x.shape[axis]`` values, or (``block_size`` B > 0)
            ``x``'s shape with ``axis`` of length ``ceil(x.shape[axis] / B)``.
        zero_point: as ``scale``'s shape, or None (0).
        axis, block_size: the node's attributes.

    Raises:
        EngineError: a scale shape that fits none of the three forms.
    """
    x = x.astype(np.float32)
    axis = axis % x.ndim if x.ndim else 0

    def spread(s):
        s = np.asarray(s, dtype=np.float32)
        if s.ndim == 0 or s.size == 1:
            return s.reshape(())
        if block_size > 0 and s.ndim == x.ndim:
            cut = (slice(None),) * axis + (slice(0, x.shape[axis]),)
            return np.repeat(s, block_size, axis=axis)[cut]
        if s.ndim == 1 and s.shape[0] == x.shape[axis]:
            return s.reshape([-1 if i == axis else 1 for i in range(x.ndim)])
        raise EngineError(
            f"{DQ}: scale shape {s.shape} fits neither a scalar, axis {axis} of {x.shape} "
            f"nor blocks of {block_size}"
        )

    if zero_point is not None:
        x = x - spread(zero_point)
    return (x * spread(scale)).astype(np.float32)


def _fp4_nodes(graph, inits) -> list:
    """The DQ nodes to fold: each with a FLOAT4E2M1 initializer input, and the DQ nodes that
    produce their scales (transitively)."""
    producers = {o: n for n in graph.node if n.op_type == DQ for o in n.output}
    chosen = [n for n in graph.node if n.op_type == DQ and n.input[0] in inits
              and inits[n.input[0]].data_type == FLOAT4E2M1]  # fmt: skip
    pending = list(chosen)
    while pending:
        node = pending.pop()
        for name in node.input[1:]:
            up = producers.get(name)
            if up is not None and up.output[0] not in {c.output[0] for c in chosen}:
                chosen.append(up)
                pending.append(up)
    return chosen


def _fold_node(node, values: dict) -> np.ndarray:
    """Evaluate one DQ node whose inputs are all in ``values``."""
    attrs = {a.name: a.i for a in node.attribute}
    if attrs.get("output_dtype", FLOAT) != FLOAT:
        raise EngineError(
            f"node {node.name}: {DQ} output_dtype {attrs['output_dtype']} (only float32 "
            "graphs run on the onnxruntime backend)"
        )
    missing = [i for i in node.input if i and i not in values]
    if missing:
        raise EngineError(f"node {node.name}: {DQ} input {missing[0]} is not a constant")
    zp = values[node.input[2]] if len(node.input) > 2 and node.input[2] else None
    return dequantize(values[node.input[0]], values[node.input[1]], zp,
                      attrs.get("axis", 1), attrs.get("block_size", 0))  # fmt: skip


def fold_fp4_dequantize(model) -> int:
    """Replace the FP4 ``DequantizeLinear`` chains of ``model`` (an ``onnx.ModelProto`` with
    its external data loaded; modified in place) by float32 initializers (module docstring).
    Initializers only the folded nodes read are dropped.

    Returns:
        The number of ``DequantizeLinear`` nodes folded (0: nothing to do).

    Raises:
        EngineError: a chain whose inputs are not constants, a scale shape DequantizeLinear does
            not define, or a non-float32 output.
    """
    from onnx import numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    chosen = _fp4_nodes(graph, inits)
    if not chosen:
        return 0
    ids = {n.output[0] for n in chosen}  # SSA: an output names its node
    values: dict[str, np.ndarray] = {}
    for node in graph.node:  # topological order: scale DQs come first
        if node.output and node.output[0] in ids:
            for name in node.input:
                if name in inits and name not in values:
                    values[name] = decode_tensor(inits[name])
            values[node.output[0]] = _fold_node(node, values)
    folded = [n.output[0] for n in chosen]
    for i in reversed(range(len(graph.node))):
        if graph.node[i].output and graph.node[i].output[0] in ids:
            del graph.node[i]
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    for i in reversed(range(len(graph.initializer))):
        if graph.initializer[i].name not in used:
            del graph.initializer[i]
    graph.initializer.extend(
        numpy_helper.from_array(values[name], name) for name in folded if name in used
    )
    return len(chosen)
