"""The attention plugin's kernel math, built for the host, against the Python reference op.

Owns the checks that need no GPU: ``plugins/src/attention_host.cpp`` (the full attention
contract composed from the same ``__host__ __device__`` header functions the CUDA kernels
use) is built with g++ into a shared library, loaded with ctypes, and compared with
``edgebuild.ops.attention.paged_attention`` on random inputs for every phase (prefill,
chunked prefill, decode, chain and tree verify, draft context update, non-causal draft
block, cache-less vision), with unequal batch lengths, padding rows, sequences split across
shuffled pages, GQA/MQA, q/k RMSNorm, partial and YaRN RoPE and a sliding window.

Tolerances (max |host - reference| <= atol + rtol * |reference|):
    fp32 qkv and cache:        atol 1e-4, rtol 0     (both compute in fp32; only sum order differs)
    fp16 qkv and cache:        atol 2e-3, rtol 2e-3  (about 2 fp16 ulps: the output rounding)
    bf16 qkv and cache:        atol 1.6e-2, rtol 1.6e-2 (about 2 bf16 ulps)
    fp8 e4m3 cache (kv_scale 1, fp16/bf16 qkv): the qkv dtype's output tolerance; the cache
                               itself to one fp8 step (rtol 0.125, atol 2**-9)
The caches written by both sides are compared with the same tolerances (fp16/bf16: one ulp).

Also here: the C conversions (fp16/bf16/fp8) against torch's casts bit for bit, the
error paths, ``test_cuda_kernels_run_under_cpu_emulation_and_match_the_host_build`` (the
real CUDA kernels compiled with g++ on plugins/tests/cuda_emulation.h and compared with the
host build, since no GPU is available here), and
``test_nvcc_compiles_every_kernel_for_all_targets`` which runs
``scripts/check_cuda_compile.sh`` (sm_87, sm_90, sm_110) when nvcc exists.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from edgebuild.ops.attention import paged_attention
from edgebuild.ops.rope import RopeScaling, rope_cos_sin_table

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ROOT / "plugins"
HOST_SOURCES = [
    PLUGINS / "src" / "attention_host.cpp",
    PLUGINS / "include" / "edgebuild" / "attention_host.h",
    PLUGINS / "include" / "edgebuild" / "attention_math.h",
    PLUGINS / "include" / "edgebuild" / "attention_params.h",
    PLUGINS / "include" / "edgebuild" / "numeric.h",
]
# -ffp-contract=off: no fused multiply-add, so RoPE/norm bits match the kernels' __fmul_rn.
HOST_FLAGS = ["-std=c++17", "-O2", "-fPIC", "-shared", "-ffp-contract=off", "-fvisibility=hidden"]
BUILD_DIR = ROOT / "build" / "plugin_host"

EB_DTYPE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3}
EB_OK, EB_ERR_INVALID_ARGUMENT, EB_ERR_INVALID_DATA = 0, 1, 2


class EbAttentionParams(ctypes.Structure):
    """Mirror of ``EbAttentionParams`` in plugins/include/edgebuild/attention_params.h."""

    _fields_ = [
        ("struct_size", ctypes.c_int32),
        ("batch", ctypes.c_int32),
        ("seq_len", ctypes.c_int32),
        ("num_pages", ctypes.c_int32),
        ("max_pages_per_seq", ctypes.c_int32),
        ("max_position", ctypes.c_int32),
        ("num_q_heads", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("rotary_dim", ctypes.c_int32),
        ("page_size", ctypes.c_int32),
        ("causal", ctypes.c_int32),
        ("write_kv", ctypes.c_int32),
        ("sliding_window", ctypes.c_int32),
        ("qk_norm", ctypes.c_int32),
        ("has_tree_mask", ctypes.c_int32),
        ("io_dtype", ctypes.c_int32),
        ("kv_dtype", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("rms_norm_eps", ctypes.c_float),
        ("kv_scale", ctypes.c_float),
        ("qkv", ctypes.c_void_p),
        ("kv_cache", ctypes.c_void_p),
        ("page_table", ctypes.c_void_p),
        ("past_lengths", ctypes.c_void_p),
        ("input_lengths", ctypes.c_void_p),
        ("positions", ctypes.c_void_p),
        ("rope_cos_sin", ctypes.c_void_p),
        ("q_norm_weight", ctypes.c_void_p),
        ("k_norm_weight", ctypes.c_void_p),
        ("tree_mask", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
    ]


def _build_host_library() -> Path:
    """Compile the host library once per source content (cached under build/, git-ignored)."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found on PATH: cannot build the plugin host library to test it")
    digest = hashlib.sha256(" ".join(HOST_FLAGS).encode())
    for path in HOST_SOURCES:
        digest.update(path.read_bytes())
    lib = BUILD_DIR / f"libedgebuild_attention_host-{digest.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")
    cmd = [gxx, *HOST_FLAGS, f"-I{PLUGINS / 'include'}", str(HOST_SOURCES[0]), "-o", str(tmp)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        pytest.fail(f"host library build failed: {' '.join(cmd)}\n{result.stderr}")
    os.replace(tmp, lib)
    return lib


@pytest.fixture(scope="session")
def host_lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(_build_host_library()))
    lib.eb_host_paged_attention.argtypes = [
        ctypes.POINTER(EbAttentionParams),
        ctypes.c_char_p,
        ctypes.c_int32,
    ]
    lib.eb_host_paged_attention.restype = ctypes.c_int32
    lib.eb_host_convert.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int32,
        ctypes.c_void_p,
        ctypes.c_int32,
        ctypes.c_int64,
    ]
    lib.eb_host_convert.restype = ctypes.c_int32
    lib.eb_host_validate_attributes.argtypes = lib.eb_host_paged_attention.argtypes
    lib.eb_host_validate_attributes.restype = ctypes.c_int32
    return lib


