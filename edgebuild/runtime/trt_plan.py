"""Planning for the TensorRT backend, from the bundle manifest alone (no TensorRT, no GPU).

Owns
* :class:`EngineLimits`: the shapes the engines were built for (``build`` settings and the
  speculative verify length), the KV page geometry derived from them.
* :func:`role_profiles` / :func:`choose_profile`: each role's optimization profiles, read from
  the manifest (``roles.<role>.profiles``, which the builder records from the profiles it
  builds the engines with, so the runtime and the builder cannot disagree), and the profile a
  call's shapes run in.
* :func:`plan_buffers` -> :class:`BufferPlan`: every buffer the backend allocates once, with
  its dtype, maximum shape and byte count: engine inputs/outputs at the largest shape any
  profile admits, the per-layer KV page pools (``present_kv_cache_i`` aliases
  ``kv_cache_i``: the plugin updates the pool in place), host staging for the inputs written
  from the host and the outputs read back, and the device ring that carries the base engine's
  tapped hidden states to the draft engine. A VLM bundle's ``visual`` role gets its buffers
  too; its ``image_embeds`` output and the base engine's ``image_embeds`` input stay on the
  device (never staged on the host).
* :func:`check_io_contract`: an engine's actual I/O (names, input/output, dtypes, ranks,
  static dims) against what the exporter declared (the manifest's ``roles.<role>.inputs`` /
  ``outputs``, which are ``BaseGraph.io()`` / ``DraftGraph.io()``).

KV geometry: the builder gives every sequence up to ``ceil(max_kv_cache_capacity /
page_size)`` pages (the ``max_pages`` axis) and the pool ``max_pages * max_batch_size`` pages
(the ``num_pages`` axis); the pool's shape is the same on every call, which keeps CUDA graphs
valid. Page tables are always ``max_pages`` wide for the same reason. A sliding-window draft
(``dspark.kv_cache.attention`` "sliding") keeps a fixed ring of pages per request instead
(:func:`draft_ring`, :class:`~edgebuild.runtime.kv_cache.DraftRing`): its pools hold whole
rings, as many as the ``num_pages`` pages hold (at least ``max_batch_size``), and its page
table is the request's rotated ring (the first ring-many entries of the ``max_pages`` row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from edgebuild.bundle.manifest import engine_profiles
from edgebuild.checkpoint.dspark_config import ring_pages
from edgebuild.errors import BundleError, EngineError
from edgebuild.runtime.kv_cache import DraftRing

# dtype names as the manifest writes them (str(torch.dtype) without "torch.")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
# inputs the host writes each call (staged in host memory, then copied to the device)
HOST_INPUTS = frozenset(
    {
        "input_ids",
        "positions",
        "mrope_positions",
        "past_lengths",
        "input_lengths",
        "logits_rows",
        "page_table",
        "context_positions",
        "context_lengths",
        "anchor_ids",
        "block_positions",
        # the visual engine's inputs: the host's VisionPlan of the pass
        "pixel_values",
        "patch_order",
        "rope_cos_sin",
        "full_index",
        "full_valid",
        "full_slot",
        "window_index",
        "window_valid",
        "window_slot",
        "merge_order",
    }
)
# outputs the host reads back each call
HOST_OUTPUTS = frozenset({"logits", "draft_candidate_ids", "draft_scores", "draft_confidence"})
KV_INPUT, KV_OUTPUT = "kv_cache_", "present_kv_cache_"
TAPS_OUTPUT = "target_hidden_states"
TAP_RING = "tap_ring"


def itemsize(dtype: str) -> int:
    """Bytes per element of a manifest dtype name."""
    if dtype not in DTYPES:
        raise BundleError(f"unknown tensor dtype {dtype!r} in the manifest")
    return DTYPES[dtype].itemsize


@dataclass(frozen=True)
class EngineLimits:
    """The shapes the bundle's engines accept (from ``manifest.build`` and ``speculative``).

    Attributes:
        max_batch: sequences per engine call.
        max_input_len: rows of one prefill call.
        kv_capacity: KV rows one sequence may hold.
        page_size: rows per KV page.
        verify_len: rows of a decode / verify call (``num_speculative_tokens + 1``).
        num_speculative_tokens: drafts per step the engines were built for (0: target only).
    """

    max_batch: int
    max_input_len: int
    kv_capacity: int
    page_size: int
    verify_len: int
    num_speculative_tokens: int

    @property
    def pages_per_seq(self) -> int:
        """Page-table width (the ``max_pages`` axis)."""
        return -(-self.kv_capacity // self.page_size)

    @property
    def num_pages(self) -> int:
        """Pages in each layer's pool (the ``num_pages`` axis)."""
        return self.pages_per_seq * self.max_batch

    @property
    def tap_ring_rows(self) -> int:
        """Rows of the tap ring: two full calls of pending features per sequence slot."""
        return 2 * self.max_batch * (self.max_input_len + self.verify_len)

    @classmethod
    def from_manifest(cls, manifest: dict) -> EngineLimits:
        """Read ``build`` and ``speculative`` of a manifest.

        Raises:
            BundleError: a missing or non-positive build setting.
        """
        build = manifest.get("build") or {}
        keys = ("max_batch_size", "max_input_len", "max_kv_cache_capacity", "page_size")
        bad = [k for k in keys if not isinstance(build.get(k), int) or build[k] < 1]
        if bad:
            raise BundleError(
                f"manifest.json: build.{bad[0]} is {build.get(bad[0])!r}; the bundle does not "
                "record the shapes its engines were built for - rebuild it with `edgebuild build`"
            )
        n = int((manifest.get("speculative") or {}).get("num_speculative_tokens", 0))
        return cls(
            max_batch=build["max_batch_size"],
            max_input_len=build["max_input_len"],
            kv_capacity=build["max_kv_cache_capacity"],
            page_size=build["page_size"],
            verify_len=n + 1,
            num_speculative_tokens=n,
        )


