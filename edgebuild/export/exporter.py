"""torch -> ONNX per engine role: trace on meta weights, translate attention, stream weights.

Flow of :func:`export_graph` (used by :func:`export_base`, :func:`export_draft` and
:func:`edgebuild.export.visual.export_visual`):

1. Build the role's model on the ``meta`` device (no memory) and wrap it in its graph module
   (:mod:`edgebuild.export.graphs`).
2. ``torch.onnx.export(..., dynamo=True)`` with a custom translation table that maps
   ``edgebuild_export::paged_attention`` (the functional twin of ``edgebuild::paged_attention``,
   :mod:`edgebuild.export.plugin`) to the ``EdgebuildAttention`` plugin node, or to standard
   ops for portable graphs (:mod:`edgebuild.export.portable`). Batch, sequence, page and
   capacity axes are dynamic (``torch.export.Dim``, named after the axes in ``io()``).
3. Clean the graph for reproducible bytes: inline helper functions, drop unused nodes, and
   clear every node/value ``metadata_props`` and ``doc_string`` (the exporter records stack
   traces with file paths there).
4. Stream the weights into ``model.onnx.data`` (:mod:`edgebuild.export.weights`).
5. Record provenance in the model's ``metadata_props`` (``edgebuild.*`` keys, sorted JSON),
   save ``model.onnx`` and run ``onnx.checker.check_model(full_check=True)`` (with shape
   inference; the plugin node's schema is registered so its inputs and attributes are checked).

Graphs are opset 23 (the NVFP4 DequantizeLinear form needs it) plus the plugin's domain.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from edgebuild.checkpoint.config import ModelConfig
from edgebuild.checkpoint.draft import pair_draft
from edgebuild.checkpoint.dspark_config import DSparkConfig
from edgebuild.checkpoint.pairing import PairedSources
from edgebuild.checkpoint.source import WeightSource
from edgebuild.errors import ConfigError
from edgebuild.export.graphs import BaseGraph, DraftGraph, GraphKind, TensorSpec
from edgebuild.export.weights import (
    SHARED_NAME,
    ExternalDataWriter,
    SharedWeights,
    WeightMode,
    WeightReport,
    base_entries,
    draft_entries,
    materialize,
    rope_entry,
)

log = logging.getLogger("edgebuild.export")

OPSET = 23
ONNX_NAME, DATA_NAME = "model.onnx", "model.onnx.data"
DEFAULT_PAGE_SIZE = 32
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ExportOptions:
    """How graphs are exported.

    Attributes:
        kind: ``plugin`` (TensorRT plugin nodes, paged cache) or ``portable`` (standard ops).
        weights: ``native`` (quantized weights as DequantizeLinear chains) or ``dense``.
        dtype: activation / cache dtype name (``float32``, ``bfloat16``, ``float16``); None =
            the target config's ``torch_dtype`` (``bfloat16`` when it has none).
        page_size: rows per KV page (plugin graphs).
        rope_rows: rows of the RoPE table; None = the target's ``max_position_embeddings``.
        top_k: draft candidates per block row.
    """

    kind: GraphKind = GraphKind.PLUGIN
    weights: WeightMode = WeightMode.NATIVE
    dtype: str | None = None
    page_size: int = DEFAULT_PAGE_SIZE
    rope_rows: int | None = None
    top_k: int = 16

    def torch_dtype(self, target: ModelConfig) -> torch.dtype:
        """The graph dtype for ``target`` (see ``dtype``).

        Raises:
            ConfigError: an unsupported dtype name.
        """
        name = self.dtype or target.torch_dtype or "bfloat16"
        if name not in _DTYPES:
            raise ConfigError(
                f"export dtype {name!r} is not supported; choose one of {', '.join(_DTYPES)}"
            )
        return _DTYPES[name]

    def to_json(self) -> dict:
        return {
            "kind": self.kind.value,
            "weights": self.weights.value,
            "dtype": self.dtype,
            "page_size": self.page_size,
            "rope_rows": self.rope_rows,
            "top_k": self.top_k,
        }


@dataclass
class ExportedGraph:
    """One exported role: its files, I/O and provenance.

    Attributes:
        role: ``base``, ``draft`` or ``visual``.
        onnx_path, data_path: ``model.onnx`` and its external data file.
        inputs, outputs: engine I/O (names, dtypes, dims).
        kind: plugin or portable.
        dtype: the graph's activation dtype name.
        weights: per-initializer origin and quantized formats.
        metadata: the ``edgebuild.*`` metadata written into the model.
        shared_path: the shared external data file this graph also reads
            (:class:`~edgebuild.export.weights.SharedWeights`), or None.
    """

    role: str
    onnx_path: Path
    data_path: Path
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    kind: GraphKind
    dtype: str
    weights: WeightReport
    metadata: dict[str, str] = field(default_factory=dict)
    shared_path: Path | None = None

    def io_json(self) -> dict:
        return {
            "inputs": [s.to_json() for s in self.inputs],
            "outputs": [s.to_json() for s in self.outputs],
        }


def _translation_table(kind: GraphKind) -> dict:
    from edgebuild.export.plugin import functional_paged_attention, plugin_attention
    from edgebuild.export.portable import portable_attention

    fn = plugin_attention if kind is GraphKind.PLUGIN else portable_attention
    del functional_paged_attention  # imported to register edgebuild_export::paged_attention
    return {torch.ops.edgebuild_export.paged_attention.default: fn}


@contextmanager
def _quiet(*names: str) -> Iterator[None]:
    """Raise the given loggers to ERROR for the duration of the block."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _trace(graph: torch.nn.Module):
    """``torch.onnx.export`` of ``graph`` (meta weights) -> onnx_ir Model (weights unset)."""
    from edgebuild.export.plugin import register_onnx_schema

    if graph.kind is GraphKind.PLUGIN:
        register_onnx_schema()
    # the exporter logs "torchvision is not installed" and deprecation noise: not ours to show
    with _quiet("torch.onnx", "torch._export", "onnxscript"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            graph,
            graph.example_inputs(),
            dynamo=True,
            custom_translation_table=_translation_table(graph.kind),
            dynamic_shapes=graph.dynamic_shapes(),
            input_names=graph.input_names(),
            output_names=graph.output_names(),
            opset_version=OPSET,
            optimize=False,
            verbose=False,
            report=False,
        )
    return program.model


