"""A row's bits do not depend on how many rows share its pass: so bf16 DSpark == target-only.

DSpark's promise is the target's own greedy output. It only holds at the serving dtype if a
1-row decode and row i of an (n+1)-row verify compute the same bits (docs/ARCHITECTURE.md, "The runtime": exactness).
Before the row-invariant attention and the packed linears, 40 of 40 verify rows differed
from the decode rows in bf16 on the real SmolLM2 (first at layer 3-10: the attention), and
greedy DSpark left target-only on 5 of 5 prompts.
"""

from __future__ import annotations

import json

import pytest
import torch

from edgebuild.ops import f32_linear
from edgebuild.ops.linear import (
    INT4_GROUP_SIZE,
    MAX_INVARIANT_ROWS,
    PackedLinear,
    dequantize_int4,
    packing_available,
    quantize_int4,
)
from edgebuild.runtime.llm import LLM, RuntimeOptions
from edgebuild.runtime.sampling import SamplingParams
from tests.conftest import ROOT

DRAFT = ROOT / "edgebuild" / "data" / "smollm2-135m-dspark"
# fixed lengths: every step verifies 7 drafts, so the verify rows these tests compare always run
SPEC = {
    "method": "dspark",
    "model": str(DRAFT),
    "num_speculative_tokens": 7,
    "confidence_scheduling": False,
}


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


NO_BF16_PACKING = "oneDNN's packed bf16 linears cannot run on this CPU (AVX512-BW/VL/DQ or AVX-NE-CONVERT needed): bf16 rows are not row-invariant here, and --dtype auto picks float32"
needs_bf16_packing = pytest.mark.skipif(
    not packing_available(torch.bfloat16), reason=NO_BF16_PACKING
)


@pytest.mark.skipif(not packing_available(torch.float32), reason="no oneDNN in this torch")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_packed_linear_rows_equal_single_row_calls(dtype, n_threads, threads):
    """SmolLM2's packed shapes (fused qkv, o, fused gate/up, down, lm_head), 2..130 rows: bit
    for bit in bf16, and in fp32 where edgebuild's fp32 kernel runs (AVX2 + FMA); with
    torch's fp32 linears (no row-invariant kernel) within 1e-5."""
    if dtype is torch.bfloat16 and not packing_available(dtype):
        pytest.skip(NO_BF16_PACKING)
    torch.set_num_threads(n_threads)
    g = torch.Generator().manual_seed(0)
    for out_f, in_f in [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]:
        lin = torch.nn.Linear(in_f, out_f, bias=False).to(dtype)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(out_f, in_f, generator=g) * 0.05)
        packed = PackedLinear([lin])
        x = torch.randn(2 * MAX_INVARIANT_ROWS + 2, in_f, generator=g).to(dtype)
        single = torch.cat([packed(x[i : i + 1]) for i in range(x.shape[0])])
        for rows in (2, 8, 32, MAX_INVARIANT_ROWS, MAX_INVARIANT_ROWS + 1, x.shape[0]):
            if dtype is torch.bfloat16 or packed.f32_kernel:
                assert torch.equal(packed(x[:rows]), single[:rows]), (out_f, in_f, rows)
            else:
                torch.testing.assert_close(packed(x[:rows]), single[:rows], rtol=1e-5, atol=1e-5)
        tol = 2e-2 if dtype is torch.bfloat16 else 1e-4
        torch.testing.assert_close(single, lin(x), rtol=tol, atol=tol)


def test_fused_packed_linear_equals_the_separate_modules():
    g = torch.Generator().manual_seed(1)
    mods = [torch.nn.Linear(16, n, bias=True) for n in (8, 4, 4)]
    x = torch.randn(3, 5, 16, generator=g)
    want = torch.cat([m(x) for m in mods], dim=-1)
    torch.testing.assert_close(PackedLinear(mods)(x), want, rtol=1e-5, atol=1e-5)


def _decode_and_verify_logits(llm: LLM, prompt: str, steps: int = 32):
    """(logits of `steps` 1-row decodes, logits of the same rows verified 8 at a time)."""
    target = llm.target
    ids = llm.encode(prompt, chat=True)
    seq = target.new_sequence()
    try:
        out = target.forward([seq], [torch.tensor(ids)], [[len(ids) - 1]])
        tokens, decoded = [int(out.logits[0][0].argmax())], []
        for _ in range(steps):
            o = target.forward([seq], [torch.tensor(tokens[-1:])], [[0]])
            decoded.append(o.logits[0][0])
            tokens.append(int(o.logits[0][0].argmax()))
        target.rollback(seq, steps)
        verified = []
        for start in range(0, steps, 8):
            o = target.forward([seq], [torch.tensor(tokens[start : start + 8])], [list(range(8))])
            verified += list(o.logits[0])
        return decoded, verified
    finally:
        target.free(seq)