@dataclass(frozen=True)
class TensorDesc:
    """One engine input or output: name, dtype name and dims (int static, str named axis)."""

    name: str
    dtype: str
    dims: tuple[int | str, ...]

    @classmethod
    def from_json(cls, entry: dict) -> TensorDesc:
        return cls(entry["name"], entry["dtype"], tuple(entry["dims"]))


@dataclass(frozen=True)
class RoleIO:
    """A role's declared engine inputs and outputs, in graph order."""

    role: str
    inputs: tuple[TensorDesc, ...]
    outputs: tuple[TensorDesc, ...]

    def get(self, name: str) -> TensorDesc:
        for t in (*self.inputs, *self.outputs):
            if t.name == name:
                return t
        raise KeyError(f"{self.role} engine declares no tensor {name!r}")

    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in (*self.inputs, *self.outputs))


def role_io(manifest: dict, role: str) -> RoleIO:
    """The declared I/O of ``role`` (``manifest.roles.<role>.inputs/outputs``).

    Raises:
        BundleError: the bundle has no such role or it records no I/O.
    """
    entry = (manifest.get("roles") or {}).get(role)
    if not entry or "inputs" not in entry or "outputs" not in entry:
        raise BundleError(
            f"manifest.json: roles.{role} is missing or records no inputs/outputs; rebuild the "
            "bundle with `edgebuild build`"
        )
    return RoleIO(
        role,
        tuple(TensorDesc.from_json(e) for e in entry["inputs"]),
        tuple(TensorDesc.from_json(e) for e in entry["outputs"]),
    )


