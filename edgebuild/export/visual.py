"""The ``visual`` engine role: the Qwen2.5-VL vision tower as a standard-op ONNX graph.

The vision phase has no KV cache, so the graph needs no plugin: patch embedding (MatMul),
2-D RoPE from a per-patch cos/sin input, segment attention (Gather / MatMul / Where /
Softmax) and the merger. Everything that depends on the image grids is computed on the host
by :class:`edgebuild.models.vision.VisionPlan` and fed as graph inputs (``io()`` below), so
one engine serves any number and size of images within its optimization profile.

Bundle layout written by :func:`export_visual` (the ``visual/`` role directory):
``model.onnx`` + ``model.onnx.data`` (weights as ONNX external data, checkpoint names
``visual.*``), ``config.json`` (the checkpoint's ``vision_config`` plus the image token ids
the runtime needs) and ``preprocessor_config.json`` (copied when the checkpoint has one).

Status: standalone exporter (real weights loaded in memory, fp32/bf16/fp16). Not yet wired
into the role machinery of :mod:`edgebuild.export.exporter` (meta-weight tracing and
streamed external data) nor into the bundle manifest; :class:`VisualGraph` has the same
``role`` / ``kind`` / ``io()`` / ``example_inputs()`` / ``dynamic_shapes()`` surface as the
other role graphs so that wiring is mechanical.
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from edgebuild.checkpoint.source import WeightSource
from edgebuild.export.graphs import GraphKind, TensorSpec
from edgebuild.models.vision import VISION_PREFIX, Segments, VisionPlan, VisionTower

log = logging.getLogger("edgebuild.export")

ONNX_NAME, DATA_NAME, CONFIG_NAME = "model.onnx", "model.onnx.data", "config.json"
OPSET = 23
# example sizes for tracing: dynamic axes must not be 0 or 1 and distinct axes must differ
_EXAMPLE = {"tokens": 6}


class VisualGraph(nn.Module):
    """The vision tower with its plan as explicit inputs (role ``visual``, standard ops).

    Parameter names are the checkpoint's (``visual.*``).

    Args:
        tower: a loaded :class:`VisionTower` (its dtype is the graph dtype).
    """

    role = "visual"
    kind = GraphKind.PORTABLE

    def __init__(self, tower: VisionTower):
        super().__init__()
        self.visual = tower
        self.config = tower.config
        self.dtype = next(tower.parameters()).dtype

    def io(self) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """Engine inputs and outputs (``patches`` = merge_unit x ``tokens``, 4 for 2x2)."""
        cfg, i64 = self.config, torch.int64
        patches = "patches"
        inputs = [
            TensorSpec("pixel_values", self.dtype, (patches, cfg.patch_dim)),
            TensorSpec("patch_order", i64, (patches,)),
            TensorSpec("rope_cos_sin", torch.float32, (patches, cfg.head_dim)),
            TensorSpec("full_index", i64, ("full_segments", "full_len")),
            TensorSpec("full_valid", torch.bool, ("full_segments", "full_len")),
            TensorSpec("full_slot", i64, (patches,)),
            TensorSpec("window_index", i64, ("windows", "window_len")),
            TensorSpec("window_valid", torch.bool, ("windows", "window_len")),
            TensorSpec("window_slot", i64, (patches,)),
            TensorSpec("merge_order", i64, ("tokens",)),
        ]
        outputs = [TensorSpec("image_embeds", self.dtype, ("tokens", cfg.out_hidden_size))]
        return inputs, outputs

    def input_names(self) -> list[str]:
        return [s.name for s in self.io()[0]]

    def output_names(self) -> list[str]:
        return [s.name for s in self.io()[1]]

    def example_inputs(self) -> tuple[Tensor, ...]:
        """A consistent plan for tracing: 24 patches, 6 tokens, segments 16+8 and 20+2+2.

        Dynamic axes get distinct sizes > 1 (``torch.export`` specializes 0 / 1 and equal
        sizes would look related).
        """
        patches = self.config.merge_unit * _EXAMPLE["tokens"]
        full = Segments.from_lengths([16, patches - 16])  # [2, 16]
        windows = Segments.from_lengths([20, 2, patches - 22])  # [3, 20]
        pixels = torch.zeros(patches, self.config.patch_dim, dtype=self.dtype)
        rope = torch.zeros(patches, self.config.head_dim)
        return (
            pixels,
            torch.arange(patches),
            rope,
            full.index,
            full.valid,
            full.slot,
            windows.index,
            windows.valid,
            windows.slot,
            torch.arange(_EXAMPLE["tokens"]),
        )

    def dynamic_shapes(self) -> tuple[tuple[dict, ...]]:
        """One ``Dim`` per named axis; the patch axis is ``merge_unit * tokens``."""
        tokens = torch.export.Dim("tokens", min=1)
        dims: dict[str, object] = {"tokens": tokens, "patches": self.config.merge_unit * tokens}
        out = []
        for spec in self.io()[0]:
            entry = {}
            for i, d in enumerate(spec.dims):
                if isinstance(d, str):
                    if d not in dims:
                        dims[d] = torch.export.Dim(d, min=1)
                    entry[i] = dims[d]
            out.append(entry)
        return (tuple(out),)

    def forward(self, *flat: Tensor) -> Tensor:
        named = dict(zip(self.input_names(), flat, strict=True))
        full = Segments(named["full_index"], named["full_valid"], named["full_slot"])
        windows = Segments(named["window_index"], named["window_valid"], named["window_slot"])
        return self.visual.run(
            named["pixel_values"],
            named["patch_order"],
            named["rope_cos_sin"],
            full,
            windows,
            named["merge_order"],
        )


def plan_inputs(plan: VisionPlan, pixel_values: Tensor) -> dict[str, Tensor]:
    """The engine's input tensors (name -> tensor) for one vision pass."""
    return {
        "pixel_values": pixel_values,
        "patch_order": plan.patch_order,
        "rope_cos_sin": plan.rope,
        "full_index": plan.full.index,
        "full_valid": plan.full.valid,
        "full_slot": plan.full.slot,
        "window_index": plan.windows.index,
        "window_valid": plan.windows.valid,
        "window_slot": plan.windows.slot,
        "merge_order": plan.merge_order,
    }