@dataclass(frozen=True)
class Case:
    """One attention call: a phase (lengths, mask, write_kv) crossed with a head config."""

    past: tuple[int, ...]  # past_lengths per sequence
    lengths: tuple[int, ...]  # input_lengths per sequence (<= seq_len)
    seq_len: int
    causal: bool = True
    write_kv: bool = True
    tree: bool = False
    no_cache: bool = False  # vision: empty pool, empty page table
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rotary_dim: int = 16
    qk_norm: bool = False
    sliding_window: int = 0
    page_size: int = 4
    rope: str = "default"


PHASES = {
    "prefill": Case(past=(0, 0, 0), lengths=(7, 3, 5), seq_len=7),
    "chunked_prefill": Case(past=(5, 9, 0), lengths=(6, 2, 4), seq_len=6),
    "decode": Case(past=(13, 4, 21), lengths=(1, 1, 1), seq_len=1),
    "decode_with_idle_sequence": Case(past=(7, 30), lengths=(1, 0), seq_len=1),
    "verify_chain": Case(past=(10, 3), lengths=(4, 3), seq_len=4),
    "verify_tree": Case(past=(6, 11), lengths=(5, 4), seq_len=5, tree=True),
    "draft_context_update": Case(past=(8, 2), lengths=(3, 5), seq_len=5),
    "draft_block": Case(past=(9, 14), lengths=(4, 4), seq_len=4, causal=False, write_kv=False),
    "vision_no_cache": Case(
        past=(0, 0), lengths=(6, 4), seq_len=6, causal=False, write_kv=False, no_cache=True
    ),
}

CONFIGS = {
    "gqa": {},
    "mqa_qknorm_partial_rope": {
        "num_kv_heads": 1,
        "head_dim": 32,
        "rotary_dim": 16,
        "qk_norm": True,
    },
    "mha_sliding_window": {"num_kv_heads": 4, "sliding_window": 5, "page_size": 3},
    "gqa_yarn_qknorm": {"qk_norm": True, "rope": "yarn", "page_size": 8},
    "no_rope": {"rotary_dim": 0, "num_q_heads": 6, "num_kv_heads": 3},
}

TOLERANCES = {  # dtype -> (atol, rtol) for outputs and caches
    torch.float32: (1e-4, 0.0),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float8_e4m3fn: (2.0**-9, 0.125),
}


@dataclass
class Inputs:
    """Tensors of one call, in the reference op's argument order."""

    qkv: torch.Tensor
    kv_cache: torch.Tensor
    page_table: torch.Tensor
    past_lengths: torch.Tensor
    input_lengths: torch.Tensor
    positions: torch.Tensor
    rope_cos_sin: torch.Tensor
    q_norm_weight: torch.Tensor | None
    k_norm_weight: torch.Tensor | None
    tree_mask: torch.Tensor | None


