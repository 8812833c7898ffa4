"""The ``visual`` engine role: the Qwen2.5-VL vision tower as a standard-op ONNX graph.

The vision phase has no KV cache, so the graph needs no plugin, whatever the build's graph
kind: patch embedding (MatMul), 2-D RoPE from a per-patch cos/sin input, segment attention
(Gather / MatMul / Where / Softmax) and the merger. Everything that depends on the image grids
is computed on the host by :class:`edgebuild.models.vision.VisionPlan` and fed as graph inputs
(:meth:`VisualGraph.io`, :func:`plan_inputs`), so one engine serves any number and size of
images within its optimization profile (:func:`edgebuild.engine.visual_axis_ranges`, from the
recipe's ``build.max_image_tokens`` / ``build.max_images``).

:func:`export_visual` goes through the same role machinery as ``base`` and ``draft``
(:func:`edgebuild.export.exporter.export_graph`): the tower is traced on meta weights, the
graph is cleaned, and the ``visual.*`` tensors are streamed one at a time from the
:class:`~edgebuild.checkpoint.source.WeightSource` into ``model.onnx.data`` (quantized linears
as DequantizeLinear chains or dequantized, as the build's weight mode says).

``edgebuild build`` exports this role automatically when the target checkpoint is a VLM (its
config has a ``vision_config``), into the bundle's ``visual/`` directory:
``model.onnx`` + ``model.onnx.data`` (weights as ONNX external data, checkpoint names
``visual.*``), ``config.json`` (the checkpoint's ``vision_config``, the image token ids the
runtime needs, the graph's dtype and I/O), ``preprocessor_config.json`` (copied when the
checkpoint has one) and ``model.engine`` when engines are built. The manifest's
``roles.visual`` records these files, the I/O and :func:`vision_fields`; every file is hashed
in ``files`` like the other roles' (``edgebuild verify`` re-checks them).

At run time the TensorRT backend runs this engine once per request
(:class:`edgebuild.runtime.trt_backend.TrtVisual`, inputs from
:meth:`VisionPlan.engine_inputs`); its ``image_embeds`` rows become the rows of the VLM base
graph's ``image_embeds`` input, selected by the prompt's image pad rows (ids ``vocab_size +
k``, :class:`edgebuild.export.graphs.BaseGraph` ``multimodal``). That chain is checked on the
CPU with stand-in engines (``tests/test_trt_vlm.py``), not yet on real TensorRT engines.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from edgebuild.checkpoint.config import ModelConfig
from edgebuild.checkpoint.source import WeightSource
from edgebuild.errors import ConfigError
from edgebuild.export.exporter import ExportedGraph, ExportOptions, export_graph
from edgebuild.export.graphs import GraphKind, TensorSpec
from edgebuild.export.weights import visual_entries
from edgebuild.models.vision import (
    VISION_PREFIX,
    Segments,
    VisionConfig,
    VisionPlan,
    VisionTower,
    check_vision_tensors,
)

ROLE = "visual"
CONFIG_NAME, PREPROCESSOR_NAME = "config.json", "preprocessor_config.json"
# example sizes for tracing: dynamic axes must not be 0 or 1 and distinct axes must differ
_EXAMPLE = {"tokens": 6}


class VisualGraph(nn.Module):
    """The vision tower with its plan as explicit inputs (role ``visual``, standard ops).

    Parameter names are the checkpoint's (``visual.*``).

    Args:
        tower: a :class:`VisionTower`, loaded or on the ``meta`` device (for export); its
            dtype is the graph dtype.
    """

    role = ROLE
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
        flat = (
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
        device = next(self.visual.parameters()).device  # meta when traced for export
        return tuple(t.to(device) for t in flat)

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
    """The engine's input tensors (name -> tensor) for one vision pass.

    The same as :meth:`VisionPlan.engine_inputs` (which the TensorRT runtime uses: the runtime
    does not import the exporter); kept here beside :meth:`VisualGraph.io` that names them.

    Args:
        plan: the host plan of the pass (:meth:`VisionPlan.build` over the images' grids).
        pixel_values: ``[N, patch_dim]`` patch rows of all images, in the graph's dtype
            (:mod:`edgebuild.models.image_processing` order).
    """
    return plan.engine_inputs(pixel_values)


def vision_fields(cfg: VisionConfig) -> dict:
    """The vision facts a runtime and the engine builder need (manifest ``roles.visual.vision``
    and graph metadata): patch geometry, merge unit, window size in tokens, image token ids."""
    return {
        "patch_size": cfg.patch_size,
        "temporal_patch_size": cfg.temporal_patch_size,
        "spatial_merge_size": cfg.spatial_merge_size,
        "merge_unit": cfg.merge_unit,
        "window_tokens": cfg.window_tokens,
        "patch_dim": cfg.patch_dim,
        "out_hidden_size": cfg.out_hidden_size,
        "image_token_id": cfg.image_token_id,
        "vision_start_token_id": cfg.vision_start_token_id,
        "vision_end_token_id": cfg.vision_end_token_id,
    }


def meta_visual(source: WeightSource, dtype: torch.dtype) -> VisionTower:
    """The vision tower of a VLM checkpoint on the meta device (no memory), tensors checked.

    Raises:
        ConfigError: no or a bad ``vision_config``.
        CheckpointError: a missing, unexpected or mis-shaped ``visual.*`` tensor.
    """
    cfg = VisionConfig.from_model_config(source.config, str(source.config_path))
    check_vision_tensors(source, cfg)
    with torch.device("meta"):
        tower = VisionTower(cfg).to(dtype)
    return tower.eval()


def export_visual(
    source: WeightSource,
    out_dir: Path,
    options: ExportOptions | None = None,
    on_tensor: Callable[[str, int], None] | None = None,
) -> ExportedGraph:
    """Export the ``visual.*`` tower of a VLM checkpoint into the role directory ``out_dir``.

    Args:
        source: the VLM checkpoint (the build's target).
        out_dir: the bundle's ``visual/`` directory (created).
        options: the build's export options; only ``dtype`` (graph dtype of weights and
            activations; softmax and RoPE stay fp32; None = the checkpoint's ``torch_dtype``)
            and ``weights`` (quantized linears native or dense) apply: the graph is always
            portable (no plugin). Default: :class:`ExportOptions` ().
        on_tensor: progress callback ``(name, bytes)`` per weight written.

    Returns:
        the exported role (``role`` = ``visual``, ``kind`` = portable); its ``metadata`` holds
        ``edgebuild.vision`` (:func:`vision_fields` as JSON).

    Raises:
        ConfigError: not a VLM checkpoint (no ``vision_config``), a bad ``vision_config``, an
            unsupported dtype.
        CheckpointError: missing / unexpected / mis-shaped ``visual.*`` tensors.
        MissingDependencyError: onnx / onnxscript are not installed (``pip install
            'edgebuild[export]'``).
    """
    options = options or ExportOptions()
    target = ModelConfig.from_dict(source.config, source=str(source.config_path))
    if target.vision_config is None:
        raise ConfigError(
            f"{source.config_path}: no 'vision_config'; only a vision-language checkpoint has "
            "a visual role"
        )
    graph = VisualGraph(meta_visual(source, options.torch_dtype(target)))
    meta = {"edgebuild.vision": json.dumps(vision_fields(graph.config), sort_keys=True)}
    entries = visual_entries(source, VISION_PREFIX)
    exported = export_graph(graph, entries, out_dir, [source], meta, options.weights, on_tensor)
    _write_config(source, graph, Path(out_dir))
    return exported


def _write_config(source: WeightSource, graph: VisualGraph, out_dir: Path) -> None:
    """``config.json`` (vision_config, token ids, dtype, I/O) and the preprocessor config."""
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
    (out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    pre = Path(source.path) / PREPROCESSOR_NAME
    if pre.is_file():
        shutil.copyfile(pre, out_dir / PREPROCESSOR_NAME)
