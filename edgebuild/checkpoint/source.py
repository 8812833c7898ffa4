"""`WeightSource`: one checkpoint directory opened lazily, every tensor tagged with its origin.

Reads `config.json`, `hf_quant_config.json`, and weights from `model.safetensors`, a sharded
`model.safetensors.index.json`, or PyTorch `pytorch_model.bin` (+ index), the latter loaded with
`torch.load(weights_only=True)`. Safetensors files are opened with `safe_open` (memory-mapped),
so building never holds the whole model in RAM. Every header is checked up front (truncation,
offsets, dtypes, index vs shards) so that a broken file fails before any build work, with a
message that names the file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from edgebuild.checkpoint.config import read_json
from edgebuild.checkpoint.quant import (
    QuantConfig,
    QuantizedWeight,
    build_linear_weight,
    load_quant_config,
)
from edgebuild.errors import CheckpointError, unreadable

log = logging.getLogger("edgebuild.checkpoint")

COMPONENT = "component"
TARGET = "target"

# safetensors dtype tag -> (torch dtype, bytes per element)
_ST_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
}


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives, read from file headers without loading data.

    `dtype` is a torch dtype; `shape` a tuple; `file` the path that holds it;
    `checkpoint_source` is "component" (the checkpoint being built) or "target" (the paired
    target opened as a second source for a draft).
    """

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    checkpoint_source: str

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def read_safetensors_header_bytes(path: Path) -> bytes:
    """The raw header of a safetensors file (its 8-byte length and JSON), unparsed: a cheap
    identity of the file's tensors (names, dtypes, shapes, offsets) for cache keys.

    Raises:
        CheckpointError: a file too short to hold its declared header.
    """
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        body = f.read(n) if 0 <= n <= 100_000_000 else b""
    if n < 0 or len(body) != n:
        raise CheckpointError(f"{path}: truncated safetensors header; re-download the file")
    return head + body


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """Parse and check a safetensors header; returns {name: {dtype, shape, data_offsets}}.

    Raises:
        CheckpointError: truncated file, malformed header JSON, unknown dtype, or offsets
            that do not match the dtype/shape or run past the end of the file.
    """
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes); re-download it")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8 or n > 100_000_000:
            raise CheckpointError(
                f"{path}: corrupt safetensors header (declares {n} header bytes, file has "
                f"{size}); the file is truncated or not safetensors — re-download it"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not an object)")
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        try:
            dtype_tag, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt header entry for tensor '{name}'") from None
        if not (
            isinstance(dtype_tag, str)
            and isinstance(shape, list)
            and all(_is_count(d) for d in shape)
            and _is_count(start)
            and _is_count(end)
        ):
            raise CheckpointError(
                f"{path}: corrupt header entry for tensor '{name}' (dtype {dtype_tag!r}, shape "
                f"{shape!r}, data_offsets {[start, end]!r}); the file is corrupt"
            )
        if dtype_tag not in _ST_DTYPES:
            raise CheckpointError(
                f"{path}: tensor '{name}' has unsupported dtype {dtype_tag}; "
                f"supported: {', '.join(_ST_DTYPES)}"
            )
        numel = 1
        for d in shape:
            numel *= d
        if end - start != numel * _ST_DTYPES[dtype_tag][1] or start < 0:
            raise CheckpointError(
                f"{path}: tensor '{name}' offsets {start}..{end} do not fit its dtype "
                f"{dtype_tag} and shape {shape}; the file is corrupt"
            )
        if end > data_size:
            raise CheckpointError(
                f"{path}: tensor '{name}' ends at byte {end} but the file holds {data_size} "
                "data bytes: the file is truncated — re-download or re-export it"
            )
        spans.append((start, end, name))
    prev_end, prev_name = 0, None
    for start, end, name in sorted(spans):
        if start != prev_end:
            after = f"'{prev_name}' ends" if prev_name else "the data starts"
            raise CheckpointError(
                f"{path}: tensor '{name}' starts at byte {start} but {after} at byte {prev_end} "
                "(overlapping or non-contiguous data offsets); the file is corrupt"
            )
        prev_end, prev_name = end, name
    return header


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _torch_load_reason(exc: Exception) -> str:
    """The useful part of a torch.load failure (not its advice to set weights_only=False)."""
    text = str(exc)
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = text.split(marker, 1)[1].split("Check the documentation", 1)[0]
    text = " ".join(text.split())
    return text[:300] or type(exc).__name__