# ----------------------------------------------------------------------------- profiles
@dataclass(frozen=True)
class Profile:
    """One optimization profile: its name and ``{input: (min_shape, opt_shape, max_shape)}``."""

    name: str
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]

    def admits(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        """True when every given input shape lies within [min, max] of this profile."""
        for name, shape in shapes.items():
            lo, _, hi = self.shapes[name]
            if len(shape) != len(lo) or any(
                not a <= s <= b for s, a, b in zip(shape, lo, hi, strict=True)
            ):
                return False
        return True

    def volume(self) -> int:
        return sum(math.prod(hi) for _, _, hi in self.shapes.values())


def role_profiles(manifest: dict, role: str) -> list[Profile]:
    """The optimization profiles of ``role``'s engine, in engine order, as the manifest records
    them (``roles.<role>.profiles``, written by the builder at build time).

    Raises:
        BundleError: a bundle that records no profiles (rebuild it) or a malformed record.
    """
    return [Profile(name, shapes) for name, shapes in engine_profiles(manifest, role)]


def choose_profile(profiles: list[Profile], shapes: dict[str, tuple[int, ...]]) -> int:
    """Index of the smallest profile that admits ``shapes`` (decode/verify -> ``generate``).

    Raises:
        EngineError: no profile admits them (names the shapes and the largest profile's limits).
    """
    order = sorted(range(len(profiles)), key=lambda i: profiles[i].volume())
    for i in order:
        if profiles[i].admits(shapes):
            return i
    limits = {n: hi for n, (_, _, hi) in profiles[order[-1]].shapes.items() if n in shapes}
    raise EngineError(
        f"no optimization profile admits the shapes {shapes}; the engines were built for at "
        f"most {limits} (rebuild with larger build settings)"
    )


# ----------------------------------------------------------------------------- buffers
@dataclass(frozen=True)
class BufferSpec:
    """One buffer allocated once by the backend.

    Attributes:
        role: engine role (``base`` / ``draft`` / ``visual``).
        name: the engine tensor it backs (or :data:`TAP_RING`).
        dtype: manifest dtype name.
        shape: its largest shape (the allocation).
        location: ``device`` or ``host`` (pinned staging).
        alias_of: for an output that is another buffer's memory (present KV cache).
    """

    role: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    location: str = "device"
    alias_of: str | None = None

    @property
    def nbytes(self) -> int:
        """Bytes this buffer allocates (0 for an alias)."""
        return 0 if self.alias_of else math.prod(self.shape) * itemsize(self.dtype)


@dataclass
class BufferPlan:
    """All buffers of the backend (see :func:`plan_buffers`).

    ``draft_ring``: a sliding-window draft's per-request ring (:func:`draft_ring`), None for a
    full-attention draft (or none); ``draft_pages``: pages of each draft KV pool.
    """

    limits: EngineLimits
    buffers: list[BufferSpec] = field(default_factory=list)
    draft_ring: DraftRing | None = None
    draft_pages: int = 0

    def get(self, role: str, name: str, location: str = "device") -> BufferSpec:
        for b in self.buffers:
            if (b.role, b.name, b.location) == (role, name, location):
                return b
        raise KeyError(f"no {location} buffer {role}.{name} in the plan")

    def role(self, role: str, location: str = "device") -> list[BufferSpec]:
        return [b for b in self.buffers if b.role == role and b.location == location]

    def bytes(self, location: str = "device", role: str | None = None) -> int:
        return sum(
            b.nbytes
            for b in self.buffers
            if b.location == location and (role is None or b.role == role)
        )

    def summary(self) -> str:
        """One line per role: device and host MiB (for logs)."""
        roles = sorted({b.role for b in self.buffers})
        return "; ".join(
            f"{r}: {self.bytes('device', r) / 2**20:.2f} MiB device, "
            f"{self.bytes('host', r) / 2**20:.2f} MiB host"
            for r in roles
        )


def max_shape(desc: TensorDesc, axes: dict[str, int]) -> tuple[int, ...]:
    """Largest shape of ``desc``: static dims as is, named axes at their largest value."""
    return tuple(d if isinstance(d, int) else axes[d] for d in desc.dims)


def axis_maxima(io: RoleIO, profiles: list[Profile]) -> dict[str, int]:
    """Each named axis' largest value over all profiles (read from the input profiles)."""
    axes: dict[str, int] = {}
    for desc in io.inputs:
        for p in profiles:
            hi = p.shapes[desc.name][2]
            for d, v in zip(desc.dims, hi, strict=True):
                if isinstance(d, str):
                    axes[d] = max(axes.get(d, 0), v)
    return axes


def draft_ring(manifest: dict, limits: EngineLimits) -> DraftRing | None:
    """The fixed ring of a sliding-window draft's context cache (``dspark.kv_cache`` of the
    manifest: ``attention`` "sliding", ``sliding_window`` W), of
    :func:`~edgebuild.checkpoint.dspark_config.ring_pages` pages per request. None for a
    full-attention draft, and for a window whose ring would not fit one sequence's page table
    (``build.max_kv_cache_capacity``): no sequence then outgrows the window's reach, so the
    full per-sequence cache with the graph's window mask is the same attention.

    Raises:
        BundleError: a sliding ``kv_cache`` record without a positive window or block size.
    """
    dspark = manifest.get("dspark") or {}
    kv = dspark.get("kv_cache") or {}
    if kv.get("attention") != "sliding":
        return None
    window, block = kv.get("sliding_window"), dspark.get("block_size")
    if not all(isinstance(v, int) and v > 0 for v in (window, block)):
        raise BundleError(
            f"manifest.json: dspark.kv_cache.sliding_window {window!r} / dspark.block_size "
            f"{block!r} are not positive integers; rebuild the bundle with `edgebuild build`"
        )
    pages = ring_pages(window, block, limits.page_size)
    if pages > limits.pages_per_seq:
        return None
    return DraftRing(window, pages, limits.page_size)


def _role_buffers(
    manifest: dict, role: str, limits: EngineLimits, kv_pages: int | None = None
) -> list[BufferSpec]:
    """``kv_pages``: pages of the role's KV pools when not the ``num_pages`` axis' largest."""
    io, profiles = role_io(manifest, role), role_profiles(manifest, role)
    axes = axis_maxima(io, profiles)
    out = []
    for desc in io.inputs:
        shape = max_shape(desc, axes)
        if kv_pages is not None and desc.name.startswith(KV_INPUT):
            shape = (kv_pages, *shape[1:])
        out.append(BufferSpec(role, desc.name, desc.dtype, shape))
        if desc.name in HOST_INPUTS:
            out.append(BufferSpec(role, desc.name, desc.dtype, shape, "host"))
    for desc in io.outputs:
        missing = [d for d in desc.dims if isinstance(d, str) and d not in axes]
        if missing:
            raise BundleError(
                f"manifest.json: {role} output '{desc.name}' has axes {missing} that no input has"
            )
        shape = max_shape(desc, axes)
        if kv_pages is not None and desc.name.startswith(KV_OUTPUT):
            shape = (kv_pages, *shape[1:])
        if desc.name.startswith(KV_OUTPUT):
            alias = KV_INPUT + desc.name[len(KV_OUTPUT) :]
            out.append(BufferSpec(role, desc.name, desc.dtype, shape, alias_of=alias))
            continue
        out.append(BufferSpec(role, desc.name, desc.dtype, shape))
        if desc.name in HOST_OUTPUTS:
            out.append(BufferSpec(role, desc.name, desc.dtype, shape, "host"))
        if desc.name == TAPS_OUTPUT:
            ring = (limits.tap_ring_rows, shape[-1])
            out.append(BufferSpec(role, TAP_RING, desc.dtype, ring))
    return out


def plan_buffers(manifest: dict) -> BufferPlan:
    """Every buffer the TensorRT backend allocates, from the manifest alone (module docstring).

    Raises:
        BundleError: missing build settings or role I/O.
    """
    limits = EngineLimits.from_manifest(manifest)
    plan = BufferPlan(limits)
    roles = manifest.get("roles") or {}
    if "draft" in roles:
        plan.draft_ring = draft_ring(manifest, limits)
        plan.draft_pages = limits.num_pages
        if plan.draft_ring is not None:  # whole rings, as many as the pool's pages hold
            rings = max(limits.max_batch, limits.num_pages // plan.draft_ring.pages)
            plan.draft_pages = rings * plan.draft_ring.pages
    for role in ("base", "draft", "visual"):
        if role in roles:
            pages = plan.draft_pages if role == "draft" and plan.draft_ring else None
            plan.buffers += _role_buffers(manifest, role, limits, pages)
    return plan


# ----------------------------------------------------------------------------- I/O contract
@dataclass(frozen=True)
class EngineTensor:
    """One I/O tensor as a deserialized engine reports it.

    ``dims``: -1 for a dynamic dimension; ``is_input``: TensorIOMode.INPUT.
    """

    name: str
    is_input: bool
    dtype: str
    dims: tuple[int, ...]


def io_problems(engine_io: list[EngineTensor], declared: RoleIO) -> list[str]:
    """Every difference between an engine's I/O and the declared I/O (empty: they agree)."""
    have = {t.name: t for t in engine_io}
    problems = []
    for want, is_input in [(d, True) for d in declared.inputs] + [
        (d, False) for d in declared.outputs
    ]:
        kind = "input" if is_input else "output"
        got = have.get(want.name)
        if got is None:
            problems.append(f"{kind} '{want.name}' is missing from the engine")
            continue
        if got.is_input != is_input:
            problems.append(
                f"'{want.name}' is an engine {'input' if got.is_input else 'output'}, "
                f"declared as an {kind}"
            )
        if got.dtype != want.dtype:
            problems.append(
                f"{kind} '{want.name}' is {got.dtype} in the engine, declared {want.dtype}"
            )
        if len(got.dims) != len(want.dims):
            problems.append(
                f"{kind} '{want.name}' has rank {len(got.dims)} in the engine, declared "
                f"{len(want.dims)} {list(want.dims)}"
            )
            continue
        for i, (g, w) in enumerate(zip(got.dims, want.dims, strict=True)):
            if isinstance(w, int) and g != w:
                problems.append(
                    f"{kind} '{want.name}' dim {i} is {g} in the engine, declared {w} "
                    f"(shape {list(want.dims)})"
                )
    declared_names = set(declared.names())
    for t in engine_io:
        if t.name not in declared_names:
            problems.append(
                f"engine {'input' if t.is_input else 'output'} '{t.name}' is not declared by "
                "the exporter (renamed?)"
            )
    return problems


def check_io_contract(engine_io: list[EngineTensor], declared: RoleIO, where: str = "") -> None:
    """Refuse an engine whose I/O differs from the declared I/O.

    Raises:
        EngineError: listing every problem (missing, renamed, wrong dtype / rank / static dim,
            input vs output) and the fix.
    """
    problems = io_problems(engine_io, declared)
    if problems:
        raise EngineError(
            f"{where or declared.role + ' engine'}: its inputs/outputs do not match what the "
            f"exporter declared for role '{declared.role}' (manifest.json roles.{declared.role})"
            ":\n  " + "\n  ".join(problems) + "\nRebuild the engine from this bundle's ONNX "
            "graph with `edgebuild build`."
        )
