"""ONNX -> serialized TensorRT engines (TensorRT imported lazily).

Public API: :func:`build_engine`, :func:`profiles`, :func:`axis_ranges`,
:func:`visual_axis_ranges` + :class:`VisualGeometry` (the ``visual`` role), :func:`load_tensorrt`, :func:`check_device_formats`, :data:`ENGINE_NAME`, :data:`BUILDERS`.
"""

from edgebuild.engine.builder import (
    BUILDERS,
    ENGINE_NAME,
    EngineReport,
    VisualGeometry,
    axis_ranges,
    build_engine,
    check_device_formats,
    check_local_device,
    load_tensorrt,
    local_sm,
    profiles,
    visual_axis_ranges,
)

__all__ = [
    "BUILDERS",
    "ENGINE_NAME",
    "EngineReport",
    "VisualGeometry",
    "axis_ranges",
    "build_engine",
    "check_device_formats",
    "check_local_device",
    "load_tensorrt",
    "local_sm",
    "profiles",
    "visual_axis_ranges",
]