def _clean(model) -> None:
    """Fold constants, inline functions, drop dead nodes, clear metadata and doc strings.

    Constant folding matters for TensorRT: its parser wants e.g. ``ReduceMean`` axes as
    build-time constants, while the exporter emits them as small ``Reshape(Constant)``
    subgraphs. The (meta) weights are hidden from the folder, which must not read them.
    """
    import onnxscript.optimizer
    from onnx_ir.passes import common as passes

    from edgebuild.export.weights import meta_initializers

    hidden = {v.name: (v, v.const_value) for v in meta_initializers(model.graph)}
    for value, _ in hidden.values():
        value.const_value = None
    with _quiet("onnx_ir", "onnxscript"):  # "skipped deduplication of <weight>": expected
        onnxscript.optimizer.fold_constants(model, onnx_shape_inference=False)
    for value, tensor in hidden.values():
        value.const_value = tensor
    for p in (
        passes.InlinePass(),
        passes.RemoveUnusedNodesPass(),
        passes.RemoveUnusedFunctionsPass(),
        passes.RemoveUnusedOpsetsPass(),
        passes.ClearMetadataAndDocStringPass(),
    ):
        p(model)
    model.producer_name, model.producer_version = "edgebuild", _version()
    model.doc_string = None
    for value in model.graph.initializers.values():
        value.metadata_props.clear()


def _merge_aliases(model, aliases: dict[str, str]) -> None:
    """Point every use of an aliased initializer at the one it shares storage with."""
    import onnx_ir as ir

    inits = model.graph.initializers
    for name, target in aliases.items():
        if name in inits and target in inits:
            ir.convenience.replace_all_uses_with(inits[name], inits[target])
            inits.pop(name)
        elif name in inits:  # torch.export kept the other name of the shared parameter
            value = inits.pop(name)
            value.name = target
            model.graph.register_initializer(value)


def _version() -> str:
    from edgebuild import __version__

    return __version__


def _save(model, path: Path) -> None:
    import onnx
    import onnx_ir as ir

    proto = ir.serde.serialize_model(model)
    onnx.save_model(proto, str(path))


