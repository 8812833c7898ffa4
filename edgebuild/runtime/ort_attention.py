"""The ``EdgebuildAttention`` plugin node executed in onnxruntime by the plugin's own host code.

The TensorRT plugin's computation has a host (CPU) build, ``plugins/src/attention_host.cpp``
(the file the C++ harness and tests/test_plugin_host.py run). This module

* compiles it with g++ once per source content into ``plugins/build/ort_host/`` (git-ignored;
  :func:`host_library`) and loads it with ctypes;
* registers a Python custom op with ``onnxruntime-extensions`` (:func:`register_attention_op`)
  whose body reads the node's attributes by the plugin's field names and its inputs in the
  plugin's order (``plugins/contract.json``), fills the plugin's ``EbAttentionParams`` and calls
  ``eb_host_paged_attention``: ``attn_out`` and ``present_kv_cache``. TensorRT aliases
  ``present_kv_cache`` to the input pool; here the runner binds its pools for the run
  (:func:`bound_pools`) and the host code writes into the pool itself, the output being a
  stub; an unbound node returns a copy of the input cache with this call's writes, which
  the runner copies into the pool.

Why a Python custom op and not a compiled onnxruntime custom-op library: building one needs
the C API header of the pinned onnxruntime release, which the Python wheel does not ship.
onnxruntime-extensions registers Python ops in its own domain (``ai.onnx.contrib``) with a
fixed input list, so :func:`session_model` re-targets the plugin nodes *in memory* (domain
``edgebuild`` -> ``ai.onnx.contrib``; op type ``EdgebuildAttention`` with 7 inputs, or
``EdgebuildAttentionQkNorm`` with the two norm gammas); the file on disk is never changed.
Only float32 graphs run (onnxruntime's CPU provider has no bfloat16 MatMul; the custom op's
declared types are float32).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from edgebuild.errors import EngineError, MissingDependencyError

_ROOT = Path(__file__).resolve().parents[2]
_PLUGINS = _ROOT / "plugins"
HOST_SOURCE = _PLUGINS / "src" / "attention_host.cpp"
HOST_HEADERS = ("attention_host.h", "attention_math.h", "attention_params.h", "numeric.h")
# -ffp-contract=off: no fused multiply-add (the plugin's RoPE / norm bits), as the harness
HOST_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-ffp-contract=off", "-fvisibility=hidden")
BUILD_DIR = _PLUGINS / "build" / "ort_host"
PLUGIN_DOMAIN, ORT_DOMAIN = "edgebuild", "ai.onnx.contrib"
OP_TYPE, OP_TYPE_QK_NORM = "EdgebuildAttention", "EdgebuildAttentionQkNorm"
EB_FLOAT32 = 0

# the plugin's int / float fields (plugins/contract.json "attributes")
INT_ATTRS = ("num_q_heads", "num_kv_heads", "head_dim", "rotary_dim", "causal", "write_kv",
             "sliding_window", "page_size", "qk_norm", "has_tree_mask", "fp8_kv_cache")  # fmt: skip
FLOAT_ATTRS = ("scale", "rms_norm_eps", "kv_scale")
# added in memory by session_model: the name of the graph input feeding the node's kv_cache
KV_INPUT_ATTR = "eb_kv_input"


class EbAttentionParams(ctypes.Structure):
    """Mirror of ``EbAttentionParams`` (plugins/include/edgebuild/attention_params.h)."""

    _fields_ = [
        *[(n, ctypes.c_int32) for n in ("struct_size", "batch", "seq_len", "num_pages",
          "max_pages_per_seq", "max_position", "num_q_heads", "num_kv_heads", "head_dim",
          "rotary_dim", "page_size", "causal", "write_kv", "sliding_window", "qk_norm",
          "has_tree_mask", "io_dtype", "kv_dtype")],
        ("scale", ctypes.c_float),
        ("rms_norm_eps", ctypes.c_float),
        ("kv_scale", ctypes.c_float),
        *[(n, ctypes.c_void_p) for n in ("qkv", "kv_cache", "page_table", "past_lengths",
          "input_lengths", "positions", "rope_cos_sin", "q_norm_weight", "k_norm_weight",
          "tree_mask", "out")],
    ]  # fmt: skip


_LIB: ctypes.CDLL | None = None


def host_library() -> ctypes.CDLL:
    """The plugin's host build, compiled once per source content and loaded.

    Raises:
        MissingDependencyError: no ``plugins/`` checkout, no g++, or the build failed.
    """
    global _LIB
    if _LIB is not None:
        return _LIB
    if not HOST_SOURCE.is_file():
        raise MissingDependencyError(
            f"{HOST_SOURCE}: the attention plugin's host source is missing; the onnxruntime "
            "backend runs the plugin node with it (use an edgebuild source checkout)"
        )
    gxx = shutil.which("g++")
    if gxx is None:
        raise MissingDependencyError(
            "the onnxruntime backend compiles the attention plugin's host code "
            "(plugins/src/attention_host.cpp) and needs g++ on PATH: apt-get install g++"
        )
    digest = hashlib.sha256(" ".join(HOST_FLAGS).encode())
    for path in (HOST_SOURCE, *(_PLUGINS / "include" / "edgebuild" / h for h in HOST_HEADERS)):
        digest.update(path.read_bytes())
    lib = BUILD_DIR / f"libedgebuild_attention_host-{digest.hexdigest()[:16]}.so"
    if not lib.exists():
        BUILD_DIR.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        cmd = [gxx, *HOST_FLAGS, f"-I{_PLUGINS / 'include'}", str(HOST_SOURCE), "-o", str(tmp)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise MissingDependencyError(f"building {lib.name} failed: {' '.join(cmd)}\n"
                                         f"{done.stderr[-2000:]}")  # fmt: skip
        os.replace(tmp, lib)
    handle = ctypes.CDLL(str(lib))
    handle.eb_host_paged_attention.argtypes = [
        ctypes.POINTER(EbAttentionParams), ctypes.c_char_p, ctypes.c_int32,
    ]  # fmt: skip
    handle.eb_host_paged_attention.restype = ctypes.c_int32
    _LIB = handle
    return handle


def _ptr(a: np.ndarray | None):
    return None if a is None else a.ctypes.data_as(ctypes.c_void_p)


def attention(qkv, kv_cache, page_table, past, lengths, positions, rope, qn=None, kn=None,
              in_place=False, **a):  # fmt: skip
    """One plugin call on host arrays (float32 qkv/cache, int32 indices, float32 RoPE table).

    Returns ``(attn_out [B, S, Hq*D], present_kv_cache)``: with ``in_place`` the call's K/V
    writes go into ``kv_cache`` itself (a C-contiguous float32 array; TensorRT's aliasing)
    and ``present_kv_cache`` is ``kv_cache``; else it is a copy with this call's writes.
    Attributes ``a`` are the node's, by the plugin's field names.

    Raises:
        EngineError: the host code refused the call (its message names the field), or an
            ``in_place`` cache that is not C-contiguous float32.
    """
    arrays = [np.ascontiguousarray(x) for x in (qkv, page_table, past, lengths, positions, rope)]
    qkv, page_table, past, lengths, positions, rope = arrays
    qn = None if qn is None else np.ascontiguousarray(qn)
    kn = None if kn is None else np.ascontiguousarray(kn)
    if in_place and not (kv_cache.dtype == np.float32 and kv_cache.flags.c_contiguous
                         and kv_cache.flags.writeable):  # fmt: skip
        raise EngineError("EdgebuildAttention: an in-place KV pool must be C-contiguous float32")
    present = kv_cache if in_place else np.array(kv_cache, dtype=np.float32, copy=True, order="C")
    b, s = qkv.shape[0], qkv.shape[1]
    out = np.zeros((b, s, a["num_q_heads"] * a["head_dim"]), dtype=np.float32)
    params = EbAttentionParams(
        struct_size=ctypes.sizeof(EbAttentionParams), batch=b, seq_len=s,
        num_pages=present.shape[0], max_pages_per_seq=page_table.shape[1],
        max_position=rope.shape[0], io_dtype=EB_FLOAT32, kv_dtype=EB_FLOAT32,
        **{k: int(a[k]) for k in INT_ATTRS if k != "fp8_kv_cache"},
        **{k: float(a[k]) for k in FLOAT_ATTRS},
        qkv=_ptr(qkv), kv_cache=_ptr(present), page_table=_ptr(page_table),
        past_lengths=_ptr(past), input_lengths=_ptr(lengths), positions=_ptr(positions),
        rope_cos_sin=_ptr(rope), q_norm_weight=_ptr(qn), k_norm_weight=_ptr(kn),
        tree_mask=None, out=_ptr(out),
    )  # fmt: skip
    err = ctypes.create_string_buffer(512)
    code = host_library().eb_host_paged_attention(ctypes.byref(params), err, len(err))
    if code != 0:
        raise EngineError(f"EdgebuildAttention (host build): {err.value.decode()}")
    return out, present


_REGISTERED = False


def register_attention_op() -> str:
    """Register the two Python custom ops (without / with q-k norm); returns the library path
    to pass to ``SessionOptions.register_custom_ops_library``.

    Raises:
        MissingDependencyError: onnxruntime-extensions is not installed.
    """
    global _REGISTERED
    try:
        from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op
    except ImportError as exc:
        raise MissingDependencyError(
            f"the onnxruntime backend needs onnxruntime-extensions ({exc}); "
            "pip install 'edgebuild[export]'"
        ) from None
    if not _REGISTERED:
        f, i = PyCustomOpDef.dt_float, PyCustomOpDef.dt_int32
        attrs = {**dict.fromkeys(INT_ATTRS, PyCustomOpDef.dt_int64),
                 **dict.fromkeys(FLOAT_ATTRS, PyCustomOpDef.dt_float),
                 KV_INPUT_ATTR: PyCustomOpDef.dt_string}  # fmt: skip
        base = [f, f, i, i, i, i, f]
        onnx_op(op_type=OP_TYPE, inputs=base, outputs=[f, f], attrs=attrs)(_check_fp32(attention))
        onnx_op(op_type=OP_TYPE_QK_NORM, inputs=[*base, f, f], outputs=[f, f], attrs=attrs)(
            _check_fp32(attention)
        )
        _REGISTERED = True
    return get_library_path()


ERRORS: list[str] = []  # refusals of the op's calls, raised by the runner after the run
# The runner's KV pools for one run (graph input name -> the bound pool's numpy view), and
# the names the op wrote in place during it (their present_kv_cache output is a stub)
BOUND: dict[str, np.ndarray] = {}
WRITTEN: set[str] = set()
_STUB = np.zeros(1, dtype=np.float32)
_RUN_LOCK = threading.Lock()


def take_errors() -> list[str]:
    """The messages of the op calls that failed since the last call (then cleared)."""
    out = list(ERRORS)
    ERRORS.clear()
    return out


@contextmanager
def bound_pools(pools: dict[str, np.ndarray]):
    """Bind the KV pools for one session run.

    A plugin node whose ``kv_cache`` input is one of ``pools`` (by graph input name, attribute
    :data:`KV_INPUT_ATTR`; in a chain of nodes on one pool, as the draft's context write then
    block read, each names the chain's graph input) writes its K/V rows into that array in
    place, as TensorRT aliases ``present_kv_cache`` to ``kv_cache``, and returns a 1-element
    stub for ``present_kv_cache`` instead of the whole pool (which onnxruntime-extensions
    would pass back through a Python list). Yields :data:`WRITTEN`, the names written in
    place. Runs are serialized (one lock for the process: the tables are global)."""
    with _RUN_LOCK:  # one bound run at a time in the process (the tables are global)
        BOUND.clear()
        WRITTEN.clear()
        BOUND.update(pools)
        try:
            yield WRITTEN
        finally:
            BOUND.clear()


def _check_fp32(fn):
    """The op body: an exception may not cross onnxruntime-extensions (it aborts the process),
    so a refused call records its message in :data:`ERRORS` and returns zeros."""

    def op(*inputs, **attrs):
        name = attrs.pop(KV_INPUT_ATTR, "")
        try:
            if int(attrs.get("fp8_kv_cache", 0)) or int(attrs.get("has_tree_mask", 0)):
                raise EngineError("fp8 KV caches and tree masks are not supported on the "
                                  "onnxruntime backend (float32 chain graphs only)")  # fmt: skip
            pool = BOUND.get(name)  # then inputs[1] is the pool's copy, or an earlier stub
            if pool is not None:
                out, _ = fn(inputs[0], pool, *inputs[2:], in_place=True, **attrs)
                WRITTEN.add(name)
                return out, _STUB
            return fn(*inputs, **attrs)
        except Exception as exc:  # noqa: BLE001 - reported by the runner
            ERRORS.append(str(exc))
            qkv, cache = inputs[0], inputs[1]
            width = int(attrs["num_q_heads"]) * int(attrs["head_dim"])
            out = np.zeros((*qkv.shape[:2], width), dtype=np.float32)
            return out, np.array(cache, dtype=np.float32, copy=True)

    return op


def session_model(model) -> bytes:
    """The serialized ``onnx.ModelProto`` with its plugin nodes re-targeted to the custom ops
    (in memory; see the module docstring).

    Raises:
        EngineError: a plugin node with another input count than 7 or 9 (tree masks), or a
            graph whose attention is not float32.
    """
    import onnx

    root: dict[str, str] = {}  # a plugin node's present_kv_cache -> the pool input it updates
    for node in model.graph.node:
        if node.domain == PLUGIN_DOMAIN and node.op_type == OP_TYPE:
            pool = root.get(node.input[1], node.input[1])  # a chain of nodes on one pool
            root[node.output[1]] = pool
            if len(node.input) not in (7, 9):
                raise EngineError(
                    f"node {node.name}: EdgebuildAttention with {len(node.input)} inputs "
                    "(tree_mask) cannot run on the onnxruntime backend"
                )
            node.domain = ORT_DOMAIN
            node.op_type = OP_TYPE if len(node.input) == 7 else OP_TYPE_QK_NORM
            keep = [a for a in node.attribute if a.name in INT_ATTRS + FLOAT_ATTRS]
            del node.attribute[:]
            node.attribute.extend(keep)
            node.attribute.append(onnx.helper.make_attribute(KV_INPUT_ATTR, pool))
    if not any(o.domain == ORT_DOMAIN for o in model.opset_import):
        model.opset_import.add(domain=ORT_DOMAIN, version=1)
    return model.SerializeToString()
