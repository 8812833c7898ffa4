"""Streaming the checkpoint weights into an exported graph's external data file.

The graphs are traced with meta weights (no memory); this module then fills every weight
initializer from the checkpoint, one tensor at a time, appending its bytes to
``model.onnx.data`` and pointing the initializer at them (ONNX external data). At most one
(dequantized) tensor is held at once, and the checkpoint's memory maps are dropped every
:data:`RELEASE_BYTES` so that file pages read through ``mmap`` do not accumulate in the
process's resident set. Peak memory is therefore one layer's largest tensor plus the
tracing overhead, independent of the model size.

Quantized linears (:class:`~edgebuild.checkpoint.quant.QuantizedWeight`) are written in one
of two :class:`WeightMode` s:

* ``native``: the stored tensors as they are, with standard DequantizeLinear chains (opset 23):
    - NVFP4: ``DequantizeLinear(weight_scale: FLOAT8E4M3FN [out, in/16], weight_scale_2: FLOAT
      []) -> s`` feeding ``DequantizeLinear(weight: FLOAT4E2M1 [out, in], s, axis=-1,
      block_size=16)`` (the checkpoint's packed bytes unchanged: ONNX packs FLOAT4E2M1 two per
      byte, first element in the low nibble, as ModelOpt does);
    - FP8 per-tensor / per-channel: ``DequantizeLinear(weight: FLOAT8E4M3FN, weight_scale)``;
    - FP8 128x128 blocks: ``weight_scale_inv`` repeated along ``out`` into a per-row block scale
      ``[out, ceil(in/128)]`` and ``DequantizeLinear(weight, scale, axis=1, block_size=128)``;
  then a ``Cast`` to the graph dtype when it is not fp32. TensorRT (and TensorRT-RTX) parse
  these into dequantize layers; onnxruntime's CPU provider has no FLOAT4E2M1 kernels.
* ``dense``: dequantized to the graph dtype on the fly (onnxruntime-runnable graphs).

**Shared weights** (:class:`SharedWeights`): a DSpark draft borrows the target's embedding and
``lm_head``. The base export writes those tensors (as stored: NVFP4 stays NVFP4) into a second
file next to its graph, :data:`SHARED_NAME`, and records where; the draft graph is saved in the
same folder and its borrowed initializers point at the same offsets. ONNX readers (onnx,
onnxruntime, TensorRT's parser) refuse external data outside a graph's folder, and onnx also
refuses symbolic and hard links, so one folder is how two graphs name one file.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import onnx_ir as ir
import torch

from edgebuild.checkpoint.pairing import PairedSources
from edgebuild.checkpoint.quant import QuantAlgo, QuantizedWeight, is_quant_aux_tensor
from edgebuild.checkpoint.source import WeightSource
from edgebuild.errors import CheckpointError
from edgebuild.ops.rope import RopeScaling, rope_cos_sin_table

log = logging.getLogger("edgebuild.export")

SHARED_NAME = "shared.onnx.data"  # the target tensors a draft graph borrows (module docstring)
RELEASE_BYTES = 64 << 20  # drop checkpoint memory maps after this many bytes read
_ALIGN_SMALL, _ALIGN_LARGE, _LARGE = 64, 4096, 1 << 16

_IR_DTYPES = {
    torch.float32: ir.DataType.FLOAT,
    torch.float16: ir.DataType.FLOAT16,
    torch.bfloat16: ir.DataType.BFLOAT16,
    torch.float8_e4m3fn: ir.DataType.FLOAT8E4M3FN,
    torch.uint8: ir.DataType.UINT8,
    torch.int32: ir.DataType.INT32,
    torch.int64: ir.DataType.INT64,
}
_TORCH_DTYPES = {v: k for k, v in _IR_DTYPES.items()}


class WeightMode(str, Enum):
    """How quantized linears are written (module docstring)."""

    NATIVE = "native"
    DENSE = "dense"


@dataclass(frozen=True)
class WeightEntry:
    """Where one initializer's data comes from.

    Attributes:
        name: the initializer (= parameter) name.
        load: returns the stored value (dense tensor or QuantizedWeight) when called.
        checkpoint_source: "component", "target", or "computed" (the RoPE table).
        file: the checkpoint file name (not the directory) or "" for computed tensors.
        tensor: the stored tensor name in that file.
    """

    name: str
    load: Callable[[], torch.Tensor | QuantizedWeight]
    checkpoint_source: str
    file: str = ""
    tensor: str = ""

    def origin(self) -> dict:
        return {
            "checkpoint_source": self.checkpoint_source,
            "file": self.file,
            "tensor": self.tensor,
        }


def _is_quantized_linear(source: WeightSource, name: str) -> bool:
    prefix, _, leaf = name.rpartition(".")
    return leaf == "weight" and any(
        f"{prefix}.{s}" in source for s in ("weight_scale", "weight_scale_inv")
    )


def _source_entry(source: WeightSource, param: str, stored: str) -> WeightEntry:
    if _is_quantized_linear(source, stored):

        def load(prefix=stored.rpartition(".")[0]):
            return source.linear(prefix)
    else:

        def load(name=stored):
            return source.get(name)

    info = source.info(stored)
    return WeightEntry(param, load, source.checkpoint_source, info.file.name, stored)


def rope_entry(rotary_dim: int, rows: int, rope: RopeScaling) -> WeightEntry:
    """The fp32 RoPE table buffer ``[rows, rotary_dim]`` (computed, not read)."""
    from edgebuild.export.graphs import ROPE_BUFFER

    return WeightEntry(
        ROPE_BUFFER, lambda: rope_cos_sin_table(rotary_dim, rows, rope), "computed", "", "rope"
    )


def base_entries(source: WeightSource, tied: bool) -> dict[str, WeightEntry]:
    """Initializer name -> entry for the target (names are the checkpoint's).

    A tied head shares ``model.embed_tokens.weight`` (one initializer in the graph).
    """
    out = {}
    for name in source.names():
        if name.endswith("rotary_emb.inv_freq") or is_quant_aux_tensor(name):
            continue
        out[name] = _source_entry(source, name, name)
    if tied and "lm_head.weight" in out:
        del out["lm_head.weight"]
    return out


def draft_entries(pair: PairedSources) -> dict[str, WeightEntry]:
    """Initializer name -> entry for a DSpark draft (canonical names, spec section 1.2).

    ``lm_head.weight`` / ``embed_tokens.weight`` come from :class:`PairedSources` (the
    draft's own, or the target's with ``checkpoint_source = "target"``).
    """
    from edgebuild.models.dspark import canonical_name

    out = {}
    for stored in pair.draft.names():
        canon = canonical_name(stored)
        if canon.startswith(("lm_head.", "embed_tokens.")) or canon.endswith("inv_freq"):
            continue
        if is_quant_aux_tensor(canon):
            continue
        out[canon] = _source_entry(pair.draft, canon, stored)
    for param, resolve in (
        ("lm_head.weight", pair.lm_head),
        ("embed_tokens.weight", pair.embed_tokens),
    ):
        found = resolve()  # reads the header only for the name; the value is re-read on write
        src = pair.draft if found.checkpoint_source == pair.draft.checkpoint_source else pair.target
        out[param] = _source_entry(src, param, found.name)
    return out


def visual_entries(source: WeightSource, prefix: str = "visual.") -> dict[str, WeightEntry]:
    """Initializer name -> entry for the vision tower of a VLM checkpoint (the ``visual.*``
    tensors under their checkpoint names; quantization side tensors are read with their
    linear)."""
    return {
        name: _source_entry(source, name, name)
        for name in source.names()
        if name.startswith(prefix) and not is_quant_aux_tensor(name)
    }


# ----------------------------------------------------------------------------- writer
class ExternalDataWriter:
    """Appends tensors to one external data file and returns ``ir.ExternalTensor`` s.

    Offsets are aligned (64 bytes, 4 KiB for tensors >= 64 KiB) so that readers can map
    large tensors directly. The file is written sequentially; nothing is kept in memory.
    """

    def __init__(self, directory: Path, location: str):
        self.directory, self.location = Path(directory), location
        self._file = open(self.directory / location, "wb")  # noqa: SIM115 - closed in close()
        self.offset = 0

    def add(self, name: str, data: torch.Tensor, dtype: ir.DataType, shape: tuple[int, ...]):
        """Write ``data``'s raw bytes; ``dtype``/``shape`` describe them (FP4: packed)."""
        raw = data.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        align = _ALIGN_LARGE if raw.nbytes >= _LARGE else _ALIGN_SMALL
        pad = -self.offset % align
        if pad:
            self._file.write(b"\0" * pad)
            self.offset += pad
        self._file.write(memoryview(raw))
        tensor = ir.ExternalTensor(
            self.location,
            self.offset,
            raw.nbytes,
            dtype,
            shape=ir.Shape(shape),
            name=name,
            base_dir=str(self.directory),
        )
        self.offset += raw.nbytes
        return tensor

    def close(self) -> None:
        self._file.close()


class _RecordingWriter:
    """Writes into the shared file and records each tensor under its checkpoint tensor."""

    def __init__(self, shared: SharedWeights, key: tuple[str, str]):
        self.shared, self.key = shared, key

    def add(self, name: str, data: torch.Tensor, dtype: ir.DataType, shape: tuple[int, ...]):
        tensor = self.shared.writer().add(name, data, dtype, shape)
        self.shared.tensors.setdefault(self.key, []).append(tensor)
        return tensor


class _ReplayWriter:
    """Returns the recorded shared tensors (same order as written), rebased to ``directory``."""

    def __init__(self, recorded: list[ir.ExternalTensor], directory: Path):
        self.recorded, self.directory, self.index = recorded, Path(directory), 0

    def add(self, name: str, data: torch.Tensor, dtype: ir.DataType, shape: tuple[int, ...]):
        if self.index >= len(self.recorded):
            raise CheckpointError(f"shared weight '{name}' was not written by the base export")
        old = self.recorded[self.index]
        self.index += 1
        if old.dtype != dtype or tuple(old.shape.numpy()) != tuple(shape):
            raise CheckpointError(
                f"shared weight '{name}' is {dtype.name} {list(shape)} in the draft graph but "
                f"{old.dtype.name} {list(old.shape.numpy())} in the base graph"
            )
        return ir.ExternalTensor(
            SHARED_NAME,
            old.offset,
            old.length,
            dtype,
            shape=ir.Shape(shape),
            name=name,
            base_dir=str(self.directory),
        )


@dataclass
class SharedWeights:
    """The target tensors a draft graph borrows, stored once (module docstring).

    Created for a pair before the base export (:meth:`for_pair`), passed to
    :func:`materialize` of the base graph (which writes the tensors into ``base_dir /
    SHARED_NAME``) and then of the draft graph (which points at them).

    Attributes:
        keys: ``(checkpoint file name, stored tensor name)`` of the target tensors to share.
        base_dir: the base graph's folder (set by the base export).
        tensors: key -> the external tensors written for it (a quantized weight: codes and
            scales, in writing order).
        dtypes: key -> the graph initializer dtype it was written for (a draft graph of
            another dtype stores its own copy instead).
    """

    keys: set[tuple[str, str]]
    base_dir: Path | None = None
    tensors: dict[tuple[str, str], list] = field(default_factory=dict)
    dtypes: dict[tuple[str, str], ir.DataType] = field(default_factory=dict)
    _writer: ExternalDataWriter | None = None

    @classmethod
    def for_pair(cls, pair: PairedSources) -> SharedWeights:
        """The pair's borrowed ``lm_head`` / ``embed_tokens`` (those read from the target)."""
        keys = set()
        for found in (pair.lm_head(), pair.embed_tokens()):
            if found.checkpoint_source == pair.target.checkpoint_source:
                keys.add((pair.target.info(found.name).file.name, found.name))
        return cls(keys)

    def writer(self) -> ExternalDataWriter:
        if self._writer is None:
            if self.base_dir is None:
                raise CheckpointError("shared weights written before the base folder was set")
            self._writer = ExternalDataWriter(self.base_dir, SHARED_NAME)
        return self._writer

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    @property
    def path(self) -> Path | None:
        """The shared file, once the base export wrote it."""
        return self.base_dir / SHARED_NAME if self._writer is not None else None

    @property
    def nbytes(self) -> int:
        """Bytes of the shared tensors (padding excluded)."""
        return sum(t.length for ts in self.tensors.values() for t in ts)

    def route(self, entry: WeightEntry, dtype: ir.DataType, default, directory: Path):
        """The writer for ``entry``: the shared file (base), its recorded tensors (draft) or
        ``default`` (not shared)."""
        key = (entry.file, entry.tensor)
        if key not in self.keys:
            return default
        if key not in self.tensors:
            if Path(directory) != self.base_dir:
                return default  # the base graph did not write it (e.g. another role)
            self.dtypes[key] = dtype
            return _RecordingWriter(self, key)
        if self.dtypes[key] != dtype or entry.checkpoint_source != "target":
            return default
        return _ReplayWriter(self.tensors[key], directory)


# ----------------------------------------------------------------------------- materialize
@dataclass
class WeightReport:
    """What :func:`materialize` wrote.

    Attributes:
        borrowed: initializers not read from the role's own checkpoint (a draft's head and
            embedding from the target, the computed RoPE table) -> their origin.
        quantized: initializer -> stored format (NVFP4, FP8, FP8_BLOCK) kept as DQ chains.
        bytes_written: bytes of the graph's weights (its own file and the shared one).
        shared: initializers stored in :data:`SHARED_NAME` -> their bytes (codes only for a
            quantized weight: its scales are listed by their own names).
    """

    borrowed: dict[str, dict] = field(default_factory=dict)
    quantized: dict[str, str] = field(default_factory=dict)
    bytes_written: int = 0
    shared: dict[str, int] = field(default_factory=dict)

    def borrowed_json(self) -> str:
        return json.dumps(self.borrowed, sort_keys=True, separators=(",", ":"))


def meta_initializers(graph: ir.Graph) -> Iterator[ir.Value]:
    """Initializers traced from meta tensors (the weights still to be filled), graph order."""
    for value in list(graph.initializers.values()):
        raw = getattr(value.const_value, "raw", None)
        if isinstance(raw, torch.Tensor) and raw.device.type == "meta":
            yield value


def materialize(
    model: ir.Model,
    entries: dict[str, WeightEntry],
    writer: ExternalDataWriter,
    mode: WeightMode,
    sources: list[WeightSource],
    on_tensor: Callable[[str, int], None] | None = None,
    shared: SharedWeights | None = None,
) -> WeightReport:
    """Fill every meta initializer of ``model`` from ``entries`` (module docstring).

    Args:
        model: the traced graph (modified in place).
        entries: initializer name -> data source.
        writer: the external data file.
        mode: native DequantizeLinear chains or dense dequantization.
        sources: checkpoint sources whose memory maps are released periodically.
        on_tensor: progress callback ``(name, bytes)``.
        shared: the pair's shared target tensors: written into the shared file (base graph)
            or pointed at (draft graph) instead of ``writer``.

    Raises:
        CheckpointError: an initializer without a source, or a stored tensor whose shape does
            not match the traced parameter (names the file and tensor).
    """
    graph, report, since_release = model.graph, WeightReport(), 0
    chains: list[ir.Node] = []
    for value in list(meta_initializers(graph)):
        name = value.name
        entry = entries.get(name)
        if entry is None:
            raise CheckpointError(
                f"exported graph needs weight '{name}' but no checkpoint provides it"
            )
        data = entry.load()
        want = tuple(value.shape.numpy()) if value.shape is not None else ()
        got = tuple(data.shape)
        if got != want:
            raise CheckpointError(
                f"{entry.file}: tensor '{entry.tensor}' has shape {list(got)} but the exported "
                f"graph's '{name}' is {list(want)}"
            )
        if entry.checkpoint_source != "component":
            report.borrowed[name] = entry.origin()
        out = writer
        if shared is not None:
            out = shared.route(entry, value.dtype, writer, writer.directory)
            if out is not writer:
                report.shared[name] = data.nbytes if isinstance(data, QuantizedWeight) else 0
        if isinstance(data, QuantizedWeight) and mode is WeightMode.NATIVE:
            chains += _dequantize_chain(graph, value, data, out)
            report.quantized[name] = data.format.value
            nbytes = data.nbytes
        else:
            dtype = _TORCH_DTYPES[value.dtype]
            dense = data.dequantize(dtype) if isinstance(data, QuantizedWeight) else data.to(dtype)
            value.const_value = out.add(name, dense, value.dtype, want)
            nbytes = dense.numel() * dense.element_size()
            if name in report.shared:
                report.shared[name] = nbytes
            del dense
        del data
        report.bytes_written += nbytes
        since_release += nbytes
        if on_tensor is not None:
            on_tensor(name, nbytes)
        if since_release >= RELEASE_BYTES:
            for source in sources:
                source.close()
            since_release = 0
    if chains:
        graph.insert_before(graph.node(0), chains)
    for source in sources:
        source.close()
    return report


def _stored(
    graph: ir.Graph,
    writer: ExternalDataWriter,
    name: str,
    data: torch.Tensor,
    dtype: ir.DataType,
    shape: tuple[int, ...],
) -> ir.Value:
    """Initializer ``name`` of ``graph`` whose bytes ``writer`` stores (``data`` as ``dtype``
    of ``shape``; the bytes as the checkpoint holds them)."""
    tensor = writer.add(name, data, dtype, shape)
    value = ir.Value(name=name, shape=tensor.shape, type=ir.TensorType(tensor.dtype))
    value.const_value = tensor
    graph.register_initializer(value)
    return value


def _node(op: str, inputs, name: str, **attrs) -> ir.Node:
    return ir.Node(
        "",
        op,
        inputs,
        attributes=ir.convenience.convert_attributes(attrs),
        outputs=[ir.Value(name=name)],
        name=f"{name}/{op}",
    )


_CODE_DTYPES = {
    QuantAlgo.NVFP4: ir.DataType.FLOAT4E2M1,
    QuantAlgo.FP8: ir.DataType.FLOAT8E4M3FN,
    QuantAlgo.FP8_BLOCK: ir.DataType.FLOAT8E4M3FN,
}


def _dequantize_chain(
    graph: ir.Graph, value: ir.Value, qw: QuantizedWeight, writer: ExternalDataWriter
) -> list[ir.Node]:
    """Replace initializer ``value`` by a DequantizeLinear chain over the stored tensors: the
    codes (initializer ``value.name``, [out, in] in the format's code type), its scales."""
    qw.validate()
    name = value.name
    out_f, in_f = qw.shape
    if qw.format is QuantAlgo.NVFP4 and qw.data.shape[1] * 2 != in_f:
        raise CheckpointError(
            f"{qw.file}: NVFP4 tensor '{name}' is padded along 'in' ({qw.data.shape[1] * 2} "
            f"codes for {in_f} inputs); padded NVFP4 weights are not exported yet"
        )
    graph.initializers.pop(name)
    value.name = f"{name}.__meta"
    data = _stored(graph, writer, name, qw.data, _CODE_DTYPES[qw.format], (out_f, in_f))
    scales = _nvfp4_nodes if qw.format is QuantAlgo.NVFP4 else _fp8_nodes
    nodes = scales(graph, data, qw, writer, f"{name}.dequantized")
    result = nodes[-1].outputs[0]
    if value.dtype != ir.DataType.FLOAT:
        nodes.append(_node("Cast", [result], f"{name}.dense", to=value.dtype))
        result = nodes[-1].outputs[0]
    ir.convenience.replace_all_uses_with(value, result)
    return nodes


def _nvfp4_nodes(
    graph: ir.Graph, data: ir.Value, qw: QuantizedWeight, writer: ExternalDataWriter, out: str
) -> list[ir.Node]:
    """FP8 block scales and the FP32 global scale of the NVFP4 codes ``data`` -> two
    DequantizeLinear nodes (the block scales, then the codes; output ``out``)."""
    ws, ws2 = qw.weight_scale, qw.weight_scale_2.float()
    f8, f32 = ir.DataType.FLOAT8E4M3FN, ir.DataType.FLOAT
    scale = _stored(graph, writer, f"{qw.name}.weight_scale", ws, f8, tuple(ws.shape))
    global_scale = _stored(graph, writer, f"{qw.name}.weight_scale_2", ws2, f32, ())
    block = _node("DequantizeLinear", [scale, global_scale], f"{qw.name}.block_scale")
    codes = [data, block.outputs[0]]
    return [block, _node("DequantizeLinear", codes, out, axis=-1, block_size=qw.group_size)]


def _fp8_nodes(
    graph: ir.Graph, data: ir.Value, qw: QuantizedWeight, writer: ExternalDataWriter, out: str
) -> list[ir.Node]:
    """Per-tensor / per-row (FP8 block) scales of the FP8 codes ``data`` -> one
    DequantizeLinear (output ``out``)."""
    out_f = qw.shape[0]
    if qw.format is QuantAlgo.FP8:
        ws = qw.weight_scale.float().reshape(-1)
        shape = () if ws.numel() == 1 else (out_f,)
        scale = _stored(graph, writer, f"{qw.name}.weight_scale", ws, ir.DataType.FLOAT, shape)
        attrs = {"axis": 0} if shape else {}
        return [_node("DequantizeLinear", [data, scale], out, **attrs)]
    bo, bi = qw.block_size  # FP8_BLOCK: per-row block scales along `in`
    rows = qw.weight_scale_inv.float().repeat_interleave(bo, dim=0)[:out_f]
    rows_name = f"{qw.name}.weight_scale_inv_rows"
    scale = _stored(graph, writer, rows_name, rows, ir.DataType.FLOAT, tuple(rows.shape))
    return [_node("DequantizeLinear", [data, scale], out, axis=1, block_size=bi)]
