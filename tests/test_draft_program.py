"""The DSpark draft's proposal on the kernels: top-k, the step plans, the block program, fc.

Oracles: ``torch.sort(descending=True, stable=True)`` for the top-k op; the DensePlan of the
same step for every input :class:`KernelPlan` gives the C++ step; the draft's own modules
(and the Python loop over the same ops) for the block pass run as one C++ program, bit for
bit; ``F.linear`` over the (dequantized) weights for the packed ``fc``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from dspark_fixtures import make_random_draft
from serve_fixtures import torch_threads, write_tiny_chat_model

from edgebuild.models import common
from edgebuild.models.common import PagedBatch
from edgebuild.ops import attention_fast, f32_linear
from edgebuild.ops.attention_fast import DensePlan, KernelPlan
from edgebuild.ops.linear import dequantize_int4, quantize_int4
from edgebuild.runtime.llm import LLM, RuntimeOptions
from edgebuild.runtime.torch_backend import make_batch

kernels = pytest.mark.skipif(
    not f32_linear.available(), reason="edgebuild's AVX2 kernels do not run on this CPU"
)


def sorted_topk(x: torch.Tensor, k: int):
    vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]


@kernels
@pytest.mark.parametrize("k", [1, 3, 16, 64])
def test_topk_is_a_stable_descending_sort_cut_to_k(k):
    g = torch.Generator().manual_seed(k)
    rows = [
        torch.randn(49152, generator=g),  # a vocabulary row
        torch.randint(0, 4, (1000,), generator=g).float(),  # ties everywhere
        torch.full((300,), float("-inf")),
        torch.arange(700.0),  # ascending: every entry beats the bar
        torch.arange(700.0).flip(0),
    ]
    for x in rows:
        x = x.clone()
        if x.numel() > 200:
            x[[5, 150]] = float("nan")  # NaN ranks above every number, as in torch.sort
            x[77] = float("inf")
        v, i = f32_linear.topk(x[None], k)
        rv, ri = sorted_topk(x[None], k)
        assert torch.equal(i, ri)
        torch.testing.assert_close(v, rv, equal_nan=True, atol=0, rtol=0)
    x = torch.randn(2, 3, 500, generator=g)  # any leading shape
    v, i = f32_linear.topk(x, k)
    assert v.shape == i.shape == (2, 3, k)
    assert torch.equal(i, sorted_topk(x, k)[1])
    x = torch.randn(40, 3000, generator=g)  # rows split across the kernel pool's threads
    x[3] = float("nan")  # an all-NaN row: its first k indices
    with torch_threads(2):
        got = f32_linear.topk(x, k)[1]
    assert torch.equal(got, sorted_topk(x, k)[1])
    x = torch.randint(0, 3, (2, k + 5), generator=g).float()
    assert torch.equal(f32_linear.topk(x, k + 5)[1], sorted_topk(x, k + 5)[1])  # k == V


def test_topk_without_the_kernel_gives_the_same_order(monkeypatch):
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 50, (4, 2000), generator=g).float()  # ties inside the k kept
    x[:, 0] = 1000.0  # ... but a unique k-th value: the same entries are kept
    monkeypatch.setattr(f32_linear, "available", lambda: False)
    v, i = f32_linear.topk(x, 1)
    assert torch.equal(i, sorted_topk(x, 1)[1])
    x = torch.randn(4, 2000, generator=g)
    x[:, 100:110] = 9.0  # ten tied entries, all kept
    v, i = f32_linear.topk(x, 12)
    rv, ri = sorted_topk(x, 12)
    assert torch.equal(i, ri) and torch.equal(v, rv)
    with pytest.raises(ValueError, match="k must be in 1..2000"):
        f32_linear.topk(x, 0)


def _batch(g, bsz, rows, page_size, full):
    pages = 12
    table = torch.randperm(bsz * pages, generator=g).view(bsz, pages).to(torch.int32)
    past = torch.randint(0, 40, (bsz,), generator=g).to(torch.int32)
    if full:
        lengths = torch.full((bsz,), rows, dtype=torch.int32)
    else:  # padding rows, an empty sequence (a ring update's), more lengths than rows
        lengths = torch.randint(1, rows + 1, (bsz,), generator=g).to(torch.int32)
        if bsz > 1:
            lengths[0], lengths[-1] = 0, rows + 2
    positions = (past[:, None] + torch.arange(rows)[None, :]).to(torch.int32)
    return table, past, lengths, positions


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("full", [True, False])
@pytest.mark.parametrize("small", [64, 0])
def test_kernel_plan_gives_the_c_step_what_the_dense_plan_gives(window, full, small, monkeypatch):
    """Decode / verify steps, write-only context updates (up to 40 rows) and block passes:
    every input of decode_step equal to the DensePlan's, padding rows and windows too; both
    ways of building the plan (``small``: SMALL_PLAN_ROWS, Python ints up to it)."""
    monkeypatch.setattr(attention_fast, "SMALL_PLAN_ROWS", small)
    g = torch.Generator().manual_seed(window + 10 * full)
    table_rope = torch.randn(256, 16)
    for bsz in (1, 3):
        for rows, causal, write in [(1, True, True), (8, True, True), (40, True, True),
                                    (7, False, False)]:  # fmt: skip
            pt, past, lengths, pos = _batch(g, bsz, rows, 8, full)
            dense = DensePlan.build(pt, past, lengths, rows, 8, causal, write)
            light = KernelPlan.build(PagedBatch(pt, past, lengths, pos), rows, 8, causal, write)
            if write and rows > attention_fast.ROW_INVARIANT_MAX_ROWS:  # write-only: no masks
                want = attention_fast._step_rows(dense, pos, table_rope)
                got = attention_fast._step_rows(light, pos, table_rope)
            elif write:
                want = attention_fast.fused_step_args(dense, pos, table_rope, window)
                got = attention_fast.fused_step_args(light, pos, table_rope, window)
            else:
                want = attention_fast.block_step_args(dense, pos, table_rope, window)
                got = attention_fast.block_step_args(light, pos, table_rope, window)
            assert len(got) == len(want)
            for a, b in zip(got, want, strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b), (bsz, rows, causal)
    pt, past, lengths, pos = _batch(g, 1, 4, 8, True)
    with pytest.raises(ValueError, match="page_table covers 96 slots"):
        over = PagedBatch(pt, torch.tensor([95], dtype=torch.int32), lengths, pos[:, :4])
        KernelPlan.build(over, 4, 8, True, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_route_names_the_steps_the_planned_attention_sends_to_the_kernel(dtype, monkeypatch):
    """kernel_route against what paged_attention_planned does with a DensePlan: the steps
    it runs through the C++ step, and only those (causal or not, written or not, with or
    without output, prefill, row counts around ROW_INVARIANT_MAX_ROWS, strided input)."""
    from edgebuild.ops import attention_kernel
    from edgebuild.ops.attention import AttentionSpec

    if not attention_kernel.available():
        pytest.skip("edgebuild's attention kernel does not build here")

    class Ran(Exception):
        pass

    def kernel(*a, **k):
        raise Ran

    monkeypatch.setattr(attention_kernel, "decode_step", kernel)
    hq, hkv, d, ps = 4, 2, 16, 8
    cache = torch.zeros(32, 2, hkv, ps, d, dtype=dtype)
    table = torch.randn(512, d)
    for causal, write, want, prefill, rows, strided in itertools.product(
        (True, False), (True, False), (True, False), (True, False), (1, 16, 17, 40),
        (False, True),
    ):  # fmt: skip
        if not write and not want:
            continue  # nothing to do: no caller
        pt = torch.arange(24, dtype=torch.int32).view(2, 12)
        past, lengths = torch.tensor([3, 0], dtype=torch.int32), torch.tensor([rows, 1])
        qkv = torch.randn(2, rows, (hq + 2 * hkv) * d + 8 * strided).to(dtype)
        qkv = qkv[..., : (hq + 2 * hkv) * d]  # strided: a view that is not contiguous
        pos = (past[:, None] + torch.arange(rows)[None, :]).to(torch.int32)
        spec = AttentionSpec(hq, hkv, d, causal=causal, write_kv=write, scale=0.25)
        plan = DensePlan.build(pt, past, lengths.to(torch.int32), rows, ps, causal, write, prefill)
        try:
            attention_fast.paged_attention_planned(
                qkv, cache.clone(), plan, pos, table, None, None, spec, want
            )
            ran = False
        except Ran:
            ran = True
        routed = attention_fast.kernel_route(qkv, cache, d, rows, causal, write, prefill, want)
        # a causal step that writes nothing (no caller) keeps the DensePlan: its block masks
        # are causal, KernelPlan's are not
        assert routed == (ran and not (causal and not write)), (causal, write, want, prefill, rows)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = write_tiny_chat_model(root / "tiny")
    return target, make_random_draft(root / "draft", target, num_layers=2, block_size=5)


def loaded_draft(pair, quant):
    target, draft = pair
    spec = {"method": "dspark", "model": str(draft), "num_speculative_tokens": 4,
            "quantization": quant}  # fmt: skip
    opts = RuntimeOptions(dtype=torch.float32, max_kv_rows=512, page_size=8)
    return LLM(target, speculative=spec, options=opts).draft


@kernels
@pytest.mark.parametrize("quant", ["none", "int4"])
def test_the_block_program_equals_the_modules_bit_for_bit(pair, quant, monkeypatch):
    with torch_threads(1):
        draft = loaded_draft(pair, quant)
        model = draft.model
        program = model.block_program
        assert program is not None and program.block
        runs = []
        real = program.run
        monkeypatch.setattr(program, "run", lambda *a, **k: runs.append(1) or real(*a, **k))
        g = torch.Generator().manual_seed(0)
        seqs = [draft.new_sequence() for _ in range(3)]
        width = model.fc.in_features
        draft.update_context(seqs, [torch.randn(n, width, generator=g) for n in (3, 9, 1)])
        bs = model.config.block_size
        ids = model.block_input_ids(torch.tensor([5, 17, 2]))

        def block():
            batch = make_batch(draft.allocator, seqs, [bs] * len(seqs))
            try:
                return model.block_forward(ids, draft.pools, batch)
            finally:
                for s in seqs:
                    draft.allocator.truncate(s, s.length)

        got = block()
        assert runs == [1]  # the program ran
        monkeypatch.setattr(common, "CPP_LAYERS", False)
        loop = block()  # the Python loop over the same op calls
        model.block_program = None
        want = block()  # the modules
        assert runs == [1, 1]
    assert torch.equal(got, want) and torch.equal(loop, want)
    assert got.abs().sum() > 0


@kernels
@pytest.mark.parametrize("quant", ["none", "int4", "int4-fp32-inputs"])
def test_the_context_update_in_one_call_writes_the_modules_cache_bits(pair, quant, monkeypatch):
    """DSparkDraft.context_update as one edgebuild_attn::context_layers call writes every
    layer's K/V pages bit for bit as the modules' path (each layer's write_context): fp32,
    int4 with int8 and with fp32 inputs (each k/v kernel), unequal rows (padding rows in the
    pass), a second update of more rows than a small plan takes, at 1 and 2 threads (the
    short-update one-thread rule off); the one call ran each time."""
    kind = {"none": 0, "int4": 2, "int4-fp32-inputs": 1}[quant]  # the k/v op context_layers runs
    if quant == "int4-fp32-inputs":
        monkeypatch.setenv(f32_linear.ACT_ENV, "fp32")
        quant = "int4"
    f32_linear._reset()
    try:
        _context_update_both_ways(pair, quant, kind, monkeypatch)
    finally:
        monkeypatch.delenv(f32_linear.ACT_ENV, raising=False)
        f32_linear._reset()


def _context_update_both_ways(pair, quant, kind, monkeypatch):
    from edgebuild.runtime import dspark_backend

    monkeypatch.setattr(dspark_backend, "ONE_THREAD_ROWS", 0)  # threads as set below
    g = torch.Generator().manual_seed(0)
    for threads in (1, 2):
        with torch_threads(threads):
            pools, ran = [], []
            for one_call in (True, False):
                draft = loaded_draft(pair, quant)
                model = draft.model
                assert model.context_program["kind"] == [kind] * len(model.layers)
                if not one_call:
                    model.context_program = None  # the oracle: the modules' path
                real = model._context_in_one_call
                monkeypatch.setattr(
                    model,
                    "_context_in_one_call",
                    lambda *a, f=real, r=ran: r.append(f(*a)) or r[-1],
                )
                if one_call:
                    width = model.fc.in_features
                    updates = [[torch.randn(n, width, generator=g) * 50 for n in rows]
                               for rows in ((3, 9, 1), (2, 1, 30))]  # fmt: skip
                seqs = [draft.new_sequence() for _ in range(3)]
                for feats in updates:
                    draft.update_context(seqs, feats)
                pools.append(draft.pools)
            assert ran == [True, True, False, False]  # the one call, then the modules'
            for one, modules in zip(*pools, strict=True):
                assert torch.equal(one, modules)
            assert pools[0][0].abs().sum() > 0


@kernels
@pytest.mark.parametrize("quant", ["none", "int4"])
def test_a_block_cut_to_its_drafted_rows_keeps_their_bits(pair, quant, monkeypatch):
    """block_forward(rows=n) runs the last layer's o_proj / MLP and the norm on the first n
    rows only: they equal the whole block's first n rows bit for bit on the C++ program, its
    Python loop and the modules (the oracle: the uncut modules' pass)."""
    with torch_threads(1):
        draft = loaded_draft(pair, quant)
        model = draft.model
        g = torch.Generator().manual_seed(1)
        seqs = [draft.new_sequence() for _ in range(2)]
        draft.update_context(seqs, [torch.randn(n, model.fc.in_features, generator=g)
                                    for n in (4, 11)])  # fmt: skip
        bs = model.config.block_size
        ids = model.block_input_ids(torch.tensor([3, 9]))

        def block(rows=None):
            batch = make_batch(draft.allocator, seqs, [bs] * len(seqs))
            try:
                return model.block_forward(ids, draft.pools, batch, rows)
            finally:
                for s in seqs:
                    draft.allocator.truncate(s, s.length)

        program = model.block_program
        model.block_program = None
        whole = block()  # the modules, every row
        model.block_program = program
        cuts = []
        real = program.run
        monkeypatch.setattr(
            program, "run", lambda *a, **k: cuts.append(k["last_rows"]) or real(*a, **k)
        )
        for n in range(1, bs + 1):
            got = block(n)
            assert got.shape == (2, n, model.config.hidden_size)
            assert torch.equal(got, whole[:, :n]), n
        assert cuts == list(range(1, bs + 1))  # the C++ program ran each cut
        monkeypatch.setattr(common, "CPP_LAYERS", False)
        assert torch.equal(block(2), whole[:, :2])  # the Python loop
        model.block_program = None
        assert torch.equal(block(3), whole[:, :3])  # the modules


@pytest.mark.parametrize("small", [1024, 0])
def test_the_page_table_holds_each_sequences_pages(small, monkeypatch):
    """PageAllocator.page_table, from padded lists (a small table) or per sequence: each
    row the sequence's pages, then zeros; int32 [B, max(1, most pages)]."""
    from edgebuild.runtime import kv_cache

    monkeypatch.setattr(kv_cache, "SMALL_TABLE", small)
    alloc = kv_cache.PageAllocator(64, 4)
    seqs = [alloc.new_sequence() for _ in range(3)]
    for s, rows in zip(seqs, (9, 0, 30), strict=True):
        alloc.reserve(s, rows)
    table = alloc.page_table(seqs)
    assert table.dtype == torch.int32 and table.shape == (3, 8)
    for b, s in enumerate(seqs):
        assert table[b].tolist() == list(s.pages) + [0] * (8 - len(s.pages))
    empty = alloc.page_table([seqs[1]])
    assert empty.tolist() == [[0]]


@kernels
def test_a_block_pass_of_no_rows_is_refused(pair):
    with torch_threads(1):
        draft = loaded_draft(pair, "int4")
        with pytest.raises(ValueError, match="rows must be >= 1"):
            draft.model.block_forward(torch.zeros(1, 5, dtype=torch.long), draft.pools, None, 0)


@kernels
def test_the_program_declines_a_block_it_cannot_run(pair):
    with torch_threads(1):
        draft = loaded_draft(pair, "int4")
        model = draft.model
        x = torch.zeros(1, 20, model.config.hidden_size)  # more rows than a row-invariant step
        batch = PagedBatch(
            page_table=torch.zeros(1, 4, dtype=torch.int32),
            past_lengths=torch.zeros(1, dtype=torch.int32),
            input_lengths=torch.tensor([20], dtype=torch.int32),
            positions=torch.arange(20, dtype=torch.int32)[None],
        )
        assert model.block_program.plan_for(x, draft.pools, batch) is None
        batch.input_lengths = torch.tensor([3], dtype=torch.int32)  # padding rows
        assert model.block_program.plan_for(x[:, :4], draft.pools, batch) is None


@kernels
@pytest.mark.parametrize("quant", ["none", "int4", "int8"])
def test_fc_packing_keeps_the_features_in_fp32(pair, quant):
    """fc takes the target's features as they are (spec §2.7: they can exceed 2e4): fp32
    weights on the fp32 kernel, int4 weights on the int4 kernel with fp32 inputs (no int8
    activations), int8 unpacked (F.linear)."""
    with torch_threads(1):
        model = loaded_draft(pair, quant).model
        fc = model.packed_fc
        if quant == "int8":
            assert fc is None
            return
        assert fc.quant == (None if quant == "none" else "int4") and not fc.int4_a8
        g = torch.Generator().manual_seed(1)
        feats = torch.randn(2, 3, model.fc.in_features, generator=g)
        feats[0, 1, 7] = 3e4  # an outlier that int8 activations would crush the row with
        w = model.fc.weight.float()
        if quant == "int4":
            w = dequantize_int4(*quantize_int4(w))  # the weights the kernel computes with
        want = model.hidden_norm(F.linear(feats, w))
        got = model.project_context(feats)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_the_greedy_walk_equals_the_slot_by_slot_walk(monkeypatch):
    """The greedy batch's walk (a few ops) against the slot-by-slot walk it replaces (forced
    through a grammar-free constraint list), ties included: the same tokens, q, confidences."""
    from edgebuild.runtime import markov_walk
    from edgebuild.runtime.sampling import SamplingParams

    g = torch.Generator().manual_seed(5)
    batch, n, k = 4, 6, 8
    cand = torch.randint(0, 1000, (batch, n, k), generator=g)
    scores = torch.randint(0, 3, (batch, n, k, k), generator=g).float()  # many ties
    conf = torch.rand(batch, n, k, generator=g)
    greedy = [SamplingParams(temperature=0.0)] * batch
    gens = [torch.Generator() for _ in range(batch)]
    for counts in ([6, 6, 6, 6], [0, 3, 6, 1]):
        for c in (conf, None):
            fast = markov_walk.walk_lattice(cand, scores, c, counts, greedy, gens)
            slow = markov_walk.walk_lattice(cand, scores, c, counts, greedy, gens, [None] * batch)
            for a, b in zip(fast, slow, strict=True):
                assert a.tokens == b.tokens
                assert torch.equal(a.q, b.q) and torch.equal(a.q_ids, b.q_ids)
                assert torch.equal(a.confidence, b.confidence)
    calls = []
    monkeypatch.setattr(markov_walk, "_walk_greedy", lambda *a: calls.append(1))
    markov_walk.walk_lattice(cand, scores, conf, [2] * batch, greedy, gens)
    assert calls == [1]  # the greedy batch took the fast path


@kernels
def test_argmax_is_torchs_first_max_and_first_nan():
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 5, (6, 49152), generator=g).float()  # ties: the first index wins
    x[1, 30000] = float("nan")
    x[1, 40000] = float("nan")  # the first NaN
    x[2] = float("-inf")
    x[3, 7] = float("inf")
    x[4] = torch.randn(49152, generator=g)
    assert torch.equal(f32_linear.argmax(x), x.argmax(-1))
    assert torch.equal(f32_linear.argmax(x[:1]), x[:1].argmax(-1))
    assert torch.equal(f32_linear.argmax(x[4]), x[4].argmax(-1))  # one row [V]
    assert f32_linear.argmax(x[:, ::2]).tolist() == x[:, ::2].argmax(-1).tolist()  # strided


def cached_rows(draft, seqs) -> torch.Tensor:
    """Every layer's cached K/V rows of each sequence, read through its pages (the free
    list's order may differ between two drafts: the rows must not): [L, sum(lengths), 2, Hkv,
    D]."""
    ps = draft.pools[0].shape[3]
    out = []
    for pool in draft.pools:
        rows = []
        for s in seqs:
            for r in range(s.length):
                rows.append(pool[s.pages[r // ps], :, :, r % ps])
        out.append(torch.stack(rows))
    return torch.stack(out)


@kernels
@pytest.mark.parametrize("quant", ["none", "int4"])
def test_the_whole_proposal_in_one_call_equals_the_passes_bit_for_bit(pair, quant, monkeypatch):
    """TorchDraft.propose_after_context runs the context update, the block pass, the final
    norm, the draft's lm_head and (a greedy batch) the greedy walk as one
    ``edgebuild_attn::draft_pass`` call (DSparkDraft.draft_pass). The oracle: update_context
    then propose on a second copy of the draft (the Python path's op calls). Over steps of 3
    sequences where some add no rows, an update longer than ONE_THREAD_ROWS, each cut of the
    block (1 draft .. block_size), greedy batches (the walk in the call) and batches with a
    sampled request (the walk in Python, on the call's h and base), at 1 and 2 threads: the
    same draft caches after every step and the same proposals (tokens, q, ids, confidence),
    bit for bit; the one call ran on every step. Without its bound arguments (``pass_args``
    None) the passes run."""
    from edgebuild.runtime.sampling import SamplingParams

    g = torch.Generator().manual_seed(4)
    greedy, sampled = [SamplingParams()] * 3, [SamplingParams(), SamplingParams(temperature=0.8),
                                               SamplingParams()]  # fmt: skip
    for threads in (1, 2):
        with torch_threads(threads):
            one, two = loaded_draft(pair, quant), loaded_draft(pair, quant)
            assert one.model.pass_args is not None and one.model.pass_args["walk"] is not None
            bs = one.model.config.block_size
            walks, hs = [], {id(one): [], id(two): []}
            monkeypatch.setattr(
                one.model,
                "draft_pass",
                lambda *a, f=one.model.draft_pass, w=walks, **k: w.append(a[8]) or f(*a, **k),
            )
            for d in (one, two):
                monkeypatch.setattr(
                    d, "walk", lambda h, *a, w=d.walk, k=hs[id(d)], **kw: k.append(h) or w(h, *a, **kw)
                )  # fmt: skip
            s1 = [one.new_sequence() for _ in range(3)]
            s2 = [two.new_sequence() for _ in range(3)]
            width = one.model.fc.in_features
            steps = [  # (sequences adding rows, their rows, drafts of each sequence, params)
                ((0, 1, 2), (3, 9, 1), [bs, bs, bs], greedy),
                ((1,), (2,), [1, 3, 2], sampled),
                ((2, 0), (20, 1), [2, 0, 1], greedy),
                ((), (), [bs - 1, 2, bs], sampled),
                ((0, 1, 2), (1, 1, 1), [1, 1, 1], greedy),
                ((), (), [2, 3, 1], greedy),
            ]
            for who, rows, counts, params in steps:
                feats = [torch.randn(n, width, generator=g) * 20 for n in rows]
                anchors = torch.randint(0, 50, (3,), generator=g).tolist()
                got = one.propose_after_context(
                    [s1[i] for i in who], feats, s1, anchors, counts, params,
                    [torch.Generator().manual_seed(7) for _ in range(3)],
                )  # fmt: skip
                if who:
                    two.update_context([s2[i] for i in who], feats)
                want = two.propose(
                    s2,
                    anchors,
                    counts,
                    params,
                    [torch.Generator().manual_seed(7) for _ in range(3)],
                )
                for a, b in zip(got, want, strict=True):
                    assert a.tokens == b.tokens
                    assert torch.equal(a.q, b.q) and torch.equal(a.confidence, b.confidence)
                    assert (a.q_ids is None) == (b.q_ids is None)
                    assert a.q_ids is None or torch.equal(a.q_ids, b.q_ids)
                assert torch.equal(cached_rows(one, s1), cached_rows(two, s2))
            # the greedy steps walked in the call, the sampled ones in Python on its h
            assert walks == [None if p is sampled else (one.top_k, c) for _, _, c, p in steps]
            assert len(hs[id(one)]) == 2 and len(hs[id(two)]) == len(steps)
            for a, b in zip(hs[id(one)], [hs[id(two)][i] for i in (1, 3)], strict=True):
                assert a.shape == b.shape and torch.equal(a, b)
            assert any(len(p.tokens) for p in got) and cached_rows(one, s1).abs().sum() > 0
            one.model.pass_args = None  # not bound: the passes
            feats = [torch.randn(2, width, generator=g)]
            got = one.propose_after_context(
                [s1[0]], feats, s1, [1, 2, 3], [2, 2, 2], greedy,
                [torch.Generator() for _ in range(3)],
            )  # fmt: skip
            two.update_context([s2[0]], feats)
            want = two.propose(s2, [1, 2, 3], [2, 2, 2], greedy,
                               [torch.Generator() for _ in range(3)])  # fmt: skip
            assert len(walks) == len(steps)
            assert [p.tokens for p in got] == [p.tokens for p in want]
            assert torch.equal(cached_rows(one, s1), cached_rows(two, s2))


@kernels
def test_the_one_call_proposal_takes_long_contexts_and_falls_back_where_it_must(pair, monkeypatch):
    """Next to a sequence of 1,000 context rows, a new one adds 30 rows while the first adds
    none, then 1 (its padding rows' positions would pass the RoPE table's first 1,024 rows:
    they once did and failed the step): the same caches and proposals as the two passes. A
    batch listing one sequence twice, or adding rows to one outside the batch, takes the two
    passes."""
    from edgebuild.runtime.sampling import SamplingParams

    target, draft_dir = pair
    spec = {"method": "dspark", "model": str(draft_dir), "num_speculative_tokens": 4,
            "quantization": "none"}  # fmt: skip
    opts = RuntimeOptions(dtype=torch.float32, max_kv_rows=2048, page_size=8)
    one, two = (LLM(target, speculative=spec, options=opts).draft for _ in range(2))
    calls = []
    monkeypatch.setattr(
        one.model,
        "draft_pass",
        lambda *a, f=one.model.draft_pass, c=calls, **k: c.append(1) or f(*a, **k),
    )
    g = torch.Generator().manual_seed(9)
    width = one.model.fc.in_features
    s1 = [one.new_sequence() for _ in range(2)]
    s2 = [two.new_sequence() for _ in range(2)]
    greedy = [SamplingParams()] * 2
    for who, rows in (((0,), (1000,)), ((1,), (30,)), ((0, 1), (1, 30)), ((0,), (3,))):
        feats = [torch.randn(n, width, generator=g) for n in rows]
        got = one.propose_after_context(
            [s1[i] for i in who], feats, s1, [4, 8], [3, 4], greedy, [torch.Generator()] * 2
        )
        two.update_context([s2[i] for i in who], feats)
        want = two.propose(s2, [4, 8], [3, 4], greedy, [torch.Generator()] * 2)
        assert [p.tokens for p in got] == [p.tokens for p in want]
        assert torch.equal(cached_rows(one, s1), cached_rows(two, s2))
    assert len(calls) == 4 and s1[0].length == 1004
    extra = one.new_sequence()
    feats = [torch.randn(2, width, generator=g)]
    for ctx, seqs in (([s1[0]], [s1[0], s1[0]]), ([extra], s1)):
        one.propose_after_context(ctx, feats, seqs, [1] * len(seqs), [2] * len(seqs),
                                  [SamplingParams()] * len(seqs),
                                  [torch.Generator() for _ in seqs])  # fmt: skip
    assert len(calls) == 4  # both took the two passes
    assert extra.length == 2 and s1[0].length == 1006
