"""edgebuild's fp32 linear (edgebuild/ops/f32_linear.py, ops/kernels/f32_linear.cpp).

Oracles: the packed layout is unpacked here element by element and compared with the weight;
the product is compared with x @ W.T + b in fp64 within the error bound of a chain of fp32
FMAs; rows are compared bit for bit with 1-row calls and calls of other row counts, and at
1 and 2 threads. The kernel tests skip where the CPU lacks AVX2 / FMA (the fallback, torch's
linear, is covered by tests/test_batch_invariance.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from edgebuild.errors import MissingDependencyError
from edgebuild.ops import amx_linear, cpu_build, f32_linear
from edgebuild.ops import linear as linear_mod
from edgebuild.ops.linear import PackedLinear

_off = os.environ.get(f32_linear.ENV, "").strip().lower() == "torch"
needs_kernel = pytest.mark.skipif(
    _off or f32_linear._why_not() is not None,
    reason=f"no fp32 kernel here: {'EDGEBUILD_FP32_KERNEL=torch' if _off else f32_linear._why_not()}",
)

_AVX512 = "avx512f" in cpu_build.cpu_flags()
# the fp32 / bf16 weights' two loops: AVX2 (one FMA chain per output and chunk) everywhere,
# AVX-512 (two chains: the chunk's even and odd k) where the CPU has it (the default there);
# f32_linear.avx512 switches
F32_LOOPS = [
    pytest.param(False, id="avx2"),
    pytest.param(
        True, id="avx512", marks=pytest.mark.skipif(not _AVX512, reason="the CPU lacks avx512f")
    ),
]


def _switching(switch):
    """A fixture's body: yields ``use(on)``, which sets a kernel loop switch of
    :mod:`edgebuild.ops.f32_linear` (``switch(on)``) for a test; restores it after."""
    before = switch() if f32_linear.available() else None

    def use(on: bool) -> None:
        assert switch(on) is on

    yield use
    if before is not None:
        switch(before)


@pytest.fixture
def f32_loop():
    """Set the fp32 kernel's loop for a test (f32_linear.avx512) and restore it after."""
    yield from _switching(f32_linear.avx512)


def _f32_exact(x, w, bias, two_chains: bool) -> torch.Tensor:
    """The fp32 kernel's documented arithmetic, step by step in fp64 with each fp32 rounding
    done explicitly: per output, each chunk of 32 k is summed by FMAs in increasing k (one
    chain; or, ``two_chains``, the chunk's even k and its odd k in two chains, added at the
    chunk's end), the chunk's sum is added to the running total, then the bias. An FMA is
    ``fp32(a + x w)`` (x w is exact in fp64; fp64's 53 bits round the sum first, which differs
    from one rounding only at a tie, not met by these seeded inputs)."""
    x, w = x.double(), w.double()
    rows, k = x.shape
    tot = torch.zeros(rows, w.shape[0], dtype=torch.float64)
    f32 = lambda t: t.float().double()  # noqa: E731
    for k0 in range(0, k, 32):
        chains = [torch.zeros_like(tot), torch.zeros_like(tot)]
        for kk in range(k0, min(k, k0 + 32)):
            c = (kk - k0) % 2 if two_chains else 0
            chains[c] = f32(chains[c] + x[:, kk : kk + 1] * w[:, kk])
        chunk = f32(chains[0] + chains[1]) if two_chains else chains[0]
        tot = f32(tot + chunk)
    if bias is not None:
        tot = f32(tot + bias.double())
    return tot.float()