def _row_invariant(dtype: torch.dtype) -> str | None:
    """None when ``dtype``'s linears are row-invariant here, else why not (a skip reason)."""
    if dtype is torch.bfloat16:
        return None if packing_available(dtype) else NO_BF16_PACKING
    return None if f32_linear.available() else "edgebuild's fp32 kernel does not run here"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_verify_rows_equal_decode_rows_bit_for_bit(smollm2_dir, dtype, n_threads, threads):
    if _row_invariant(dtype):
        pytest.skip(_row_invariant(dtype))
    torch.set_num_threads(n_threads)
    llm = LLM(smollm2_dir, options=RuntimeOptions(dtype=dtype, max_kv_rows=1024))
    for prompt in ("What are the main benefits of curiosity?", "Write a haiku about winter."):
        decoded, verified = _decode_and_verify_logits(llm, prompt)
        bad = [
            i
            for i, (a, b) in enumerate(zip(decoded, verified, strict=True))
            if not torch.equal(a, b)
        ]
        assert not bad, f"{prompt!r}: verify rows {bad} differ from their decode rows"


def _eval_prompts(n: int) -> list[str]:
    path = ROOT / "tools" / "train_dspark" / "data" / "eval_prompts.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [r["prompt"] for r in rows[:n]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch,n_threads", [(1, 1), (3, 2)])
def test_greedy_dspark_equals_target_only(smollm2_dir, dtype, batch, n_threads, threads):
    """The shipped pair in bf16 and fp32: identical outputs at batch 1 / 1 thread and batch
    3 / 2 threads (row-invariant linears: a verify row has its decode row's bits)."""
    if _row_invariant(dtype):
        pytest.skip(_row_invariant(dtype))
    torch.set_num_threads(n_threads)
    opts = RuntimeOptions(dtype=dtype, max_kv_rows=2048)
    plain = LLM(smollm2_dir, options=opts)
    spec = LLM(smollm2_dir, speculative=SPEC, options=opts)
    ids = [plain.encode(p, chat=True) for p in _eval_prompts(3)]
    params = SamplingParams(max_tokens=48)
    for i in range(0, len(ids), batch):
        want = plain.generate_ids(ids[i : i + batch], params)
        got = spec.generate_ids(ids[i : i + batch], params)
        for w, g in zip(want, got, strict=True):
            assert g.output_ids == w.output_ids
            assert g.metrics.tau > 1.0  # the draft really drafted


def test_bf16_logits_are_as_close_to_fp32_as_transformers_bf16(smollm2_dir):
    """Stated tolerance: our bf16 logits may be off fp32 by at most 1.25x transformers' own
    bf16 error (max |diff|), with at least its top-1 agreement minus 3 points."""
    from transformers import AutoModelForCausalLM

    llm = LLM(smollm2_dir, options=RuntimeOptions(dtype=torch.bfloat16, max_kv_rows=512))
    hf16 = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16)
    hf32 = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    ids = llm.encode("What are the main benefits of curiosity?", chat=True)
    seq = llm.target.new_sequence()
    ours = llm.target.forward([seq], [torch.tensor(ids)], [list(range(len(ids)))]).logits[0]
    with torch.no_grad():
        ref16 = hf16(torch.tensor([ids])).logits[0].float()
        ref32 = hf32(torch.tensor([ids])).logits[0].float()
    err_ours, err_hf = (ours - ref32).abs().max(), (ref16 - ref32).abs().max()
    assert err_ours <= 1.25 * err_hf, (float(err_ours), float(err_hf))
    agree_ours = (ours.argmax(-1) == ref32.argmax(-1)).float().mean()
    agree_hf = (ref16.argmax(-1) == ref32.argmax(-1)).float().mean()
    assert agree_ours >= agree_hf - 0.03, (float(agree_ours), float(agree_hf))


def test_int8_opt_in_stays_exact_and_close_to_bf16(smollm2_dir, threads):
    """`--quant int8`: DSpark equals int8 target-only (the kernel is row-invariant too), and
    the int8 model's greedy text stays close to bf16's (first token equal on every prompt)."""
    torch.set_num_threads(1)
    q = RuntimeOptions(dtype=torch.bfloat16, max_kv_rows=2048, quant="int8")
    plain = LLM(smollm2_dir, options=q)
    spec = LLM(smollm2_dir, speculative=SPEC, options=q)
    ref = LLM(smollm2_dir, options=RuntimeOptions(dtype=torch.bfloat16, max_kv_rows=2048))
    ids = [plain.encode(p, chat=True) for p in _eval_prompts(2)]
    params = SamplingParams(max_tokens=32)
    want = plain.generate_ids(ids, params)
    got = spec.generate_ids(ids, params)
    bf16 = ref.generate_ids(ids, params)
    for w, g, b in zip(want, got, bf16, strict=True):
        assert g.output_ids == w.output_ids
        assert w.output_ids[0] == b.output_ids[0]