def export_graph(
    graph: torch.nn.Module,
    entries: dict,
    out_dir: Path,
    sources: list[WeightSource],
    metadata: dict[str, str],
    weights: WeightMode,
    on_tensor: Callable[[str, int], None] | None = None,
    aliases: dict[str, str] | None = None,
    shared: SharedWeights | None = None,
) -> ExportedGraph:
    """Export one role graph into ``out_dir`` (``model.onnx`` + ``model.onnx.data``).

    ``graph`` is a role module (:class:`BaseGraph`, :class:`DraftGraph`,
    :class:`~edgebuild.export.visual.VisualGraph`) with meta weights and the ``role`` / ``kind``
    / ``dtype`` / ``io()`` / ``example_inputs()`` / ``dynamic_shapes()`` surface; ``entries``
    maps each of its initializers to the checkpoint tensor that fills it.

    ``aliases`` maps an initializer to the one it shares storage with (a tied head:
    ``lm_head.weight`` -> ``model.embed_tokens.weight``): the graph then holds one copy.

    ``shared``: the target tensors a draft borrows. The ``base`` graph writes them into
    ``out_dir/shared.onnx.data``; another role's graph is then saved next to it, as
    ``<role>.onnx`` + ``<role>.onnx.data`` in the base's folder, and points at the same
    offsets (ONNX readers refuse external data outside a graph's folder, symbolic links and
    hard links); ``out_dir`` keeps the role's other files (config, engine).

    Raises:
        CheckpointError: a weight the graph needs is missing or mis-shaped.
        onnx.checker.ValidationError: the exported graph is invalid (a bug: please report).
    """
    import onnx

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = _trace(graph)
    _clean(model)
    _merge_aliases(model, aliases or {})
    onnx_name, data_name = ONNX_NAME, DATA_NAME
    if shared is not None and graph.role == "base":
        shared.base_dir = out_dir
    elif shared is not None and shared.tensors:  # next to the shared file (docstring)
        out_dir = shared.base_dir
        onnx_name, data_name = f"{graph.role}.onnx", f"{graph.role}.onnx.data"
    writer = ExternalDataWriter(out_dir, data_name)
    try:
        report = materialize(model, entries, writer, weights, sources, on_tensor, shared)
    finally:
        writer.close()
        if shared is not None and graph.role == "base":
            shared.close()
    shared_path = out_dir / SHARED_NAME if report.shared else None
    meta = {
        **metadata,
        "edgebuild.role": graph.role,
        "edgebuild.graph_kind": graph.kind.value,
        "edgebuild.weights": weights.value,
        "edgebuild.weight_sources": report.borrowed_json(),
        "edgebuild.quantized": json.dumps(report.quantized, sort_keys=True),
    }
    model.metadata_props.clear()
    model.metadata_props.update(dict(sorted(meta.items())))
    onnx_path = out_dir / onnx_name
    _save(model, onnx_path)
    onnx.checker.check_model(str(onnx_path), full_check=True)
    inputs, outputs = graph.io()
    return ExportedGraph(
        graph.role,
        onnx_path,
        out_dir / data_name,
        inputs,
        outputs,
        graph.kind,
        str(graph.dtype).split(".")[-1],
        report,
        meta,
        shared_path,
    )


# ----------------------------------------------------------------------------- roles
def meta_target(source: WeightSource, dtype: torch.dtype):
    """The target model on the meta device (no memory), with a tied head when it has one."""
    from edgebuild.models.llama import LlamaForCausalLM, check_tensors, expected_shapes

    cfg = ModelConfig.from_dict(source.config, source=str(source.config_path))
    check_tensors(source, cfg, expected_shapes(cfg))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(dtype)
    if "lm_head.weight" not in source:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def export_base(
    source: WeightSource,
    out_dir: Path,
    options: ExportOptions,
    tap_layers: tuple[int, ...] = (),
    on_tensor: Callable[[str, int], None] | None = None,
    shared: SharedWeights | None = None,
) -> ExportedGraph:
    """Export the target checkpoint ``source`` as the ``base`` graph.

    A vision-language target (its config has a ``vision_config``) gets the multimodal base
    graph (``image_embeds`` and ``mrope_positions`` inputs, :class:`BaseGraph` ``multimodal``);
    a text target's graph has no image input.

    Args:
        source: the target checkpoint.
        out_dir: directory for ``model.onnx`` / ``model.onnx.data``.
        options: graph kind, weight mode, dtype, page size, RoPE rows.
        tap_layers: the draft's ``target_layer_ids`` (adds ``target_hidden_states``).
        on_tensor: progress callback per weight written.
        shared: the tensors a draft will borrow (:meth:`SharedWeights.for_pair`): written into
            ``shared.onnx.data`` for the draft graph to point at.

    Raises:
        CheckpointError / ConfigError: a checkpoint that does not fit its config.
    """
    cfg = ModelConfig.from_dict(source.config, source=str(source.config_path))
    dtype = options.torch_dtype(cfg)
    model = meta_target(source, dtype)
    rows = options.rope_rows or cfg.max_position_embeddings
    multimodal = cfg.vision_config is not None
    graph = BaseGraph(model, tap_layers, options.kind, options.page_size, rows, multimodal)
    tied = "lm_head.weight" not in source
    entries = base_entries(source, tied)
    entries[rope_entry(graph.rotary_dim, rows, cfg.rope).name] = rope_entry(
        graph.rotary_dim, rows, cfg.rope
    )
    meta = {
        "edgebuild.tap_layers": json.dumps(list(tap_layers)),
        "edgebuild.tie_word_embeddings": json.dumps(tied),
        "edgebuild.page_size": str(options.page_size),
    }
    if multimodal:  # text graphs keep their metadata as it was
        meta["edgebuild.multimodal"] = "true"
    aliases = {"lm_head.weight": "model.embed_tokens.weight"} if tied else {}
    return export_graph(
        graph, entries, out_dir, [source], meta, options.weights, on_tensor, aliases, shared
    )


