"""The vectorized eager path equals the golden reference op in every phase (outputs + cache)."""

from __future__ import annotations

import pytest
import torch

from edgebuild.ops import attention_kernel
from edgebuild.ops.attention import AttentionSpec, paged_attention
from edgebuild.ops.attention_fast import DensePlan, paged_attention_planned
from edgebuild.ops.rope import RopeScaling, rope_cos_sin_table

D, PAGE = 16, 4  # D a multiple of 16: the C++ decode kernel takes these calls


def setup(past, lengths, hq, hkv, seed=0, num_pages=64, d=D):
    g = torch.Generator().manual_seed(seed)
    bsz, rows = len(past), max(max(lengths), 1)
    perm = torch.randperm(num_pages, generator=g)
    need = [-(-(p + n) // PAGE) for p, n in zip(past, lengths, strict=True)]
    table = torch.zeros(bsz, max(need), dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    cache = torch.randn(num_pages, 2, hkv, PAGE, d, generator=g)
    qkv = torch.randn(bsz, rows, (hq + 2 * hkv) * d, generator=g)
    positions = torch.tensor(past, dtype=torch.int32)[:, None] + torch.arange(
        rows, dtype=torch.int32
    )
    return qkv, cache, table, positions


def both_paths(
    qkv, cache, table, past, lengths, positions, table_cs, qn, kn, hq, hkv, causal, write_kv,
    window, want_output=True, d=D,
):  # fmt: skip
    """(reference output, its pool, planned output, its pool) of one attention call, each on
    its own copy of ``cache``: the golden op and :func:`paged_attention_planned`."""
    past_t, len_t = torch.tensor(past, dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32)
    ref_cache = cache.clone()
    ref = paged_attention(
        qkv, ref_cache, table, past_t, len_t, positions, table_cs, qn, kn, None,
        num_q_heads=hq, num_kv_heads=hkv, head_dim=d, rotary_dim=d, causal=causal,
        write_kv=write_kv, sliding_window=window, scale=d**-0.5, page_size=PAGE,
    )  # fmt: skip
    plan = DensePlan.build(table, past_t, len_t, qkv.shape[1], PAGE, causal, write_kv)
    spec = AttentionSpec(
        num_q_heads=hq, num_kv_heads=hkv, head_dim=d, causal=causal, write_kv=write_kv,
        sliding_window=window, scale=d**-0.5,
    )  # fmt: skip
    fast_cache = cache.clone()
    out = paged_attention_planned(
        qkv, fast_cache, plan, positions, table_cs, qn, kn, spec, want_output
    )
    return ref, ref_cache, out, fast_cache


@pytest.mark.parametrize(
    "past,lengths,causal,write_kv,window,hq,hkv,qk_norm",
    [
        ([0], [9], True, True, 0, 4, 2, False),  # prefill
        ([0, 0, 0], [5, 9, 1], True, True, 0, 4, 2, True),  # batched prefill, unequal
        ([7, 12], [3, 5], True, True, 0, 4, 4, False),  # chunked prefill
        ([13, 4, 9], [1, 1, 1], True, True, 0, 4, 1, True),  # decode
        ([10, 3], [8, 6], True, True, 0, 4, 2, False),  # verify
        ([11, 6], [7, 7], False, False, 0, 4, 2, True),  # non-causal draft block
        ([5, 0], [4, 6], True, True, 0, 4, 2, True),  # draft context update
        ([20, 9], [4, 2], True, True, 6, 4, 2, False),  # sliding window
        ([3, 8], [0, 2], True, True, 0, 4, 2, False),  # an idle sequence
    ],
)
@pytest.mark.parametrize("kernel", [True, False], ids=["cpp-kernel", "torch-path"])
def test_planned_attention_equals_reference(
    past, lengths, causal, write_kv, window, hq, hkv, qk_norm, kernel, monkeypatch
):
    """Both decode paths (edgebuild's C++ kernel and the torch path) against the golden op."""
    if kernel and not attention_kernel.available():
        pytest.skip("edgebuild's decode attention kernel does not build here")
    if not kernel:
        monkeypatch.setattr(attention_kernel, "available", lambda: False)
    qkv, cache, table, positions = setup(past, lengths, hq, hkv)
    rope = RopeScaling(
        rope_type="yarn", rope_theta=1e4, factor=2.0, original_max_position_embeddings=32
    )
    table_cs = rope_cos_sin_table(D, 128, rope)
    g = torch.Generator().manual_seed(1)
    qn = 1 + 0.1 * torch.randn(D, generator=g) if qk_norm else None
    kn = 1 + 0.1 * torch.randn(D, generator=g) if qk_norm else None
    steps = both_paths(
        qkv, cache, table, past, lengths, positions, table_cs, qn, kn, hq, hkv, causal, write_kv,
        window,
    )  # fmt: skip
    ref, ref_cache, out, fast_cache = steps
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast_cache, ref_cache, atol=1e-6, rtol=0)
    if not write_kv:
        assert torch.equal(fast_cache, cache)


def test_plan_refuses_a_page_table_that_is_too_small():
    with pytest.raises(ValueError, match="allocate more pages"):
        DensePlan.build(
            torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32),
            torch.tensor([4], dtype=torch.int32),
            4,
            PAGE,
            True,
            True,
        )


def test_attention_kernel_mode_torch_and_bad_modes(monkeypatch):
    from edgebuild.errors import MissingDependencyError

    try:
        monkeypatch.setenv(attention_kernel.ENV, "torch")
        attention_kernel._load.cache_clear()
        assert not attention_kernel.available()
        monkeypatch.setenv(attention_kernel.ENV, "fastest")
        attention_kernel._load.cache_clear()
        with pytest.raises(MissingDependencyError, match="EDGEBUILD_ATTENTION_KERNEL='fastest'"):
            attention_kernel.available()
    finally:
        monkeypatch.undo()
        attention_kernel._load.cache_clear()


def test_a_build_killed_half_way_does_not_block_later_loads(tmp_path):
    """torch's file lock is left behind by a killed build; every later load waited on it."""
    import subprocess
    import sys

    if not attention_kernel.available():
        pytest.skip("edgebuild's decode attention kernel does not build here")
    from edgebuild.ops import cpu_build

    dirs = [p for p in cpu_build.cache_dir().glob("edgebuild_decode_attention_*") if p.is_dir()]
    for d in dirs:
        (d / "lock").touch()  # as a kill -9 during the compile leaves it
    code = (
        "from edgebuild.ops import attention_kernel as a\n"
        "assert a.available(), 'kernel not loaded'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], timeout=300, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def test_a_damaged_cached_kernel_is_rebuilt_and_an_intact_one_loads_without_a_compiler(tmp_path):
    """A truncated cached library crashed the process with SIGBUS when loaded; a cache built
    earlier was not used where no compiler is on PATH (a runtime image)."""
    import os
    import shutil
    import subprocess
    import sys

    if shutil.which("g++") is None or not attention_kernel.available():
        pytest.skip("edgebuild's decode attention kernel does not build here")
    env = {**os.environ, "EDGEBUILD_CACHE": str(tmp_path / "cache")}
    code = "from edgebuild.ops import attention_kernel as a\nassert a.available()\n"

    def run(**extra):
        done = subprocess.run(
            [sys.executable, "-c", code], env={**env, **extra}, timeout=300, capture_output=True
        )
        assert done.returncode == 0, (done.returncode, done.stderr.decode()[-2000:])
        return done.stderr.decode()

    run()  # builds into the empty cache
    libs = list((tmp_path / "cache" / "kernels").glob("edgebuild_decode_attention_*/*.so"))
    assert len(libs) == 1 and libs[0].with_name(libs[0].name + ".sha256").is_file()
    size = libs[0].stat().st_size
    with open(libs[0], "r+b") as f:  # as a full disk or a bad copy leaves it
        f.truncate(size // 2)
    run()  # rebuilt, not loaded
    assert libs[0].stat().st_size == size
    bindir = os.path.dirname(sys.executable)
    err = run(PATH=bindir)  # no g++ on PATH: the intact library still loads
    assert "no C++ compiler" not in err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "past,lengths,rotary",
    [([5], [1], 16), ([7], [8], 16), ([3, 0, 9], [8, 2, 5], 16), ([6, 2], [3, 3], 8)],
    ids=["decode", "verify", "batched-unequal", "partial-rotary"],
)
def test_fused_decode_step_equals_the_torch_ops_bit_for_bit(
    past, lengths, rotary, dtype, monkeypatch
):
    """attention_kernel.decode_step (RoPE + K/V write + attention in C++) against the same
    step as torch ops + decode_attention: the output and the whole pool, bit for bit."""
    import edgebuild.ops.attention_fast as fast

    if not attention_kernel.available():
        pytest.skip("edgebuild's decode attention kernel does not build here")
    hq, hkv = 4, 2
    qkv, cache, table, positions = setup(past, lengths, hq, hkv, seed=3)
    qkv, cache = qkv.to(dtype), cache.to(dtype)
    table_cs = rope_cos_sin_table(rotary, 128, RopeScaling(rope_theta=1e4))
    past_t = torch.tensor(past, dtype=torch.int32)
    len_t = torch.tensor(lengths, dtype=torch.int32)
    spec = AttentionSpec(
        num_q_heads=hq, num_kv_heads=hkv, head_dim=D, causal=True, write_kv=True,
        sliding_window=0, scale=D**-0.5,
    )  # fmt: skip
    results = []
    for fused in (True, False):
        monkeypatch.setattr(fast, "FUSED_STEP", fused)
        plan = DensePlan.build(table, past_t, len_t, qkv.shape[1], PAGE, True, True)
        assert plan.row_invariant
        c = cache.clone()
        out = paged_attention_planned(qkv, c, plan, positions, table_cs, None, None, spec)
        results.append((out, c))
    (out_f, cache_f), (out_t, cache_t) = results
    assert torch.equal(out_f, out_t)
    assert torch.equal(cache_f, cache_t)
    assert not torch.equal(cache_f, cache)  # the rows' K/V were written


def test_kernel_thread_pool_rethrows_a_chunk_error_and_keeps_working():
    """The kernels' own parallel-for (kernels/pool.h) runs chunks on worker threads: an error
    in one (a key past the page table) reaches the caller as RuntimeError, nothing dies, and
    the next call at 2 threads gives the 1-thread bits."""
    if not attention_kernel.available():
        pytest.skip("edgebuild's decode attention kernel does not build here")
    g = torch.Generator().manual_seed(7)
    hq, hkv, rows = 8, 2, 6
    cache = torch.randn(8, 2, hkv, PAGE, D, generator=g)
    q = torch.randn(rows, hq, D, generator=g)
    table = torch.arange(8).reshape(1, 8)
    row_b = torch.zeros(rows, dtype=torch.long)
    mask = torch.ones(rows, 8 * PAGE, dtype=torch.bool)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attention_kernel.decode_attention(q, cache, table, row_b, mask, D**-0.5)
        torch.set_num_threads(2)
        bad = torch.ones(rows, 9 * PAGE, dtype=torch.bool)  # one page more than the table has
        with pytest.raises(RuntimeError, match="past the page table"):
            attention_kernel.decode_attention(q, cache, table, row_b, bad, D**-0.5)
        two = attention_kernel.decode_attention(q, cache, table, row_b, mask, D**-0.5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize(
    "past,lengths,window,want_output,d",
    [
        ([5, 0], [4, 6], 0, False, 16),  # a draft's context update: K/V written, nothing attended
        ([3, 0], [40, 6], 0, False, 64),  # a prompt's update (> 16 rows): the kernel still
        ([11, 6], [7, 3], 0, True, 16),  # a draft's non-causal block, unequal rows
        ([11, 6], [7, 3], 0, True, 64),  # SmolLM2's head size (the 64-wide weighted sum)
        ([9, 30], [7, 7], 0, True, 48),  # the 48-wide tail
        ([20, 9], [7, 7], 6, True, 80),  # a windowed draft's block; 64 + 16 wide
    ],
)
def test_draft_steps_run_the_kernel_and_equal_the_reference(
    past, lengths, window, want_output, d, monkeypatch
):
    """A DSpark draft's context update and block pass (q/k norms, GQA) take one C++ call a
    layer (counted), and equal the golden op: the output, and the pool (written by the
    update, untouched by the block)."""
    if not attention_kernel.available():
        pytest.skip("edgebuild's decode attention kernel does not build here")
    calls = []
    step = attention_kernel.decode_step

    def counted(*args, **kwargs):
        calls.append(args[9] is None)  # the mask: None for a write-only step
        return step(*args, **kwargs)

    monkeypatch.setattr(attention_kernel, "decode_step", counted)
    hq, hkv = 4, 2
    qkv, cache, table, positions = setup(past, lengths, hq, hkv, seed=5, d=d)
    table_cs = rope_cos_sin_table(d, 128, RopeScaling(rope_theta=1e4))
    g = torch.Generator().manual_seed(2)
    qn, kn = 1 + 0.1 * torch.randn(d, generator=g), 1 + 0.1 * torch.randn(d, generator=g)
    causal = write_kv = not want_output
    ref, ref_cache, out, fast_cache = both_paths(
        qkv, cache, table, past, lengths, positions, table_cs, qn, kn, hq, hkv, causal, write_kv,
        window, want_output, d,
    )  # fmt: skip
    assert calls == [not want_output]
    torch.testing.assert_close(fast_cache, ref_cache, atol=1e-6, rtol=0)
    if want_output:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(fast_cache, cache)
    else:
        assert out is None and not torch.equal(fast_cache, cache)


@pytest.mark.parametrize(
    "past,lengths,causal,write_kv",
    [([13, 4], [1, 1], True, True), ([10, 3], [8, 6], True, True), ([11, 6], [7, 3], False, False)],
    ids=["decode", "verify", "draft-block"],
)
def test_bf16_steps_with_qk_norms_follow_the_fp32_reference(past, lengths, causal, write_kv):
    """The kernel's bf16 path with q/k norms (Qwen3 targets and DSpark drafts on bf16 hosts):
    within bf16 rounding of the golden op run in fp32 on the same (bf16-representable) inputs."""
    if not attention_kernel.available():
        pytest.skip("edgebuild's decode attention kernel does not build here")
    hq, hkv = 4, 2
    qkv, cache, table, positions = setup(past, lengths, hq, hkv, seed=7)
    qkv, cache = qkv.bfloat16().float(), cache.bfloat16().float()  # exact in both dtypes
    table_cs = rope_cos_sin_table(D, 128, RopeScaling(rope_theta=1e4))
    g = torch.Generator().manual_seed(3)
    qn = (1 + 0.1 * torch.randn(D, generator=g)).bfloat16().float()
    kn = (1 + 0.1 * torch.randn(D, generator=g)).bfloat16().float()
    args = (table, past, lengths, positions, table_cs)
    ref, ref_cache, _, _ = both_paths(qkv, cache, *args, qn, kn, hq, hkv, causal, write_kv, 0)
    _, _, out, bf_cache = both_paths(
        qkv.bfloat16(), cache.bfloat16(), *args, qn.bfloat16(), kn.bfloat16(), hq, hkv, causal,
        write_kv, 0,
    )  # fmt: skip
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(bf_cache.float(), ref_cache, atol=3e-2, rtol=3e-2)


def test_a_page_id_outside_the_pool_is_an_error_not_a_read():
    """A page table entry past the pool (or negative) under a visible key raises, naming it."""
    if not attention_kernel.available():
        pytest.skip("edgebuild's decode attention kernel does not build here")
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(4, 2, 2, PAGE, D, generator=g)
    q = torch.randn(1, 4, D, generator=g)
    mask = torch.ones(1, 2 * PAGE, dtype=torch.bool)
    for bad in (4, 1 << 40, -1):
        table = torch.tensor([[0, bad]])
        with pytest.raises(RuntimeError, match=f"page {bad} of key {PAGE} is outside the pool"):
            attention_kernel.decode_attention(q, cache, table, torch.zeros(1), mask, 0.25)
    ok = attention_kernel.decode_attention(
        q, cache, torch.tensor([[0, 3]]), torch.zeros(1), mask, 0.25
    )
    assert ok.shape == (1, 4 * D) and torch.isfinite(ok).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d", [64, 48, 128])
def test_rows_of_a_sequence_read_their_keys_together_with_each_rows_own_bits(dtype, d):
    """decode_attention groups up to four rows of a sequence per KV head (each key read once
    for them): every row equals the row computed alone, bit for bit (a verify row is a decode
    row), and the masked softmax attention in float64 within rounding; runs of more than four
    rows, two sequences, a row that sees nothing."""
    if not attention_kernel.available():
        pytest.skip("edgebuild's decode attention kernel does not build here")
    g = torch.Generator().manual_seed(4)
    hq, hkv, ps, pages = 6, 2, 8, 12
    cache = torch.randn(pages, 2, hkv, ps, d, generator=g).to(dtype)
    table = torch.stack([torch.randperm(pages, generator=g)[:6] for _ in range(2)]).long()
    row_b = torch.tensor([0] * 6 + [1] * 3)
    keys = 6 * ps
    mask = torch.zeros(9, keys, dtype=torch.bool)
    for r, top in enumerate([30, 31, 32, 33, 34, 35, 5, 47, 0]):
        mask[r, :top] = True  # causal rows; the last sees nothing
    mask[2, 3] = False  # a hole
    q = torch.randn(9, hq, d, generator=g).to(dtype)
    scale = d**-0.5
    out = torch.ops.edgebuild_attn.decode_attention(q, cache, table, row_b, mask, scale)
    for r in range(9):
        alone = torch.ops.edgebuild_attn.decode_attention(
            q[r : r + 1].contiguous(),
            cache,
            table,
            row_b[r : r + 1],
            mask[r : r + 1].clone(),
            scale,
        )
        assert torch.equal(out[r : r + 1], alone), r
        b, group = int(row_b[r]), hq // hkv
        k = cache[table[b], 0].double().permute(1, 0, 2, 3).reshape(hkv, keys, d)
        v = cache[table[b], 1].double().permute(1, 0, 2, 3).reshape(hkv, keys, d)
        want = torch.zeros(hq, d, dtype=torch.float64)
        if mask[r].any():
            for h in range(hq):
                s = (k[h // group] @ q[r, h].double()) * scale
                p = torch.softmax(s.masked_fill(~mask[r], float("-inf")), 0)
                want[h] = p @ v[h // group]
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[r].view(hq, d).double(), want, atol=tol, rtol=tol)