def test_unknown_quant_mode_is_refused_by_name(smollm2_dir):
    from edgebuild.errors import ConfigError

    with pytest.raises(ConfigError, match="int3"):
        LLM(smollm2_dir, options=RuntimeOptions(quant="int3"))


# ---------------------------------------------------------------------- --quant int4
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_matmul_equals_the_dequantized_reference(dtype):
    """The packed int4 kernel computes x @ dequantize(codes).T (x quantized per group of 32 to
    int8 first where the fp32 runtime's kernel does that); the codes are within half a step of
    the weight (the rounding bound of min/max group quantization)."""
    g = torch.Generator().manual_seed(3)
    for out_f, in_f in [(96, 64), (576, 1536), (49152 // 64, 576)]:
        lin = torch.nn.Linear(in_f, out_f, bias=True)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(out_f, in_f, generator=g) * 0.05)
        lin = lin.to(dtype)
        codes, sz = quantize_int4(lin.weight)
        assert int(codes.min()) >= 0 and int(codes.max()) <= 15
        deq = dequantize_int4(codes, sz)
        step = sz[..., 0].transpose(0, 1).repeat_interleave(INT4_GROUP_SIZE, 1)  # [out, in]
        assert bool(((deq - lin.weight.float()).abs() <= step / 2 + 1e-6).all())
        x = torch.randn(5, in_f, generator=g).to(dtype)
        packed = PackedLinear([lin], quant="int4")
        xr = x.float()
        if packed.int4_a8:  # fp32 runtime, EDGEBUILD_INT4_ACTIVATIONS=int8: x as quantized
            xg = xr.reshape(5, in_f // 32, 32)
            sx = xg.abs().amax(-1, keepdim=True) / 127.0
            xr = (torch.round(xg / sx) * sx).reshape(5, in_f)
        ref = xr @ deq.T + lin.bias.detach().float()
        got = packed(x)
        assert got.dtype == dtype
        tol = 1e-4 if dtype is torch.float32 else 3e-2
        torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol * float(ref.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_int4_rows_equal_single_row_calls(dtype, n_threads, threads):
    """The int4 kernel is row-invariant (fp32 too, unlike MKL's fp32 GEMM): bit for bit."""
    torch.set_num_threads(n_threads)
    g = torch.Generator().manual_seed(4)
    for out_f, in_f in [(960, 576), (576, 1536), (3072, 576)]:
        lin = torch.nn.Linear(in_f, out_f, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(out_f, in_f, generator=g) * 0.05)
        packed = PackedLinear([lin.to(dtype)], quant="int4")
        x = torch.randn(MAX_INVARIANT_ROWS + 3, in_f, generator=g).to(dtype)
        single = torch.cat([packed(x[i : i + 1]) for i in range(x.shape[0])])
        for rows in (2, 8, MAX_INVARIANT_ROWS + 3):
            assert torch.equal(packed(x[:rows]), single[:rows]), (out_f, in_f, rows)


def test_int4_width_not_a_multiple_of_the_group_is_refused():
    with pytest.raises(ValueError, match="int4.*multiple of the group size"):
        PackedLinear([torch.nn.Linear(40, 8)], quant="int4")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_dspark_equals_int4_target_only(smollm2_dir, threads, dtype):
    """`--quant int4` in bf16 (as `edgebuild run --quant int4` on a bf16 host) and in fp32 (an
    AVX2 host: edgebuild's int4 kernel, by default with int8-quantized inputs,
    EDGEBUILD_INT4_ACTIVATIONS): DSpark equals int4 target-only bit for bit (row-invariant
    kernels), and the int4 model's first token matches fp32's on every prompt."""
    torch.set_num_threads(1)
    q = RuntimeOptions(dtype=dtype, max_kv_rows=2048, quant="int4")
    plain = LLM(smollm2_dir, options=q)
    spec = LLM(smollm2_dir, speculative={**SPEC, "confidence_scheduling": False}, options=q)
    ref = LLM(smollm2_dir, options=RuntimeOptions(dtype=torch.float32, max_kv_rows=2048))
    ids = [plain.encode(p, chat=True) for p in _eval_prompts(2)]
    params = SamplingParams(max_tokens=32)
    want = plain.generate_ids(ids, params)
    got = spec.generate_ids(ids, params)
    fp32 = ref.generate_ids(ids, params)
    for w, g, b in zip(want, got, fp32, strict=True):
        assert g.output_ids == w.output_ids
        assert w.output_ids[0] == b.output_ids[0]
