"""edgebuild's AMX kernels, int4 and bf16 (edgebuild/ops/amx_linear.py, ops/kernels/amx_linear.cpp).

Oracles: the packed layout is unpacked here in plain Python and compared with the codes it
came from; the kernel's product is compared with x @ dequantize_int4(codes).T in fp64; its rows
are compared bit for bit with 1-row calls. The kernel tests skip where the CPU has no AMX-BF16
(the fallback, torch's kernel, is covered by tests/test_batch_invariance.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from edgebuild.errors import MissingDependencyError
from edgebuild.ops import amx_linear
from edgebuild.ops.linear import PackedLinear, dequantize_int4, quantize_int4

_off = os.environ.get(amx_linear.ENV, "").strip().lower() == "torch"
needs_amx = pytest.mark.skipif(
    _off or amx_linear._why_not() is not None,
    reason=f"no AMX int4 kernel here: {'EDGEBUILD_INT4_KERNEL=torch' if _off else amx_linear._why_not()}",
)


def unpack(w: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Codes [n, k] back from the kernel layout, element by element (the C++ header's words)."""
    codes = torch.zeros(w.shape[0] * 16, k, dtype=torch.int64)
    wb = w.tolist()
    for b in range(w.shape[0]):
        for q in range(k // 4):
            for i in range(32):
                byte = wb[b][q][i]
                col, r = 16 * b + i // 2, i % 2
                codes[col, 4 * q + r] = byte & 0xF
                codes[col, 4 * q + 2 + r] = byte >> 4
    return codes[:n]


def _at_two_threads(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) run with 2 threads (the thread count restored after)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        return fn(x)
    finally:
        torch.set_num_threads(threads)


def test_pack_layout_round_trips_the_codes_and_scales():
    torch.manual_seed(0)
    n, k = 20, 64  # not a whole number of 16-column blocks: 12 padding columns
    codes, sz = quantize_int4(torch.randn(n, k))
    w, sc = amx_linear.pack(codes, sz)
    assert w.shape == (2, k // 4, 32) and w.dtype == torch.uint8
    assert sc.shape == (2, k // 32, 2, 16) and sc.dtype == torch.bfloat16
    assert torch.equal(unpack(w, n, k), codes.long())
    scale = sc[:, :, 0, :].permute(0, 2, 1).reshape(32, k // 32)[:n]  # [n, groups]
    lo = sc[:, :, 1, :].permute(0, 2, 1).reshape(32, k // 32)[:n]
    s, z = sz[..., 0].t(), sz[..., 1].t()
    assert torch.equal(scale, s.to(torch.bfloat16))
    assert torch.equal(lo, (z - 8 * s).to(torch.bfloat16))
    assert not w[1, :, 8:].any() and not sc[1, :, :, 4:].any()  # padding columns are zero


def _reference(x: torch.Tensor, codes, sz) -> torch.Tensor:
    """x @ W.T in fp64 with W as the kernel reads it: code * bf16(scale) + bf16(lo)."""
    s = sz[..., 0].t().to(torch.bfloat16).double()
    lo = (sz[..., 1].t() - 8 * sz[..., 0].t()).to(torch.bfloat16).double()
    c = codes.double().reshape(codes.shape[0], -1, 32)
    w = (c * s[..., None] + lo[..., None]).reshape(codes.shape)
    return x.double() @ w.t()


@needs_amx
@pytest.mark.parametrize("n,k", [(48, 64), (20, 96), (960, 576), (576, 1536)])
def test_kernel_equals_the_dequantized_reference_and_is_row_invariant(n, k):
    assert amx_linear.available()
    torch.manual_seed(1)
    codes, sz = quantize_int4(torch.randn(n, k) * 0.05)
    w, sc = amx_linear.pack(codes, sz)
    x = torch.randn(40, k).to(torch.bfloat16)
    full = amx_linear.linear(x, w, sc)[:, :n]
    ref = _reference(x, codes, sz)
    # fp32 accumulation of exact products, then one bf16 rounding (half an ulp: <= 2^-8 relative)
    tol = 2.0**-8 * ref.abs() + 1e-4 * ref.abs().amax()
    assert ((full.double() - ref).abs() <= tol).all()
    for rows in (1, 2, 7, 16, 17, 33):  # a row's bits never depend on the rows beside it
        part = amx_linear.linear(x[:rows].contiguous(), w, sc)[:, :n]
        assert torch.equal(part, full[:rows]), rows
    assert amx_linear.linear(x[:0], w, sc).shape == (0, w.shape[0] * 16)


@needs_amx
def test_packed_linear_uses_the_kernel_with_bias_and_two_threads():
    torch.manual_seed(2)
    lin = torch.nn.Linear(64, 40).to(torch.bfloat16)
    packed = PackedLinear([lin], quant="int4")
    assert packed.int4_amx
    x = torch.randn(3, 5, 64).to(torch.bfloat16)
    codes, sz = quantize_int4(lin.weight)
    ref = x.float() @ dequantize_int4(codes, sz).t() + lin.bias.float()
    y = packed(x)
    assert y.shape == (3, 5, 40) and y.dtype == torch.bfloat16
    assert (y.float() - ref).abs().max().item() < 0.05
    assert torch.equal(_at_two_threads(packed, x), y)  # the split across threads changes no bits


def test_mode_torch_and_bad_modes(monkeypatch):
    monkeypatch.setenv(amx_linear.ENV, "torch")
    amx_linear._reset()
    try:
        assert not amx_linear.available()
        assert not PackedLinear([torch.nn.Linear(64, 16).to(torch.bfloat16)], "int4").int4_amx
        monkeypatch.setenv(amx_linear.ENV, "fast")
        amx_linear._reset()
        with pytest.raises(MissingDependencyError, match="EDGEBUILD_INT4_KERNEL='fast'"):
            amx_linear.available()
        monkeypatch.setenv(amx_linear.ENV, "amx")
        monkeypatch.setattr(amx_linear.cpu_build, "cpu_flags", lambda: {"avx2"})
        amx_linear._reset()
        with pytest.raises(MissingDependencyError, match="the CPU lacks amx_bf16"):
            amx_linear.available()
        monkeypatch.setenv(amx_linear.ENV, "auto")
        amx_linear._reset()
        assert not amx_linear.available()  # auto falls back to torch's kernel
    finally:
        monkeypatch.undo()
        amx_linear._reset()


def test_torch_kernel_path_takes_outputs_that_are_not_a_multiple_of_16(monkeypatch):
    """torch's int4 packing wants whole blocks of 16 outputs: the rows are padded, the
    output cut back (it raised 'expect N to be dividable by 16' for a 40-output linear)."""
    monkeypatch.setenv(amx_linear.ENV, "torch")
    amx_linear._reset()
    try:
        torch.manual_seed(3)
        lin = torch.nn.Linear(64, 40).to(torch.bfloat16)
        packed = PackedLinear([lin], quant="int4")
        assert not packed.int4_amx
        x = torch.randn(3, 64).to(torch.bfloat16)
        codes, sz = quantize_int4(lin.weight)
        ref = x.float() @ dequantize_int4(codes, sz).t() + lin.bias.float()
        y = packed(x)
        assert y.shape == (3, 40)
        assert (y.float() - ref).abs().max().item() < 0.05
    finally:
        monkeypatch.undo()
        amx_linear._reset()


_bf16_off = os.environ.get(amx_linear.BF16_ENV, "").strip().lower() == "onednn"
needs_amx_bf16 = pytest.mark.skipif(
    _bf16_off or amx_linear._why_not() is not None,
    reason=f"no AMX bf16 kernel here: {'EDGEBUILD_BF16_KERNEL=onednn' if _bf16_off else amx_linear._why_not()}",
)


def test_bf16_pack_layout_is_the_vnni_tile_layout():
    """Word 2j + h of tile row r in (block b, chunk c) is w[16b + j, 32c + 2r + h]."""
    n, k = 20, 64
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k)
    w = (w % 251).to(torch.bfloat16)  # values 0..250, exact in bf16 up to 256
    p = amx_linear.pack_bf16(w)
    assert p.shape == (2, 2, 16, 32) and p.dtype == torch.bfloat16
    pl = p.tolist()
    for b in range(2):
        for c in range(2):
            for r in range(16):
                for j in range(16):
                    for h in range(2):
                        col, kk = 16 * b + j, 32 * c + 2 * r + h
                        want = w[col, kk].item() if col < n else 0.0
                        assert pl[b][c][r][2 * j + h] == want, (b, c, r, j, h)
    with pytest.raises(ValueError, match="multiple of 32"):
        amx_linear.pack_bf16(torch.zeros(16, 40))


@needs_amx_bf16
@pytest.mark.parametrize("n,k", [(48, 64), (20, 96), (960, 576), (576, 1536)])
def test_bf16_kernel_equals_fp64_and_is_row_invariant(n, k):
    assert amx_linear.bf16_available()
    torch.manual_seed(4)
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16)
    p = amx_linear.pack_bf16(w)
    bpad = torch.cat([bias.float(), torch.zeros(p.shape[0] * 16 - n)])
    x = torch.randn(70, k).to(torch.bfloat16)  # 70: the two-chunk (tall) path and a tail
    full = amx_linear.linear_bf16(x, p, bpad)[:, :n]
    ref = x.double() @ w.double().t() + bias.double()
    # exact bf16 products, fp32 accumulation over k (~k * 2^-24), one bf16 rounding (2^-9)
    scale = x.double().abs() @ w.double().abs().t() + bias.double().abs()
    assert ((full.double() - ref).abs() <= 2.0**-8 * ref.abs() + 2.0**-16 * scale).all()
    for rows in (1, 2, 7, 16, 17, 32, 33, 64):  # a row's bits never depend on the rows beside it
        part = amx_linear.linear_bf16(x[:rows].contiguous(), p, bpad)[:, :n]
        assert torch.equal(part, full[:rows]), rows
    assert amx_linear.linear_bf16(x[:0], p, bpad).shape == (0, p.shape[0] * 16)


@needs_amx_bf16
def test_packed_linear_bf16_uses_the_kernel_with_two_threads_and_the_switch(monkeypatch):
    torch.manual_seed(5)
    lins = [torch.nn.Linear(64, 40).to(torch.bfloat16), torch.nn.Linear(64, 8).to(torch.bfloat16)]
    packed = PackedLinear(lins)
    assert packed.bf16_amx
    x = torch.randn(3, 5, 64).to(torch.bfloat16)
    ref = torch.cat([x.double() @ m.weight.double().t() + m.bias.double() for m in lins], -1)
    y = packed(x)
    assert y.shape == (3, 5, 48) and y.dtype == torch.bfloat16
    assert (y.double() - ref).abs().max().item() < 0.03
    assert torch.equal(_at_two_threads(packed, x), y)  # the split across threads changes no bits
    monkeypatch.setenv(amx_linear.BF16_ENV, "onednn")
    amx_linear._reset()
    try:
        assert not PackedLinear(lins).bf16_amx
        monkeypatch.setenv(amx_linear.BF16_ENV, "fast")
        amx_linear._reset()
        with pytest.raises(MissingDependencyError, match="EDGEBUILD_BF16_KERNEL='fast'"):
            amx_linear.bf16_available()
    finally:
        monkeypatch.undo()
        amx_linear._reset()