def export_visual(source: WeightSource, out_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Export the ``visual.*`` tower of a VLM checkpoint into the role directory ``out_dir``.

    Args:
        source: the VLM checkpoint.
        out_dir: the bundle's ``visual/`` directory (created).
        dtype: graph dtype (weights and activations; softmax and RoPE stay fp32).

    Returns:
        the path of ``model.onnx``.

    Raises:
        ConfigError / CheckpointError: no or bad ``vision_config``, missing / mis-shaped
            ``visual.*`` tensors.
        MissingDependencyError: onnx / onnxscript are not installed (``pip install
            edgebuild[export]``).
    """
    from edgebuild.errors import MissingDependencyError

    try:
        import onnx
    except ImportError as exc:
        raise MissingDependencyError("ONNX export needs: pip install 'edgebuild[export]'") from exc
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    graph = VisualGraph(VisionTower.from_source(source, dtype)).eval()
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            graph,
            graph.example_inputs(),
            dynamo=True,
            dynamic_shapes=graph.dynamic_shapes(),
            input_names=graph.input_names(),
            output_names=graph.output_names(),
            opset_version=OPSET,
            optimize=False,  # no fused RMSNormalization etc.: plain ops for any parser
            verbose=False,
            report=False,
        )
    onnx_path = out_dir / ONNX_NAME
    for stale in (onnx_path, out_dir / DATA_NAME):
        stale.unlink(missing_ok=True)
    program.save(str(onnx_path), external_data=True)
    _rename_external_data(onnx_path)
    onnx.checker.check_model(str(onnx_path), full_check=True)
    _write_config(source, graph, out_dir)
    return onnx_path


def _rename_external_data(onnx_path: Path) -> None:
    """Point every external initializer at ``model.onnx.data`` (torch names it by the model)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=True)
    for stale in onnx_path.parent.glob(onnx_path.name + ".*"):
        stale.unlink()
    onnx.save_model(
        model,
        str(onnx_path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=DATA_NAME,
        size_threshold=1024,
    )


def _write_config(source: WeightSource, graph: VisualGraph, out_dir: Path) -> None:
    cfg = graph.config
    inputs, outputs = graph.io()
    config = {
        "role": graph.role,
        "vision_config": source.config["vision_config"],
        "image_token_id": cfg.image_token_id,
        "vision_start_token_id": cfg.vision_start_token_id,
        "vision_end_token_id": cfg.vision_end_token_id,
        "weight_prefix": VISION_PREFIX,
        "dtype": str(graph.dtype).split(".")[-1],
        "inputs": [s.to_json() for s in inputs],
        "outputs": [s.to_json() for s in outputs],
    }
    (out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True))
    pre = Path(source.path) / "preprocessor_config.json"
    if pre.is_file():
        shutil.copyfile(pre, out_dir / pre.name)