def _rope_table(case: Case, max_position: int) -> torch.Tensor:
    if case.rotary_dim == 0:
        return torch.zeros(max_position, 0)
    if case.rope == "yarn":
        rope = RopeScaling(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16
        )
    else:
        rope = RopeScaling(rope_type="default", rope_theta=10000.0)
    return rope_cos_sin_table(case.rotary_dim, max_position, rope)


def _tree_mask(gen: torch.Generator, case: Case) -> torch.Tensor:
    """Random trees: node j > 0 hangs under a random earlier node; a node sees its ancestors."""
    batch, rows = len(case.lengths), case.seq_len
    mask = torch.rand(batch, rows, rows, generator=gen) < 0.5  # garbage in padding rows
    for b, length in enumerate(case.lengths):
        parents = [-1] + [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, length)]
        for i in range(length):
            mask[b, i, :length] = False
            node = i
            while node >= 0:
                mask[b, i, node] = True
                node = parents[node]
    return mask


def make_inputs(case: Case, dtype: torch.dtype, kv_dtype: torch.dtype, seed: int) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    batch, rows = len(case.lengths), case.seq_len
    hq, hkv, d, ps = case.num_q_heads, case.num_kv_heads, case.head_dim, case.page_size
    slots = [p + (n if case.write_kv else 0) for p, n in zip(case.past, case.lengths, strict=True)]
    pages_per_seq = [-(-s // ps) for s in slots]
    max_pages = 0 if case.no_cache else max(pages_per_seq) + 1
    num_pages = 0 if case.no_cache else sum(pages_per_seq) + 3  # spare pages stay untouched
    # pages are handed out in a shuffled order so a sequence's slots are scattered in the pool
    order = torch.randperm(num_pages, generator=gen).to(torch.int32)
    page_table = torch.full((batch, max_pages), -1, dtype=torch.int32)
    cursor = 0
    for b, count in enumerate(pages_per_seq):
        if not case.no_cache:
            page_table[b, :count] = order[cursor : cursor + count]
            cursor += count
    qkv = torch.randn(batch, rows, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    kv_cache = torch.randn(num_pages, 2, hkv, ps, d, generator=gen).to(kv_dtype)
    positions = torch.full((batch, rows), -7, dtype=torch.int32)  # padding rows: never read
    for b, (past, length) in enumerate(zip(case.past, case.lengths, strict=True)):
        positions[b, :length] = past + torch.arange(length, dtype=torch.int32)
    tree_mask = _tree_mask(gen, case) if case.tree else None
    if tree_mask is not None:  # tree nodes share a position per depth: depth = ancestors - 1
        for b, (past, length) in enumerate(zip(case.past, case.lengths, strict=True)):
            depth = tree_mask[b, :length, :length].sum(dim=1).to(torch.int32) - 1
            positions[b, :length] = past + depth
    q_norm = k_norm = None
    if case.qk_norm:
        q_norm = (1.0 + 0.3 * torch.randn(d, generator=gen)).to(dtype)
        k_norm = (1.0 + 0.3 * torch.randn(d, generator=gen)).to(dtype)
    max_position = max(case.past) + rows + 4
    return Inputs(
        qkv=qkv,
        kv_cache=kv_cache,
        page_table=page_table,
        past_lengths=torch.tensor(case.past, dtype=torch.int32),
        input_lengths=torch.tensor(case.lengths, dtype=torch.int32),
        positions=positions,
        rope_cos_sin=_rope_table(case, max_position),
        q_norm_weight=q_norm,
        k_norm_weight=k_norm,
        tree_mask=tree_mask,
    )


def _ptr(tensor: torch.Tensor | None) -> int | None:
    if tensor is None or tensor.numel() == 0:
        return None
    assert tensor.is_contiguous()
    return tensor.data_ptr()


def run_host(
    lib: ctypes.CDLL, case: Case, inputs: Inputs, kv_scale: float = 1.0, scale: float | None = None
) -> tuple[int, str, torch.Tensor, torch.Tensor]:
    """Call the host library; returns (status, message, attn_out, kv_cache after the call)."""
    cache = inputs.kv_cache.clone()
    batch, rows = inputs.qkv.shape[:2]
    out = torch.full((batch, rows, case.num_q_heads * case.head_dim), 123.0).to(inputs.qkv.dtype)
    tree = None if inputs.tree_mask is None else inputs.tree_mask.to(torch.uint8).contiguous()
    params = EbAttentionParams(
        struct_size=ctypes.sizeof(EbAttentionParams),
        batch=batch,
        seq_len=rows,
        num_pages=cache.shape[0],
        max_pages_per_seq=inputs.page_table.shape[1],
        max_position=inputs.rope_cos_sin.shape[0],
        num_q_heads=case.num_q_heads,
        num_kv_heads=case.num_kv_heads,
        head_dim=case.head_dim,
        rotary_dim=case.rotary_dim,
        page_size=case.page_size,
        causal=int(case.causal),
        write_kv=int(case.write_kv),
        sliding_window=case.sliding_window,
        qk_norm=int(inputs.q_norm_weight is not None),
        has_tree_mask=int(tree is not None),
        io_dtype=EB_DTYPE[inputs.qkv.dtype],
        kv_dtype=EB_DTYPE[cache.dtype],
        scale=case.head_dim**-0.5 if scale is None else scale,
        rms_norm_eps=1e-6,
        kv_scale=kv_scale,
        qkv=_ptr(inputs.qkv),
        kv_cache=_ptr(cache),
        page_table=_ptr(inputs.page_table),
        past_lengths=_ptr(inputs.past_lengths),
        input_lengths=_ptr(inputs.input_lengths),
        positions=_ptr(inputs.positions),
        rope_cos_sin=_ptr(inputs.rope_cos_sin),
        q_norm_weight=_ptr(inputs.q_norm_weight),
        k_norm_weight=_ptr(inputs.k_norm_weight),
        tree_mask=_ptr(tree),
        out=_ptr(out),
    )
    err = ctypes.create_string_buffer(512)
    status = lib.eb_host_paged_attention(ctypes.byref(params), err, len(err))
    return status, err.value.decode(), out, cache


def run_reference(case: Case, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    cache = inputs.kv_cache.clone()
    out = paged_attention(
        inputs.qkv,
        cache,
        inputs.page_table,
        inputs.past_lengths,
        inputs.input_lengths,
        inputs.positions,
        inputs.rope_cos_sin,
        inputs.q_norm_weight,
        inputs.k_norm_weight,
        inputs.tree_mask,
        num_q_heads=case.num_q_heads,
        num_kv_heads=case.num_kv_heads,
        head_dim=case.head_dim,
        rotary_dim=case.rotary_dim,
        causal=case.causal,
        write_kv=case.write_kv,
        sliding_window=case.sliding_window,
        scale=case.head_dim**-0.5,
        rms_norm_eps=1e-6,
        page_size=case.page_size,
    )
    return out, cache


def assert_matches(
    lib: ctypes.CDLL, case: Case, dtype: torch.dtype, kv_dtype: torch.dtype, seed: int
):
    inputs = make_inputs(case, dtype, kv_dtype, seed)
    status, message, out, cache = run_host(lib, case, inputs)
    assert status == EB_OK, message
    ref_out, ref_cache = run_reference(case, inputs)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=rtol)
    cache_atol, cache_rtol = TOLERANCES[kv_dtype]
    torch.testing.assert_close(cache.float(), ref_cache.float(), atol=cache_atol, rtol=cache_rtol)
    for b, length in enumerate(case.lengths):  # padding rows are zero
        assert torch.count_nonzero(out[b, length:]) == 0
    if not case.write_kv:
        assert torch.equal(cache.view(torch.uint8), inputs.kv_cache.view(torch.uint8))


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("phase", sorted(PHASES))
def test_host_fp32_matches_reference_in_every_phase(host_lib, phase, config):
    case = replace(PHASES[phase], **CONFIGS[config])
    assert_matches(
        host_lib, case, torch.float32, torch.float32, seed=zlib.crc32(f"{phase}/{config}".encode())
    )


STORAGE_PATHS = [
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float8_e4m3fn),
    (torch.bfloat16, torch.float8_e4m3fn),
]


@pytest.mark.parametrize(
    ("dtype", "kv_dtype"), STORAGE_PATHS, ids=lambda d: str(d).removeprefix("torch.")
)
@pytest.mark.parametrize(
    "phase", ["prefill", "chunked_prefill", "decode", "verify_tree", "draft_block"]
)
def test_host_fp16_bf16_fp8_storage_matches_reference(host_lib, phase, dtype, kv_dtype):
    case = replace(PHASES[phase], **CONFIGS["gqa_yarn_qknorm"])
    assert_matches(host_lib, case, dtype, kv_dtype, seed=7)
    case = replace(PHASES[phase], **CONFIGS["mha_sliding_window"])
    assert_matches(host_lib, case, dtype, kv_dtype, seed=8)


def test_chunked_prefill_equals_one_prefill_bit_for_bit(host_lib):
    """Keys are rounded to the cache dtype before use, so splitting a prompt changes nothing."""
    case = replace(PHASES["prefill"], past=(0,), lengths=(9,), seq_len=9, qk_norm=True)
    inputs = make_inputs(case, torch.float16, torch.float16, seed=3)
    _, _, whole_out, whole_cache = run_host(host_lib, case, inputs)
    first = replace(case, lengths=(5,), seq_len=5)
    head = replace(inputs, qkv=inputs.qkv[:, :5].contiguous(), positions=inputs.positions[:, :5])
    head = replace(head, input_lengths=torch.tensor([5], dtype=torch.int32))
    _, _, out_a, cache_a = run_host(host_lib, first, head)
    second = replace(case, past=(5,), lengths=(4,), seq_len=4)
    tail = replace(
        inputs,
        qkv=inputs.qkv[:, 5:].contiguous(),
        kv_cache=cache_a,
        positions=inputs.positions[:, 5:].contiguous(),
        past_lengths=torch.tensor([5], dtype=torch.int32),
        input_lengths=torch.tensor([4], dtype=torch.int32),
    )
    _, _, out_b, cache_b = run_host(host_lib, second, tail)
    assert torch.equal(
        torch.cat((out_a, out_b), dim=1).view(torch.int16), whole_out.view(torch.int16)
    )
    assert torch.equal(cache_b.view(torch.int16), whole_cache.view(torch.int16))


def test_fp8_cache_scale_is_applied_on_write_and_read(host_lib):
    """stored = fp8(x / kv_scale), read = fp8 * kv_scale.

    Doubling K and V with kv_scale 2 stores the same bytes; with the softmax scale halved the
    scores are unchanged, so the output (a mix of doubled values) doubles.
    """
    case = replace(PHASES["prefill"], past=(0,), lengths=(3,), seq_len=3, rotary_dim=0)
    inputs = make_inputs(case, torch.float16, torch.float8_e4m3fn, seed=5)
    _, _, out_1, cache_1 = run_host(host_lib, case, inputs, kv_scale=1.0)
    doubled = inputs.qkv.clone()
    doubled[..., case.num_q_heads * case.head_dim :] *= 2  # k and v parts
    scale = case.head_dim**-0.5 / 2
    _, _, out_2, cache_2 = run_host(host_lib, case, replace(inputs, qkv=doubled), 2.0, scale)
    assert torch.equal(cache_1.view(torch.uint8), cache_2.view(torch.uint8))
    torch.testing.assert_close(out_2.float(), 2 * out_1.float(), atol=4e-3, rtol=2e-3)


def _convert(lib: ctypes.CDLL, src: torch.Tensor, dst_dtype: torch.dtype) -> torch.Tensor:
    dst = torch.empty(src.shape, dtype=dst_dtype)
    status = lib.eb_host_convert(
        src.data_ptr(), EB_DTYPE[src.dtype], dst.data_ptr(), EB_DTYPE[dst_dtype], src.numel()
    )
    assert status == EB_OK
    return dst


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_c_conversions_round_like_torch_bit_for_bit(host_lib, dtype):
    gen = torch.Generator().manual_seed(0)
    limit = 448.0 if dtype == torch.float8_e4m3fn else 6e4
    values = torch.cat(
        (
            torch.randn(20000, generator=gen) * torch.logspace(-12, 3, 20000),
            torch.rand(20000, generator=gen) * 2 * limit - limit,
            torch.tensor(
                [0.0, -0.0, 1.0, -1.0, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-9, 2.0**-10]
            ),
            torch.tensor([65504.0, 65519.0, 448.0, -448.0, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11]),
        )
    ).float()
    values = values.clamp(-limit, limit)
    expected = values.to(dtype)
    got = _convert(host_lib, values, dtype)
    bits = torch.int8 if dtype == torch.float8_e4m3fn else torch.int16
    mismatch = (got.view(bits) != expected.view(bits)).nonzero()
    assert mismatch.numel() == 0, f"first mismatches at {values[mismatch[:5, 0]].tolist()}"
    back = _convert(host_lib, expected, torch.float32)
    assert torch.equal(back, expected.float())


def test_invalid_attributes_are_refused_with_a_message(host_lib):
    case = replace(PHASES["decode"], num_q_heads=3, num_kv_heads=2)
    inputs = make_inputs(replace(case, num_q_heads=4), torch.float32, torch.float32, seed=1)
    status, message, _, _ = run_host(host_lib, case, inputs)
    assert status == EB_ERR_INVALID_ARGUMENT
    assert "num_q_heads (3)" in message and "num_kv_heads (2)" in message


def _attributes_only(**overrides) -> EbAttentionParams:
    """SmolLM2-like attributes (RoPE on) with no shape and no tensor, as createPlugin has them."""
    values = dict(
        struct_size=ctypes.sizeof(EbAttentionParams),
        num_q_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rotary_dim=64,
        page_size=32,
        causal=1,
        write_kv=1,
        io_dtype=1,
        kv_dtype=1,
        scale=0.125,
        rms_norm_eps=1e-5,
        kv_scale=1.0,
    )
    return EbAttentionParams(**{**values, **overrides})


def test_attribute_validation_needs_no_tensors(host_lib):
    """Regression (issue 15): createPlugin has attributes only; RoPE must not ask for its table.

    The full check (``eb_validate_params``) refuses the same struct because the tensors are NULL;
    the attribute check (what the plugin's createPlugin runs) accepts it and still refuses
    bad attributes, naming the field.
    """
    err = ctypes.create_string_buffer(256)
    params = _attributes_only()
    assert host_lib.eb_host_validate_attributes(ctypes.byref(params), err, len(err)) == EB_OK
    for extra in ({"qk_norm": 1}, {"has_tree_mask": 1}, {"kv_dtype": 3}, {"rotary_dim": 0}):
        params = _attributes_only(**extra)
        status = host_lib.eb_host_validate_attributes(ctypes.byref(params), err, len(err))
        assert status == EB_OK, (extra, err.value)
    full = _attributes_only(batch=1, seq_len=1, max_position=8)
    assert host_lib.eb_host_paged_attention(ctypes.byref(full), err, len(err)) != EB_OK
    bad = {
        "rotary_dim": (66, b"rotary_dim (66)"),
        "num_kv_heads": (2, b"num_kv_heads (2)"),
        "causal": (2, b"causal (2)"),
        "page_size": (0, b"page_size (0)"),
    }
    for field_name, (value, needle) in bad.items():
        params = _attributes_only(**{field_name: value})
        status = host_lib.eb_host_validate_attributes(ctypes.byref(params), err, len(err))
        assert status == EB_ERR_INVALID_ARGUMENT and needle in err.value, field_name
    params = _attributes_only(kv_dtype=3, kv_scale=0.0)
    assert host_lib.eb_host_validate_attributes(ctypes.byref(params), err, len(err)) != EB_OK
    assert b"kv_scale" in err.value


def test_bad_page_id_is_refused_before_any_write(host_lib):
    case = PHASES["chunked_prefill"]
    inputs = make_inputs(case, torch.float32, torch.float32, seed=2)
    inputs.page_table[1, 0] = inputs.kv_cache.shape[0]  # one past the pool
    status, message, _, cache = run_host(host_lib, case, inputs)
    assert status == EB_ERR_INVALID_DATA
    assert "sequence 1" in message and "page id" in message
    assert torch.equal(cache, inputs.kv_cache)


def test_stale_struct_mirror_is_refused(host_lib):
    params = EbAttentionParams(struct_size=ctypes.sizeof(EbAttentionParams) - 8)
    err = ctypes.create_string_buffer(256)
    status = host_lib.eb_host_paged_attention(ctypes.byref(params), err, len(err))
    assert status == EB_ERR_INVALID_ARGUMENT
    assert b"stale" in err.value


EMULATION_FLAGS = [
    "-std=c++20",
    "-O2",
    "-U_FORTIFY_SOURCE",  # the fortified longjmp refuses the emulator's stack switches
    "-ffp-contract=off",
    "-DEB_KERNEL_EMULATION",
    f"-I{PLUGINS / 'include'}",
    "-include",
    str(PLUGINS / "tests" / "cuda_emulation.h"),
]


def _build_emulated_cuda_check() -> Path:
    """g++ build of the real kernels + GPU check driver on the CPU emulation (cached)."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found on PATH: cannot build the emulated CUDA check")
    sources = [
        PLUGINS / "src" / "attention_kernels.cu",
        PLUGINS / "tests" / "cuda_check.cu",
        PLUGINS / "tests" / "cuda_emulation.h",
        *HOST_SOURCES,
        PLUGINS / "include" / "edgebuild" / "attention_kernels.h",
    ]
    digest = hashlib.sha256(" ".join(EMULATION_FLAGS).encode())
    for path in sources:
        digest.update(path.read_bytes())
    exe = BUILD_DIR / f"emulated_cuda_check-{digest.hexdigest()[:16]}"
    if exe.exists():
        return exe
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    objects = []
    for source, flags in (
        (sources[0], [*EMULATION_FLAGS, "-x", "c++"]),
        (sources[1], [*EMULATION_FLAGS, "-x", "c++"]),
        (HOST_SOURCES[0], ["-std=c++17", "-O2", "-ffp-contract=off", f"-I{PLUGINS / 'include'}"]),
    ):
        obj = BUILD_DIR / f"{source.stem}-emu-{os.getpid()}.o"
        cmd = [gxx, *flags, "-c", str(source), "-o", str(obj)]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            pytest.fail(f"emulation build failed: {' '.join(cmd)}\n{result.stderr}")
        objects.append(str(obj))
    tmp = exe.with_suffix(f".{os.getpid()}.tmp")
    subprocess.run([gxx, *objects, "-o", str(tmp)], check=True, timeout=300)
    os.replace(tmp, exe)
    for obj in objects:
        Path(obj).unlink()
    return exe


def test_cuda_kernels_run_under_cpu_emulation_and_match_the_host_build():
    """The real CUDA kernels (attention_kernels.cu) on plugins/tests/cuda_emulation.h.

    Runs plugins/tests/cuda_check.cu --quick: every phase, six head configs (head_dim 16 to
    256, multi-tile shapes), fp32 and bf16 + fp8 cache, tiled and row kernels, each against
    the host build: cache bytes identical, outputs within the fp32/bf16 tolerances. Block
    barriers and warp shuffles are emulated with fibers, so barrier misuse deadlocks loudly.
    """
    exe = _build_emulated_cuda_check()
    result = subprocess.run(
        [str(exe), "--no-timing", "--quick"], capture_output=True, text=True, timeout=600
    )
    failures = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert result.returncode == 0, "\n".join(failures[:20]) + result.stderr[-2000:]
    assert re.search(r"correctness: (\d+) passed, 0 failed", result.stdout)
    assert int(re.search(r"correctness: (\d+) passed", result.stdout).group(1)) >= 300


def test_nvcc_compiles_every_kernel_for_all_targets():
    """scripts/check_cuda_compile.sh: every .cu under plugins/ for sm_87, sm_90 and sm_110.

    Compiles once per source content (a stamp under build/ records the last success), so the
    suite pays the ~minute of nvcc only when a kernel source changed.
    """
    nvcc = shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None
    )
    if nvcc is None:
        pytest.skip("nvcc not found (PATH, /usr/local/cuda/bin): CUDA compile check not run")
    script = ROOT / "scripts" / "check_cuda_compile.sh"
    digest = hashlib.sha256(script.read_bytes())
    for path in sorted([*PLUGINS.rglob("*.cu"), *PLUGINS.rglob("*.h"), *PLUGINS.rglob("*.cuh")]):
        digest.update(str(path.relative_to(ROOT)).encode() + path.read_bytes())
    stamp = ROOT / "build" / "cuda_compile_check" / f"ok-{digest.hexdigest()[:16]}"
    if stamp.exists():
        return
    env = {**os.environ, "NVCC": nvcc}
    result = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, timeout=900, env=env, cwd=ROOT
    )
    assert result.returncode == 0, f"nvcc compile check failed:\n{result.stdout}\n{result.stderr}"
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(result.stdout)