def test_pack_layout_holds_every_weight_and_zero_padding():
    torch.manual_seed(0)
    w = torch.randn(20, 37)  # 20 outputs: one whole block of 16 and 4 of the next
    p = f32_linear.pack(w)
    assert p.shape == (2, 37, 16) and p.dtype == torch.float32
    for n in range(32):
        for k in range(37):
            want = float(w[n, k]) if n < 20 else 0.0
            assert float(p[n // 16, k, n % 16]) == want, (n, k)
    b = f32_linear.pack_bias(torch.arange(20.0), p)
    assert b.tolist() == list(range(20)) + [0.0] * 12


@needs_kernel
@pytest.mark.parametrize("n,k", [(20, 64), (37, 33), (960, 576), (576, 1536), (3000, 576)])
@pytest.mark.parametrize("loop", F32_LOOPS)
def test_kernel_equals_fp64_and_is_row_invariant(n, k, loop, f32_loop):
    assert f32_linear.available()
    f32_loop(loop)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=g) * 0.05
    bias = torch.randn(n, generator=g)
    p = f32_linear.pack(w)
    b = f32_linear.pack_bias(bias, p)
    x = torch.randn(40, k, generator=g)
    full = f32_linear.linear(x, p, b, n)
    assert full.shape == (40, n) and full.dtype == torch.float32
    ref = x.double() @ w.double().t() + bias.double()
    # a chain of k fp32 FMAs, then one add: |err| <= (k + 1) u sum |x w| + u |y|, u = 2^-24
    bound = (x.double().abs() @ w.double().abs().t()) * (k + 1) * 2.0**-24
    assert ((full.double() - ref).abs() <= bound + 2.0**-24 * ref.abs() + 1e-30).all()
    for rows in (1, 2, 5, 6, 7, 12, 13, 33):  # 6 rows share a pass: groups and remainders
        assert torch.equal(f32_linear.linear(x[:rows].contiguous(), p, b, n), full[:rows]), rows
    one = torch.cat([f32_linear.linear(x[i : i + 1], p, b, n) for i in range(40)])
    assert torch.equal(one, full)
    nobias = f32_linear.linear(x, p, None, n)
    torch.testing.assert_close(nobias.double(), x.double() @ w.double().t(), rtol=1e-5, atol=1e-5)
    assert f32_linear.linear(x[:0], p, b, n).shape == (0, n)


@needs_kernel
@pytest.mark.parametrize("loop", F32_LOOPS)
def test_chunked_sums_are_as_accurate_as_mkl(loop, f32_loop):
    """Each chunk of 32 k is summed apart, then added to the total: rms error 6.4e-9 of
    sum |x w| at K = 1536 (MKL's sgemm 1.0e-8; one FMA chain over all of K was 2.8e-8, enough
    to push a 30-layer NVFP4 model's logits out of the onnxruntime parity tolerance); the
    AVX-512 loop's two chains a chunk are no less accurate."""
    assert f32_linear.available()
    f32_loop(loop)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(576, 1536, generator=g) * 0.05
    x = torch.randn(8, 1536, generator=g) + 0.5  # a mean: the partial sums grow
    ref = x.double() @ w.double().t()
    scale = x.double().abs() @ w.double().abs().t()
    got = f32_linear.linear(x, f32_linear.pack(w), None, 576).double()
    rms = float((((got - ref) / scale) ** 2).mean().sqrt())
    assert rms < 1.2e-8, rms


@needs_kernel
@pytest.mark.parametrize("storage", ["fp32", "auto"])
@pytest.mark.parametrize("loop", F32_LOOPS)
def test_each_loop_sums_in_its_documented_order(storage, loop, f32_loop):
    """Every row count 1-13 (groups of 6 and remainders), K not a multiple of 32 nor of 2 (an
    odd-length last chunk), the last block part-filled, bias or none, fp32 and bf16 storage:
    the kernel's bits are those of its loop's arithmetic done step by step (_f32_exact)."""
    assert f32_linear.available()
    f32_loop(loop)
    g = torch.Generator().manual_seed(21)
    for n, k in [(16, 32), (37, 33), (40, 95), (24, 64)]:
        w = (torch.randn(n, k, generator=g) * 0.05).bfloat16().float()
        p = f32_linear.pack(w, storage)
        assert p.dtype == (torch.bfloat16 if storage == "auto" else torch.float32)
        bias = torch.randn(n, generator=g)
        x = torch.randn(13, k, generator=g) + 0.25
        for b in (None, bias):
            want = _f32_exact(x, w, b, two_chains=loop)
            pb = None if b is None else f32_linear.pack_bias(b, p)
            for rows in range(1, 14):
                got = f32_linear.linear(x[:rows].contiguous(), p, pb, n)
                assert torch.equal(got, want[:rows]), (n, k, rows, b is None)


@needs_kernel
@pytest.mark.parametrize("loop", F32_LOOPS)
def test_two_threads_give_the_same_bits(loop, f32_loop):
    assert f32_linear.available()
    f32_loop(loop)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(1000, 576, generator=g)
    p = f32_linear.pack(w)
    x = torch.randn(9, 576, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = f32_linear.linear(x, p, None, 1000)
        torch.set_num_threads(2)
        two = f32_linear.linear(x, p, None, 1000)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_kernel
def test_packed_linear_uses_the_kernel_for_fp32_with_bias():
    torch.manual_seed(3)
    mods = [torch.nn.Linear(64, n, bias=True) for n in (24, 8)]
    packed = PackedLinear(mods)
    assert packed.f32_kernel
    x = torch.randn(3, 5, 64)
    want = torch.cat([m(x) for m in mods], dim=-1)
    got = packed(x)
    assert got.shape == (3, 5, 32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(packed(x[1:2, 2:3]), got[1:2, 2:3])  # one row: the same bits
    bf16 = PackedLinear([torch.nn.Linear(64, 8).to(torch.bfloat16)])
    assert not bf16.f32_kernel  # bf16 weights never take the fp32 path (fused fp32 steps)
    assert bf16.bf16_f32 == linear_mod.bf16_on_f32_kernel()  # but may take the kernel (below)


@needs_kernel
def test_bf16_linears_without_amx_run_the_kernel_rounded_once(monkeypatch):
    """A bf16 linear where AMX's kernel does not run: the fp32 kernel on the bf16 weights,
    each output accumulated in fp32 over exact products and rounded to bf16 once (as oneDNN's
    bf16 linear, in another order); row-invariant; EDGEBUILD_BF16_KERNEL=onednn turns it off."""
    monkeypatch.setattr(amx_linear, "bf16_available", lambda: False)
    linear_mod.bf16_on_f32_kernel.cache_clear()
    try:
        torch.manual_seed(6)
        mods = [
            torch.nn.Linear(576, n, bias=b).to(torch.bfloat16)
            for n, b in ((100, True), (40, False))
        ]
        packed = PackedLinear(mods)
        assert packed.bf16_f32 and packed.weight.dtype == torch.bfloat16
        assert packed.kernel_call() is None  # not the fp32 layer loop's
        x = torch.randn(2, 9, 576).bfloat16()
        got = packed(x)
        assert got.dtype == torch.bfloat16 and got.shape == (2, 9, 140)
        w = torch.cat([m.weight for m in mods]).float()
        b = torch.cat([mods[0].bias.float(), torch.zeros(40)])
        p32 = f32_linear.pack(w, "fp32")
        want = f32_linear.linear(x.float(), p32, f32_linear.pack_bias(b, p32), 140)
        assert torch.equal(got, want.bfloat16())  # the fp32 result, rounded once
        ref = x.double() @ w.double().t() + b.double()
        assert (got.double() - ref).abs().max() <= 2.0**-8 * ref.abs().max()  # bf16 rounding
        for i in range(9):  # each row alone: the same bits
            assert torch.equal(packed(x[:, i : i + 1]), got[:, i : i + 1])
        res = torch.randn(2, 9, 140).bfloat16()
        assert torch.equal(packed(x, residual=res), res + got)
        monkeypatch.setenv(f32_linear.ENV, "torch")
        f32_linear._reset()  # the switches' resets forget this decision too
        assert not PackedLinear(mods).bf16_f32
        monkeypatch.delenv(f32_linear.ENV)
        f32_linear._reset()
        assert PackedLinear(mods).bf16_f32
        monkeypatch.setenv(amx_linear.BF16_ENV, "onednn")
        amx_linear._reset()
        assert not PackedLinear(mods).bf16_f32
    finally:
        monkeypatch.delenv(amx_linear.BF16_ENV, raising=False)
        monkeypatch.delenv(f32_linear.ENV, raising=False)
        f32_linear._reset()
        amx_linear._reset()


def test_bf16_exact_weights_are_packed_as_bf16_in_the_kernels_order():
    torch.manual_seed(4)
    w = torch.randn(20, 37).bfloat16().float()  # every value a bf16: a bf16 checkpoint in fp32
    assert f32_linear.exactly_bf16(w) and not f32_linear.exactly_bf16(w + 1e-3)
    p = f32_linear.pack(w)
    assert p.shape == (2, 37, 16) and p.dtype == torch.bfloat16
    order = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]  # as the kernel unpacks
    for n in range(32):
        for k in range(37):
            want = float(w[n, k]) if n < 20 else 0.0
            assert float(p[n // 16, k, order.index(n % 16)]) == want, (n, k)
    assert f32_linear.pack(w, "fp32").dtype == torch.float32
    assert f32_linear.pack(w + 1e-3).dtype == torch.float32  # not exactly bf16: fp32


@needs_kernel
@pytest.mark.parametrize("n,k", [(20, 64), (37, 33), (960, 576), (3000, 576)])
@pytest.mark.parametrize("loop", F32_LOOPS)
def test_bf16_stored_weights_give_the_fp32_layouts_bits(n, k, loop, f32_loop):
    """Widening a bf16 to fp32 is exact, so the kernel's products and sums are the same: every
    row count (1-2 rows without software prefetch, 3+ with it; 6 rows a pass) and the fused
    steps give the fp32 layout's bits exactly."""
    f32_loop(loop)
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16().float()
    bias = torch.randn(n, generator=g)
    p32, p16 = f32_linear.pack(w, "fp32"), f32_linear.pack(w)
    assert p16.dtype == torch.bfloat16
    b = f32_linear.pack_bias(bias, p32)
    x = torch.randn(40, k, generator=g)
    full = f32_linear.linear(x, p16, b, n)
    assert torch.equal(full, f32_linear.linear(x, p32, b, n))
    for rows in (1, 2, 3, 5, 6, 7, 8, 13):
        assert torch.equal(f32_linear.linear(x[:rows].contiguous(), p16, b, n), full[:rows])
    nw = torch.rand(k, generator=g) + 0.5
    res = torch.randn(7, n, generator=g)
    kw = dict(norm_weight=nw, eps=1e-5, residual=res)
    assert torch.equal(
        f32_linear.linear(x[:7], p16, b, n, **kw), f32_linear.linear(x[:7], p32, b, n, **kw)
    )


def test_the_weight_storage_switch(monkeypatch):
    w = torch.randn(16, 32).bfloat16().float()
    try:
        monkeypatch.setenv(f32_linear.WEIGHTS_ENV, "fp32")
        f32_linear._reset()
        assert f32_linear.pack(w).dtype == torch.float32
        monkeypatch.setenv(f32_linear.WEIGHTS_ENV, "half")
        f32_linear._reset()
        with pytest.raises(MissingDependencyError, match="EDGEBUILD_FP32_WEIGHTS='half'"):
            f32_linear.pack(w)
    finally:
        monkeypatch.delenv(f32_linear.WEIGHTS_ENV)
        f32_linear._reset()
    assert f32_linear.pack(w).dtype == torch.bfloat16


def test_the_switch_turns_the_kernel_off_and_rejects_bad_values(monkeypatch):
    try:
        monkeypatch.setenv(f32_linear.ENV, "torch")
        f32_linear._reset()
        assert not f32_linear.available()
        assert not PackedLinear([torch.nn.Linear(32, 16)]).f32_kernel
        monkeypatch.setenv(f32_linear.ENV, "sse9")
        f32_linear._reset()
        with pytest.raises(MissingDependencyError, match="EDGEBUILD_FP32_KERNEL='sse9'"):
            f32_linear.available()
    finally:
        monkeypatch.delenv(f32_linear.ENV)
        f32_linear._reset()


def test_int4_pack_layout_holds_every_code_scale_and_lo():
    from edgebuild.ops.linear import quantize_int4

    torch.manual_seed(4)
    n, k = 20, 64  # 20 outputs: block 1 holds 4 real outputs and 12 padding ones
    codes, sz = quantize_int4(torch.randn(n, k))
    pc, sl = f32_linear.pack_int4(codes, sz)
    assert pc.shape == (2, k, 8) and pc.dtype == torch.uint8
    assert sl.shape == (2, k // 32, 2, 16) and sl.dtype == torch.float32
    for o in range(32):
        b, j = divmod(o, 16)
        for kk in range(k):
            byte = int(pc[b, kk, j % 8])
            got = byte & 0xF if j < 8 else byte >> 4
            assert got == (int(codes[o, kk]) if o < n else 0), (o, kk)
        for g in range(k // 32):
            s, lo = float(sl[b, g, 0, j]), float(sl[b, g, 1, j])
            if o < n:
                want_s, z = float(sz[g, o, 0]), float(sz[g, o, 1])
                assert s == want_s and lo == float(torch.tensor(z) - 8 * torch.tensor(want_s))
            else:
                assert s == 0.0 and lo == 0.0


@needs_kernel
@pytest.mark.parametrize("n,k", [(20, 64), (960, 576), (576, 1536)])
def test_int4_kernel_equals_the_dequantized_weight_in_fp64_and_is_row_invariant(n, k):
    from edgebuild.ops.linear import dequantize_int4, quantize_int4

    assert f32_linear.available()
    g = torch.Generator().manual_seed(5)
    codes, sz = quantize_int4(torch.randn(n, k, generator=g) * 0.05)
    bias = torch.randn(n, generator=g)
    pc, sl = f32_linear.pack_int4(codes, sz)
    b = f32_linear.pack_bias(bias, pc)
    x = torch.randn(40, k, generator=g)
    full = f32_linear.linear_int4(x, pc, sl, b, n)
    deq = dequantize_int4(codes, sz).double()
    ref = x.double() @ deq.t() + bias.double()
    # w = fma(code, scale, lo) differs from (code - 8) * scale + zero by ~2 roundings of |w|;
    # then the chunked fp32 sum: a few ulps of sum |x w|
    scale = x.double().abs() @ deq.abs().t()
    assert ((full.double() - ref).abs() <= 2.0**-18 * scale + 2.0**-22 * ref.abs() + 1e-6).all()
    for rows in (1, 2, 5, 6, 7, 13, 33):
        part = f32_linear.linear_int4(x[:rows].contiguous(), pc, sl, b, n)
        assert torch.equal(part, full[:rows]), rows
    one = torch.cat([f32_linear.linear_int4(x[i : i + 1], pc, sl, b, n) for i in range(40)])
    assert torch.equal(one, full)


@needs_kernel
def test_packed_linear_uses_the_int4_kernel_for_fp32_inputs(monkeypatch):
    torch.manual_seed(6)
    lin = torch.nn.Linear(64, 40, bias=True)
    monkeypatch.setenv(f32_linear.ACT_ENV, "fp32")  # the inputs as they are
    f32_linear._reset()
    try:
        packed = PackedLinear([lin], quant="int4")
    finally:
        monkeypatch.delenv(f32_linear.ACT_ENV)
        f32_linear._reset()
    assert packed.int4_f32 and not packed.f32_kernel and not packed.int4_a8
    x = torch.randn(3, 5, 64)
    y = packed(x)
    assert y.shape == (3, 5, 40) and y.dtype == torch.float32
    from edgebuild.ops.linear import dequantize_int4, quantize_int4

    codes, sz = quantize_int4(lin.weight)
    ref = x.double() @ dequantize_int4(codes, sz).double().t() + lin.bias.double()
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(packed(x[2:3, 4:5]), y[2:3, 4:5])


def _refused_mismatched_scales(pack, k: int):
    """(codes, scale_and_zero) of a random [20, k] weight, after checking that ``pack``
    refuses scales of the wrong shape by name."""
    from edgebuild.ops.linear import quantize_int4

    codes, sz = quantize_int4(torch.randn(20, k))
    with pytest.raises(ValueError, match=rf"scale_and_zero \[{k // 32}, 20, 2\]"):
        pack(codes, sz[:1])
    return codes, sz


def test_bad_shapes_are_refused_with_what_was_wrong():
    _refused_mismatched_scales(f32_linear.pack_int4, 64)
    if not f32_linear.available():
        return
    w = f32_linear.pack(torch.randn(20, 64))
    with pytest.raises(RuntimeError, match="bias must be fp32"):
        f32_linear.linear(torch.randn(3, 64), w, torch.randn(5), 20)
    with pytest.raises(RuntimeError, match="out 40 does not match 2 blocks"):
        f32_linear.linear(torch.randn(3, 64), w, None, 40)
    with pytest.raises(RuntimeError, match="x has 32 inputs"):
        f32_linear.linear(torch.randn(3, 32), w, None, 20)


# ------------------------------------------------------------ fused norm / SwiGLU / residual
def _fp64_rms_norm(x, w, eps):
    x = x.double()
    return w.double() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@needs_kernel
@pytest.mark.parametrize("quant", [None, "int4-fp32", "int4-int8"])
@pytest.mark.parametrize("k,n", [(576, 1536), (1536, 576), (64, 40)])
def test_fused_steps_equal_fp64_and_stay_row_invariant(quant, k, n, monkeypatch):
    """norm / swiglu / residual inside the kernel's call against the fp64 composition (the
    linear's own bound plus the prologue's rounding), more accurate than torch's fp32 ops,
    every row equal to its 1-row call, the residual added exactly (bit for bit ``r + y``).
    int4 with int8 inputs: within the inputs' quantization bound (sum of sx / 2 |w|)."""
    from edgebuild.models.common import RMSNorm

    if quant is not None:
        monkeypatch.setenv(f32_linear.ACT_ENV, quant.split("-")[1])
        f32_linear._reset()

    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        lin.bias.copy_(torch.randn(n, generator=g))
    norm = RMSNorm(k, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(k, generator=g) + 0.5)
    try:
        p = PackedLinear([lin], quant and "int4")
    finally:  # the switch is read once: forget this test's value
        monkeypatch.delenv(f32_linear.ACT_ENV, raising=False)
        f32_linear._reset()
    assert p.f32_kernel or p.int4_f32
    assert p.int4_a8 == (quant == "int4-int8")
    w = lin.weight.double() if quant is None else _int4_weight(lin.weight).double()
    x = torch.randn(9, k, generator=g) * 3
    gu = torch.randn(9, 2 * k, generator=g) * 4
    res = torch.randn(9, n, generator=g)
    with torch.no_grad():
        cases = {
            "norm": (p(x, norm), _fp64_rms_norm(x, norm.weight, 1e-5), p(norm(x))),
            "swiglu": (
                p(gu, swiglu=True),
                torch.nn.functional.silu(gu[:, :k].double()) * gu[:, k:].double(),
                p(torch.nn.functional.silu(gu[:, :k]) * gu[:, k:]),
            ),
        }
        for name, (got, h, torch_ops) in cases.items():
            ref = h @ w.t() + lin.bias.double()
            scale = h.abs() @ w.abs().t() + lin.bias.double().abs()
            if p.int4_a8:  # + the int8 rounding of each input (half a step sx = max|h| / 127)
                sx = h.reshape(9, -1, 32).abs().amax(-1, keepdim=True) / 127
                step = (sx / 2).expand(-1, -1, 32).reshape(9, k)
                bound = step @ w.abs().t() + 2e-6 * scale
                assert ((got.double() - ref).abs() <= bound).all(), name
            else:
                err = ((got.double() - ref).abs() / scale).max().item()
                err_torch = ((torch_ops.double() - ref).abs() / scale).max().item()
                assert err < 2e-6 and err <= 1.5 * err_torch, (name, err, err_torch)
            rows = torch.cat(
                [p(gu[i : i + 1], swiglu=True) if name == "swiglu" else p(x[i : i + 1], norm)
                 for i in range(9)]
            )  # fmt: skip
            assert torch.equal(rows, got), name
        assert torch.equal(p(x, residual=res), res + p(x))
        assert torch.equal(p(x.view(3, 3, k), norm, residual=res.view(3, 3, n)).view(9, n),
                           res + p(x, norm))  # fmt: skip


def _int4_weight(w):
    from edgebuild.ops.linear import dequantize_int4, quantize_int4

    return dequantize_int4(*quantize_int4(w.detach()))


@needs_kernel
def test_swiglu_follows_silu_at_the_extremes():
    """silu(g) * 1 for g far out (exp clamped at +-88.38): equal to torch's within 1e-6
    relative, or both below 1e-33 in magnitude (g <= -88: g / e^88, where torch's is ~0);
    never inf or nan."""
    g = torch.tensor([-1e4, -200.0, -88.5, -50.0, -10.0, -1e-3, 0.0, 1e-30, 1.0, 10.0, 50.0,
                      88.5, 100.0, 1e4, -0.5, 3.0])  # fmt: skip
    w = torch.eye(16)
    y = f32_linear.linear(torch.cat([g, torch.ones(16)])[None], f32_linear.pack(w), None, 16,
                          swiglu=True)[0]  # fmt: skip
    want = torch.nn.functional.silu(g)
    assert torch.isfinite(y).all()
    assert torch.allclose(y, want, rtol=1e-6, atol=1e-33), (y, want)


@needs_kernel
def test_fused_steps_refuse_bad_arguments_by_name():
    p = f32_linear.pack(torch.randn(16, 32))
    x = torch.randn(2, 32)
    with pytest.raises(RuntimeError, match="norm_weight must be fp32 \\[32\\]"):
        f32_linear.linear(x, p, None, 16, norm_weight=torch.ones(31))
    with pytest.raises(RuntimeError, match="cannot both"):
        f32_linear.linear(torch.randn(2, 64), p, None, 16, norm_weight=torch.ones(32), swiglu=True)
    with pytest.raises(RuntimeError, match="swiglu: x must be gate \\| up"):
        f32_linear.linear(x, p, None, 16, swiglu=True)
    with pytest.raises(RuntimeError, match="residual must be fp32"):
        f32_linear.linear(x, p, None, 16, residual=torch.zeros(2, 15))
    codes, sl = f32_linear.pack_int4(torch.zeros(16, 32, dtype=torch.int32), torch.ones(1, 16, 2))
    with pytest.raises(RuntimeError, match="int4_f32_linear: residual must be fp32"):
        f32_linear.linear_int4(x, codes, sl, None, 16, residual=torch.zeros(2, 16).double())


def test_packed_linear_runs_the_steps_as_torch_ops_without_the_kernel():
    """The fallback (bf16 here: no fp32 kernel involved) composes norm, SwiGLU and the
    residual exactly as the unfused model did: ``residual + linear(silu(g) * u)``."""
    from edgebuild.models.common import RMSNorm

    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 16).to(torch.bfloat16)
    norm = RMSNorm(32, 1e-6).to(torch.bfloat16)
    p = PackedLinear([lin])
    assert not (p.f32_kernel or p.int4_f32)
    x, gu = torch.randn(3, 32, dtype=torch.bfloat16), torch.randn(3, 64, dtype=torch.bfloat16)
    r = torch.randn(3, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(p(x, norm, residual=r), r + p(norm(x)))
        g, u = gu.chunk(2, -1)
        assert torch.equal(p(gu, swiglu=True), p(torch.nn.functional.silu(g) * u))


# ------------------------------------------------- int4 weights, int8-quantized inputs (W4A8)
def _int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The specified activation quantization in torch, fp32 as the kernel computes it: per row
    and group of 32, sx = max|x| / 127, xq = round-half-even(x / sx) (0 where sx is 0).
    Returns (xq float [rows, in], sx [rows, in / 32])."""
    rows, k = x.shape
    xg = x.reshape(rows, k // 32, 32)
    sx = xg.abs().amax(-1) / 127.0
    xq = torch.where(sx[..., None] > 0, torch.round(xg / sx[..., None]), torch.zeros_like(xg))
    return xq.reshape(rows, k), sx


def _a8_oracle(x, codes, sz, bias):
    """float64: sum_g sx_g sum_k (code * scale + lo) xq (+ bias), with lo = zero - 8 scale
    exact, and the bound of the kernel's fp32 steps (see kernels/f32_linear.cpp): each group's
    term fma(isum, fl(scale sx), fl(lo fl(sx sum xq))) within ~5 roundings of its parts, G
    adds, one bias add: (G + 6) u S + u |y|, S = sum_g |scale sx isum| + |lo sx sum xq|."""
    xq, sx = _int8_rows(x)
    rows, k = x.shape
    n, g = codes.shape[0], k // 32
    c = codes.double().reshape(n, g, 32)
    s, z = sz[..., 0].t().double(), sz[..., 1].t().double()  # [out, G]
    lo = z - 8 * s
    xq3 = xq.double().reshape(rows, g, 32)
    isum = torch.einsum("rgk,ngk->rng", xq3, c)  # exact integers
    a = isum * s[None] * sx.double()[:, None, :]
    b = lo[None] * (sx.double() * xq3.sum(-1))[:, None, :]
    ref = (a + b).sum(-1)
    if bias is not None:
        ref = ref + bias.double()
    bound = (g + 6) * 2.0**-24 * (a.abs() + b.abs()).sum(-1) + 2.0**-24 * ref.abs() + 1e-30
    return ref, bound


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fma(a, b, c), one rounding: a * b is exact in fp64 (24 + 24 bits), the sum's fp64
    rounding error comes from TwoSum, and an fp64 sum exactly halfway between two fp32 values
    (where rounding it again could go the wrong way) goes the way of that error."""
    p, cd = a.double() * b.double(), c.double()
    s = p + cd
    bb = s - p
    err = (p - (s - bb)) + (cd - bb)
    f = s.float()
    fd = f.double()
    nb = torch.nextafter(f, torch.where(s > fd, torch.inf, -torch.inf).float()).double()
    tie = (s != fd) & ((s - fd) * 2 == nb - fd)  # s halfway between f and its neighbour nb
    return torch.where(tie & (err != 0) & ((err > 0) == (nb > fd)), nb.float(), f)


def _a8_exact(x, codes, sz, bias):
    """The int8-input kernel's result bit for bit, in torch (kernels/f32_linear.cpp): per row,
    output and group, c_g = fma(float(isum), fl(scale sx), fl(lo ms)) with the exact integer
    sum isum = sum_k code xq; total = fp32 sum of c_g in increasing g; then total + bias (+ 0
    without one). xq, sx from torch's quantization (_int8_rows), ms = fl(sx sum xq)."""
    xq, sx = _int8_rows(x)
    rows, k = x.shape
    n, g = codes.shape[0], k // 32
    ms = sx * xq.reshape(rows, g, 32).sum(-1)  # sum(xq) is exact in fp32
    isum = torch.einsum("rgk,ngk->rng", xq.double().reshape(rows, g, 32),
                        codes.double().reshape(n, g, 32)).float()  # exact integers  # fmt: skip
    _, sl = f32_linear.pack_int4_a8(codes, sz)  # [block, g, h, scale 0..7 | lo 0..7]
    sl = sl.reshape(-1, g, 2, 2, 8).permute(0, 2, 4, 1, 3).reshape(-1, g, 2)[:n]  # [out, g, 2]
    scale, lo = sl[..., 0], sl[..., 1]
    c = _fma32(isum, scale[None] * sx[:, None], lo[None] * ms[:, None])  # [rows, out, g]
    total = torch.zeros(rows, n)
    for i in range(g):
        total = total + c[..., i]
    return total + (bias if bias is not None else torch.zeros(n))


@needs_kernel
def test_int8_rows_equal_torch_quantization_bit_for_bit():
    assert f32_linear.available()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, 160, generator=g) * torch.logspace(-6, 3, 160)  # groups of every scale
    x[2, 32:64] = 0.0  # a zero group: sx = xq = 0
    x[3, :32] = torch.tensor([1.0, -1.0] * 16) * 127.0 / 2 ** torch.arange(32)  # ties, powers
    x[4, 64:96] = torch.arange(-16, 16) * (2.0 / 127.0)  # x / sx near half-integers
    xq, sx, ms = f32_linear.quantize_rows_int8(x)
    want_q, want_s = _int8_rows(x)
    assert xq.dtype == torch.int8 and xq.shape == (9, 160) and sx.shape == (9, 5)
    assert torch.equal(xq.float(), want_q) and torch.equal(sx, want_s)
    assert int(xq.abs().max()) == 127
    assert torch.equal(ms, sx * want_q.reshape(9, 5, 32).sum(-1))
    bad = x.clone()
    bad[1, 40], bad[5, 0] = float("nan"), float("inf")
    _, sx_bad, ms_bad = f32_linear.quantize_rows_int8(bad)
    assert sx_bad[1, 1].isnan() and ms_bad[5, 0].isnan() and not sx_bad[1, 0].isnan()


def test_int4_a8_pack_layout_holds_every_code_scale_and_lo():
    from edgebuild.ops.linear import quantize_int4

    torch.manual_seed(8)
    n, k = 20, 64
    codes, sz = quantize_int4(torch.randn(n, k))
    pc, sl = f32_linear.pack_int4_a8(codes, sz)
    assert pc.shape == (2, k // 32, 2, 128) and pc.dtype == torch.uint8
    assert sl.shape == (2, k // 32, 32) and sl.dtype == torch.float32
    for o in range(32):
        b, h, j = o // 16, (o // 8) % 2, o % 8
        for kk in range(k):
            g, s, hi, i = kk // 32, (kk % 32) // 8, (kk % 8) // 4, kk % 4
            byte = int(pc[b, g, h, 32 * s + 4 * j + i])
            got = byte >> 4 if hi else byte & 0xF
            assert got == (int(codes[o, kk]) if o < n else 0), (o, kk)
        for g in range(k // 32):
            s, lo = float(sl[b, g, 16 * h + j]), float(sl[b, g, 16 * h + 8 + j])
            if o < n:
                want_s, z = float(sz[g, o, 0]), float(sz[g, o, 1])
                assert s == want_s and lo == float(torch.tensor(z) - 8 * torch.tensor(want_s))
            else:
                assert s == 0.0 and lo == 0.0


_VNNI = {"avx512_vnni", "avx512bw", "avx512vl"} <= cpu_build.cpu_flags()
# the W4A8 kernel's two group loops: AVX2 (vpmaddubsw) everywhere, AVX-512 VNNI (vpdpbusd) where
# the CPU has it (the default there); f32_linear.a8_vnni switches
A8_LOOPS = [
    pytest.param(False, id="avx2"),
    pytest.param(
        True,
        id="vnni",
        marks=pytest.mark.skipif(not _VNNI, reason="the CPU lacks avx512_vnni / bw / vl"),
    ),
]


@pytest.fixture
def a8_loop():
    """Set the W4A8 group loop for a test (f32_linear.a8_vnni) and restore it after."""
    yield from _switching(f32_linear.a8_vnni)


@needs_kernel
@pytest.mark.parametrize(
    "n,k", [(20, 64), (24, 64), (37, 96), (960, 576), (576, 1536), (3000, 576)]
)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("loop", A8_LOOPS)
def test_int4_a8_kernel_equals_the_fp64_oracle_and_is_row_invariant(n, k, with_bias, loop, a8_loop):
    from edgebuild.ops.linear import quantize_int4

    assert f32_linear.available()
    a8_loop(loop)
    g = torch.Generator().manual_seed(9)
    codes, sz = quantize_int4(torch.randn(n, k, generator=g) * 0.05)
    bias = torch.randn(n, generator=g) if with_bias else None
    pc, sl = f32_linear.pack_int4_a8(codes, sz)
    b = f32_linear.pack_bias(bias, pc)
    x = torch.randn(40, k, generator=g) + 0.3 * torch.randn(k, generator=g)  # a mean per input
    full = f32_linear.linear_int4(x, pc, sl, b, n, int8_inputs=True)
    assert full.shape == (40, n) and full.dtype == torch.float32
    ref, bound = _a8_oracle(x, codes, sz, bias)
    assert ((full.double() - ref).abs() <= bound).all()
    assert torch.equal(full, _a8_exact(x, codes, sz, bias))  # the kernel's fp32 steps exactly
    for rows in range(1, 18):  # chunks of 4 rows and their remainders
        part = f32_linear.linear_int4(x[:rows].contiguous(), pc, sl, b, n, int8_inputs=True)
        assert torch.equal(part, full[:rows]), rows
    one = torch.cat(
        [f32_linear.linear_int4(x[i : i + 1], pc, sl, b, n, int8_inputs=True) for i in range(40)]
    )
    assert torch.equal(one, full)
    assert torch.equal(
        f32_linear.linear_int4(x[3:12], pc, sl, b, n, int8_inputs=True), full[3:12]
    )  # offsets
    assert f32_linear.linear_int4(x[:0], pc, sl, b, n, int8_inputs=True).shape == (0, n)


@needs_kernel
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536)])
def test_int4_a8_is_within_the_activation_rounding_of_the_fp32_input_kernel(n, k):
    """|y_int8 - y_fp32| <= sum_k |w_k| |x_k - sx xq_k| <= sum_g sx_g (1/2 + 127 u) sum |w|
    (+ both kernels' fp32 rounding), and typically far below: rms 0.5% of the output's here."""
    from edgebuild.ops.linear import dequantize_int4, quantize_int4

    assert f32_linear.available()
    g = torch.Generator().manual_seed(10)
    codes, sz = quantize_int4(torch.randn(n, k, generator=g) * 0.05)
    x = torch.randn(8, k, generator=g)
    a8 = f32_linear.linear_int4(
        x, *f32_linear.pack_int4_a8(codes, sz), None, n, int8_inputs=True
    ).double()
    f32 = f32_linear.linear_int4(x, *f32_linear.pack_int4(codes, sz), None, n).double()
    w = dequantize_int4(codes, sz).double().abs()  # [out, in]
    _, sx = _int8_rows(x)
    step = sx.double().repeat_interleave(32, 1) * (0.5 + 127 * 2.0**-24)  # [rows, in]
    bound = step @ w.t() + 2.0**-16 * (x.double().abs() @ w.t()) + 1e-6
    assert ((a8 - f32).abs() <= bound).all()
    rel = float((a8 - f32).pow(2).mean().sqrt() / f32.pow(2).mean().sqrt())
    assert rel < 0.01, rel


@needs_kernel
@pytest.mark.parametrize("loop", A8_LOOPS)
def test_int4_a8_two_threads_give_the_same_bits(loop, a8_loop):
    from edgebuild.ops.linear import quantize_int4

    assert f32_linear.available()
    a8_loop(loop)
    g = torch.Generator().manual_seed(11)
    codes, sz = quantize_int4(torch.randn(1000, 576, generator=g))
    pc, sl = f32_linear.pack_int4_a8(codes, sz)
    x = torch.randn(9, 576, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = f32_linear.linear_int4(x, pc, sl, None, 1000, int8_inputs=True)
        torch.set_num_threads(2)
        two = f32_linear.linear_int4(x, pc, sl, None, 1000, int8_inputs=True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_int4_a8_bad_shapes_are_refused_with_what_was_wrong():
    codes, sz = _refused_mismatched_scales(f32_linear.pack_int4_a8, 96)
    if not f32_linear.available():
        return
    pc, sl = f32_linear.pack_int4_a8(codes, sz)
    old_c, old_sl = f32_linear.pack_int4(codes, sz)
    x = torch.randn(3, 96)
    cases = [
        ((torch.randn(3, 80), pc, sl, None, 20), "x has 80 inputs, the weight 96"),
        ((x.double(), pc, sl, None, 20), "x must be fp32"),
        ((torch.randn(3, 64), pc, sl, None, 20), "x has 64 inputs, the weight 96"),
        ((x, old_c, sl, None, 20), "codes must be uint8"),
        ((x, pc, old_sl, None, 20), r"scales must be fp32 \[blocks, in / 32, 32\]"),
        ((x, pc, sl, torch.randn(20), 20), "bias must be fp32"),
        ((x, pc, sl, None, 40), "out 40 does not match 2 blocks"),
    ]
    for args, msg in cases:
        with pytest.raises(RuntimeError, match=msg):
            f32_linear.linear_int4(*args, int8_inputs=True)


@needs_kernel
def test_packed_linear_int4_takes_int8_inputs_unless_switched_to_fp32(monkeypatch):
    from edgebuild.ops.linear import quantize_int4

    torch.manual_seed(12)
    lin = torch.nn.Linear(64, 40, bias=True)
    x = torch.randn(3, 5, 64)
    codes, sz = quantize_int4(lin.weight)
    try:
        for mode in ("int8", "fp32"):
            monkeypatch.setenv(f32_linear.ACT_ENV, mode)
            f32_linear._reset()
            packed = PackedLinear([lin], quant="int4")
            assert packed.int4_f32 and packed.int4_a8 == (mode == "int8")
            y = packed(x)
            assert y.shape == (3, 5, 40) and y.dtype == torch.float32
            if mode == "int8":
                want = f32_linear.linear_int4(
                    x.reshape(15, 64), *f32_linear.pack_int4_a8(codes, sz),
                    f32_linear.pack_bias(lin.bias, packed.weight), 40, int8_inputs=True,
                )  # fmt: skip
                assert torch.equal(y.reshape(15, 40), want)
            assert torch.equal(packed(x[2:3, 4:5]), y[2:3, 4:5])
        monkeypatch.setenv(f32_linear.ACT_ENV, "int2")
        f32_linear._reset()
        with pytest.raises(MissingDependencyError, match="EDGEBUILD_INT4_ACTIVATIONS='int2'"):
            PackedLinear([lin], quant="int4")
    finally:
        monkeypatch.delenv(f32_linear.ACT_ENV)
        f32_linear._reset()
    assert f32_linear.int4_activations() == f32_linear.DEFAULT_INT4_ACTIVATIONS


@needs_kernel
@pytest.mark.skipif(not _VNNI, reason="the CPU lacks avx512_vnni / bw / vl: one loop only")
@pytest.mark.parametrize("threads", [1, 2])
def test_int4_a8_vnni_loop_gives_the_avx2_loops_bits(threads, a8_loop):
    """Both group loops on the same calls (every row count 1..9, a NaN row, a zero row, rows
    scaled 1e-3..1e2, bias, the fused norm / SwiGLU / residual): the same bits."""
    from edgebuild.ops.linear import quantize_int4

    g = torch.Generator().manual_seed(12)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k in [(16, 32), (40, 64), (960, 576), (576, 1536)]:
            codes, sz = quantize_int4(torch.randn(n, k, generator=g) * 0.05)
            pc, sl = f32_linear.pack_int4_a8(codes, sz)
            b = f32_linear.pack_bias(torch.randn(n, generator=g), pc)
            norm = torch.rand(k, generator=g) + 0.5
            for rows in range(1, 10):
                x = torch.randn(rows, k, generator=g)
                x = x * 10.0 ** torch.randint(-3, 3, (rows, 1), generator=g).float()
                if rows >= 3:
                    x[1] = 0.0
                    x[2, 5] = float("nan")
                res = torch.randn(rows, n, generator=g)
                calls = [
                    ((x, pc, sl, b, n), {}),
                    ((x, pc, sl, None, n), {"norm_weight": norm, "eps": 1e-5, "residual": res}),
                ]
                if k % 64 == 0:  # SwiGLU: x holds gate | up, the weight takes k / 2 inputs
                    codes2, sz2 = quantize_int4(torch.randn(n, k // 2, generator=g) * 0.05)
                    calls.append(
                        ((x, *f32_linear.pack_int4_a8(codes2, sz2), None, n), {"swiglu": True})
                    )
                for args, kw in calls:
                    a8_loop(False)
                    avx2 = f32_linear.linear_int4(*args, int8_inputs=True, **kw)
                    a8_loop(True)
                    vnni = f32_linear.linear_int4(*args, int8_inputs=True, **kw)
                    assert torch.equal(avx2.view(torch.int32), vnni.view(torch.int32)), (n, k, rows)
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize(
    "variable,op,reader",
    [
        pytest.param(
            "EDGEBUILD_A8_VNNI", "a8_vnni", "a8_vnni",
            marks=pytest.mark.skipif(not _VNNI, reason="the CPU lacks avx512_vnni / bw / vl"),
        ),
        pytest.param(
            "EDGEBUILD_FP32_AVX512", "f32_avx512", "avx512",
            marks=pytest.mark.skipif(not _AVX512, reason="the CPU lacks avx512f"),
        ),
    ],
)  # fmt: skip
def test_the_loop_switches_read_their_variable_once_and_refuse_bad_modes(variable, op, reader):
    """The variable at 0 in a fresh process starts on the AVX2 loop, unset on the AVX-512 one
    (the W4A8 kernel's VNNI loop, the fp32 kernel's two-chain loop); the op refuses a mode
    outside -1..1 by name."""
    import subprocess
    import sys

    code = f"from edgebuild.ops import f32_linear as f; f.available(); print(f.{reader}())"
    got = {}
    for value in ("0", None):
        env = {k: v for k, v in os.environ.items() if k != variable}
        if value is not None:
            env[variable] = value
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        got[value] = out.stdout.strip().splitlines()[-1]
    assert got == {"0": "False", None: "True"}
    assert f32_linear.available()
    with pytest.raises(RuntimeError, match=f"{op}: mode must be -1, 0 or 1"):
        getattr(torch.ops.edgebuild_f32, op)(2)