class WeightSource:
    """One checkpoint directory: config, quant config and lazily read tensors.

    Args:
        path: directory holding `config.json` and weights.
        checkpoint_source: "component" for the checkpoint being built, "target" for a
            draft's paired target opened as a second source.

    Raises:
        CheckpointError: missing directory/config/weights, corrupt or truncated files, an
            index naming a missing shard or a tensor its shard lacks, a folder or file this
            user cannot read (the message names it and the permission fix).
        QuantFormatError: an unsupported or malformed quantization config.
    """

    def __init__(self, path: str | Path, checkpoint_source: str = COMPONENT):
        self.path = Path(path)
        if checkpoint_source not in (COMPONENT, TARGET):
            raise ValueError("checkpoint_source must be 'component' or 'target'")
        self.checkpoint_source = checkpoint_source
        self.config_path = self.path / "config.json"
        self._infos: dict[str, TensorInfo] = {}
        self._handles: dict[Path, object] = {}
        self._bin_cache: dict[Path, dict[str, torch.Tensor]] = {}
        try:  # an unreadable folder / file: a CheckpointError naming it and the fix
            if not self.path.is_dir():
                raise CheckpointError(f"{self.path}: checkpoint directory not found")
            self.config: dict = read_json(self.config_path)
            self.quant: QuantConfig = load_quant_config(self.path, self.config)
            self._index_files()
        except OSError as exc:
            raise unreadable(exc, self.path) from None

    # ---------------------------------------------------------------- discovery
    def _index_files(self) -> None:
        st_index = self.path / "model.safetensors.index.json"
        bin_index = self.path / "pytorch_model.bin.index.json"
        if st_index.is_file():
            self._index_sharded(st_index, safetensors=True)
        elif (self.path / "model.safetensors").is_file():
            self._add_safetensors(self.path / "model.safetensors")
        elif bin_index.is_file():
            self._index_sharded(bin_index, safetensors=False)
        elif (self.path / "pytorch_model.bin").is_file():
            self._add_bin(self.path / "pytorch_model.bin")
        else:
            loose = sorted(f for f in self.path.glob("*.safetensors") if f.is_file())
            if not loose:
                raise CheckpointError(
                    f"{self.path}: no weights found (expected model.safetensors, "
                    "model.safetensors.index.json, pytorch_model.bin or *.safetensors)"
                )
            for f in loose:
                self._add_safetensors(f)

    def _index_sharded(self, index_path: Path, safetensors: bool) -> None:
        index = read_json(index_path, "weight index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: missing or empty 'weight_map'")
        bad = next((k for k, v in weight_map.items() if not isinstance(v, str) or not v), None)
        if bad is not None:
            raise CheckpointError(
                f"{index_path}: 'weight_map' maps tensor '{bad}' to {weight_map[bad]!r}, "
                "not a shard file name; the index is corrupt"
            )
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            shard_path = self.path / shard
            if not shard_path.is_file():
                raise CheckpointError(
                    f"{index_path}: names shard '{shard}' which is missing from {self.path}"
                )
            if safetensors:
                self._add_safetensors(shard_path)
            else:
                self._add_bin(shard_path)
        for name, shard in weight_map.items():
            info = self._infos.get(name)
            if info is None or info.file.name != Path(shard).name:
                raise CheckpointError(
                    f"{index_path}: maps tensor '{name}' to '{shard}', but that shard does "
                    "not contain it; the index and shards are out of sync"
                )

    def _add_safetensors(self, file: Path) -> None:
        for name, entry in read_safetensors_header(file).items():
            self._add_info(
                TensorInfo(
                    name,
                    file,
                    _ST_DTYPES[entry["dtype"]][0],
                    tuple(entry["shape"]),
                    self.checkpoint_source,
                )
            )

    def _add_bin(self, file: Path) -> None:
        try:
            try:
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # legacy (non-zip) format cannot be memory-mapped
                state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unpickling failure is a bad file
            raise CheckpointError(
                f"{file}: cannot load PyTorch checkpoint with weights_only=True "
                f"({_torch_load_reason(exc)}); the file is corrupt or holds more than tensors "
                "- convert it to safetensors or re-download it"
            ) from None
        if not isinstance(state, dict):
            raise CheckpointError(f"{file}: expected a state dict, got {type(state).__name__}")
        self._bin_cache[file] = state
        for name, t in state.items():
            if isinstance(t, torch.Tensor):
                self._add_info(
                    TensorInfo(name, file, t.dtype, tuple(t.shape), self.checkpoint_source)
                )

    def _add_info(self, info: TensorInfo) -> None:
        prev = self._infos.get(info.name)
        if prev is not None and prev.file != info.file:
            raise CheckpointError(
                f"{self.path}: tensor '{info.name}' appears in both {prev.file.name} and "
                f"{info.file.name}"
            )
        self._infos[info.name] = info

    # ---------------------------------------------------------------- access
    def names(self) -> list[str]:
        """All tensor names, sorted."""
        return sorted(self._infos)

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def info(self, name: str) -> TensorInfo:
        """Header information of `name`; raises CheckpointError naming the directory."""
        try:
            return self._infos[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: tensor '{name}' not found") from None

    def get(self, name: str) -> torch.Tensor:
        """Load one tensor (memory-mapped for safetensors). Shape/dtype as stored."""
        info = self.info(name)
        if info.file in self._bin_cache:
            return self._bin_cache[info.file][name]
        handle = self._handles.get(info.file)
        if handle is None:
            from safetensors import safe_open

            try:
                handle = safe_open(str(info.file), framework="pt", device="cpu")
            except Exception as exc:  # noqa: BLE001
                raise CheckpointError(f"{info.file}: cannot open safetensors ({exc})") from None
            self._handles[info.file] = handle
        try:
            return handle.get_tensor(name)
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"{info.file}: cannot read tensor '{name}' ({exc})") from None

    def maybe(self, name: str) -> torch.Tensor | None:
        """`get(name)` or None when absent."""
        return self.get(name) if name in self._infos else None

    def linear(self, prefix: str) -> torch.Tensor | QuantizedWeight:
        """The weight of linear `prefix` (e.g. `model.layers.0.mlp.down_proj`).

        Returns a dense tensor [out, in] as stored, or a QuantizedWeight (NVFP4/FP8) whose
        format is decided by the tensors present (see quant.build_linear_weight).
        """
        name = f"{prefix}.weight"
        info = self.info(name)
        return build_linear_weight(
            prefix,
            self.maybe,
            self.quant,
            checkpoint_source=self.checkpoint_source,
            file=str(info.file),
        )

    def as_source(self, checkpoint_source: str) -> WeightSource:
        """This checkpoint tagged ``checkpoint_source`` ("component" / "target"), without
        re-reading its files: the view shares the config, quant config, headers and open
        handles (e.g. a target the runtime opened that also lends a draft its head).
        """
        if checkpoint_source not in (COMPONENT, TARGET):
            raise ValueError("checkpoint_source must be 'component' or 'target'")
        view = object.__new__(WeightSource)
        view.__dict__.update(self.__dict__)
        view.checkpoint_source = checkpoint_source
        view._infos = {
            n: dataclasses.replace(i, checkpoint_source=checkpoint_source)
            for n, i in self._infos.items()
        }
        return view

    def total_bytes(self) -> int:
        """Bytes of all tensors as stored."""
        return sum(i.nbytes for i in self._infos.values())

    def close(self) -> None:
        """Drop file handles (memory maps)."""
        self._handles.clear()
        self._bin_cache.clear()

    def __repr__(self) -> str:
        return (
            f"WeightSource({str(self.path)!r}, {self.checkpoint_source}, "
            f"{len(self._infos)} tensors, quant={self.quant.algo.value})"
        )
