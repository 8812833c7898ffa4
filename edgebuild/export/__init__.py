"""torch -> ONNX per engine role (``base``, ``draft``, ``visual``), with the attention plugin node.

Public API: :func:`export_base`, :func:`export_draft`, :func:`export_visual` (the vision tower
of a VLM, :mod:`edgebuild.export.visual`), :class:`ExportOptions`,
:class:`GraphKind` (plugin / portable), :class:`WeightMode` (native / dense),
:class:`ExportedGraph`, :class:`SharedWeights` (the target tensors a draft borrows, stored
once). See :mod:`edgebuild.export.exporter` for the flow,
:mod:`edgebuild.export.graphs` for each role's inputs and outputs,
:mod:`edgebuild.export.plugin` for the plugin node and :mod:`edgebuild.export.portable` for
the standard-op attention of portable graphs.
"""

from edgebuild.export.exporter import (
    DATA_NAME,
    ONNX_NAME,
    ExportedGraph,
    ExportOptions,
    dspark_fields,
    export_base,
    export_draft,
)
from edgebuild.export.graphs import GraphKind, TensorSpec
from edgebuild.export.visual import export_visual, vision_fields
from edgebuild.export.weights import SHARED_NAME, SharedWeights, WeightMode

__all__ = [
    "DATA_NAME",
    "ONNX_NAME",
    "SHARED_NAME",
    "ExportOptions",
    "ExportedGraph",
    "GraphKind",
    "SharedWeights",
    "TensorSpec",
    "WeightMode",
    "dspark_fields",
    "export_base",
    "export_draft",
    "export_visual",
    "vision_fields",
]