def meta_draft(config: DSparkConfig, dtype: torch.dtype):
    """The DSpark draft of a validated config (:func:`~edgebuild.checkpoint.draft.pair_draft`)
    on the meta device."""
    from edgebuild.models.dspark import DSparkDraft

    with torch.device("meta"):
        model = DSparkDraft(config).to(dtype)
    return model.eval()


def export_draft(
    pair: PairedSources,
    target_cfg: ModelConfig,
    out_dir: Path,
    options: ExportOptions,
    on_tensor: Callable[[str, int], None] | None = None,
    *,
    config: DSparkConfig | None = None,
    shared: SharedWeights | None = None,
) -> ExportedGraph:
    """Export the DSpark draft of ``pair`` as the ``draft`` graph.

    The borrowed ``lm_head`` / ``embed_tokens`` are recorded with ``checkpoint_source``
    ``"target"`` in ``edgebuild.weight_sources`` and ``edgebuild.lm_head_source``. When both
    resolve to the same tensor (a tied target), the graph holds it once, as
    ``embed_tokens.weight``. ``config``: the draft's config when the pair was already
    validated by :func:`~edgebuild.checkpoint.draft.pair_draft` (``edgebuild build``);
    without it, the pair is validated here. ``shared``: what :func:`export_base` wrote for
    this pair; the borrowed tensors are then not copied but read from ``shared.onnx.data``,
    a hard link of the base's file (NVFP4 stays NVFP4: the same codes and scales).

    Raises:
        ConfigError / PairingError / CheckpointError: from ``pair_draft`` (pairing, taps, mask
            id, heads, fc width, missing or mis-shaped tensors); an rnn head.
    """
    if config is None:
        config = pair_draft(pair.target, pair.draft, target_cfg).config
    dtype = options.torch_dtype(target_cfg)
    model = meta_draft(config, dtype)
    cfg = model.config
    rows = options.rope_rows or target_cfg.max_position_embeddings
    graph = DraftGraph(model, options.kind, options.page_size, rows, options.top_k)
    entries = draft_entries(pair)
    rope = rope_entry(cfg.head_dim, rows, cfg.rope)
    entries[rope.name] = rope
    head, embed = pair.lm_head(), pair.embed_tokens()
    meta = {
        "edgebuild.lm_head_source": head.checkpoint_source,
        "edgebuild.embed_tokens_source": embed.checkpoint_source,
        "edgebuild.top_k": str(graph.top_k),
        "edgebuild.page_size": str(options.page_size),
        "edgebuild.dspark": json.dumps(dspark_fields(cfg), sort_keys=True),
    }
    sources = [pair.draft, pair.target]
    # a tied target gives one tensor as both head and embedding: store it once, as the base
    # graph does (the Gather and the head's MatMul read the same initializer)
    same = (head.checkpoint_source, head.file, head.name) == (
        embed.checkpoint_source,
        embed.file,
        embed.name,
    )
    aliases = {"lm_head.weight": "embed_tokens.weight"} if same else {}
    return export_graph(
        graph, entries, out_dir, sources, meta, options.weights, on_tensor, aliases, shared
    )


def dspark_fields(cfg) -> dict:
    """The DSpark facts a runtime needs (bundle manifest and graph metadata)."""
    return {
        "block_size": cfg.block_size,
        "target_layer_ids": list(cfg.target_layer_ids),
        "mask_token_id": cfg.mask_token_id,
        "markov_rank": cfg.markov_rank,
        "markov_head_type": cfg.markov_head_type if cfg.markov_rank else None,
        "enable_confidence_head": cfg.enable_confidence_head,
        "confidence_head_with_markov": cfg.confidence_head_with_markov,
        "packaging": cfg.packaging.value,
    }
