"""``edgebuild::paged_attention`` against a dense float64 oracle written here, phase by phase.

The oracle keeps each sequence's K/V densely (no pages), applies RoPE as a complex rotation and
RMSNorm by formula, and decides visibility key by key in Python; it shares nothing with the op
but the fp32 cos/sin table (an input of the op), which is also built here.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from edgebuild.errors import ConfigError
from edgebuild.ops.attention import gather_kv, paged_attention
from edgebuild.ops.norm import rms_norm

TOL = 1e-5
MAX_POSITION = 128


@dataclass(frozen=True)
class Setup:
    hq: int = 4
    hkv: int = 2
    d: int = 16
    rotary_dim: int = 16
    page_size: int = 4
    pages_per_seq: int = 6
    num_pages: int = 40
    qk_norm: bool = False
    window: int = 0
    eps: float = 1e-6
    theta: float = 10000.0

    @property
    def width(self) -> int:
        return (self.hq + 2 * self.hkv) * self.d


def cos_sin_table(rotary_dim: int, theta: float) -> torch.Tensor:
    """fp32 [MAX_POSITION, rotary_dim]: [cos | sin] of p * theta^(-2j/rotary_dim), via float64."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    angles = torch.arange(MAX_POSITION, dtype=torch.float64)[:, None] * theta**-exponents
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Oracle RoPE of one row ``x`` [H, D]: channel pairs (j, j + r/2) as complex numbers."""
    half = cos.shape[-1]
    z = torch.complex(x[:, :half], x[:, half : 2 * half]) * torch.complex(cos, sin)
    return torch.cat((z.real, z.imag, x[:, 2 * half :]), dim=-1)


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


class DenseOracle:
    """Float64 dense attention; ``self.keys[b]`` is sequence b's committed K (post norm + RoPE)."""

    def __init__(self, setup: Setup, batch: int, table: torch.Tensor, q_w, k_w, dtype, cache_dtype):
        self.s, self.table = setup, table.double()
        self.q_w, self.k_w = q_w, k_w
        self.dtype, self.cache_dtype = dtype, cache_dtype  # the contract's rounding points
        self.keys = [torch.zeros(0, setup.hkv, setup.d, dtype=torch.float64)] * batch
        self.values = list(self.keys)

    def project(self, row: torch.Tensor, position: int):
        s = self.s
        heads = row.double().reshape(s.hq + 2 * s.hkv, s.d)
        q, k, v = heads[: s.hq], heads[s.hq : s.hq + s.hkv], heads[s.hq + s.hkv :]
        if self.q_w is not None:
            q = self.round(norm(q, self.q_w.double(), s.eps), self.dtype)
            k = self.round(norm(k, self.k_w.double(), s.eps), self.dtype)
        half = s.rotary_dim // 2
        cos, sin = self.table[position, :half], self.table[position, half:]
        q, k = (
            self.round(rotate(q, cos, sin), self.dtype),
            self.round(rotate(k, cos, sin), self.dtype),
        )
        return q, self.round(k, self.cache_dtype), self.round(v, self.cache_dtype)

    @staticmethod
    def round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x.to(dtype).double()

    def sees(self, i: int, t: int, past: int, causal: bool, tree) -> bool:
        if self.s.window and (past + i) - t >= self.s.window:
            return False
        if t < past:
            return True
        j = t - past
        return bool(tree[i][j]) if tree is not None else (j <= i or not causal)

    def step(self, qkv, past, lengths, positions, causal, write, tree_mask=None):
        s = self.s
        out = torch.zeros(qkv.shape[0], qkv.shape[1], s.hq, s.d, dtype=torch.float64)
        for b, (p, n) in enumerate(zip(past, lengths, strict=True)):
            assert self.keys[b].shape[0] >= p, "test bug: oracle has fewer committed rows"
            rows = [self.project(qkv[b, i], int(positions[b, i])) for i in range(n)]
            keys = torch.cat([self.keys[b][:p]] + [r[1][None] for r in rows])
            values = torch.cat([self.values[b][:p]] + [r[2][None] for r in rows])
            tree = None if tree_mask is None else tree_mask[b].tolist()
            for i, (q, _, _) in enumerate(rows):
                visible = [t for t in range(p + n) if self.sees(i, t, p, causal, tree)]
                for h in range(s.hq if visible else 0):  # a row that sees nothing stays zero
                    kv_head = h // (s.hq // s.hkv)
                    scores = torch.stack([q[h] @ keys[t, kv_head] for t in visible]) * s.d**-0.5
                    probs = torch.softmax(scores, dim=0)
                    out[b, i, h] = sum(
                        pr * values[t, kv_head] for pr, t in zip(probs, visible, strict=True)
                    )
            if write:
                self.keys[b], self.values[b] = keys, values
        return out.reshape(qkv.shape[0], qkv.shape[1], s.hq * s.d)


def read_dense(cache: torch.Tensor, page_table: torch.Tensor, b: int, length: int):
    """The test's own page walk: [length, Hkv, D] K and V of sequence b."""
    ps = cache.shape[3]
    pages = [int(page_table[b, t // ps]) for t in range(length)]
    keys = [cache[page, 0, :, t % ps] for t, page in enumerate(pages)]
    values = [cache[page, 1, :, t % ps] for t, page in enumerate(pages)]
    empty = cache.new_zeros(0, cache.shape[2], cache.shape[4])
    return (torch.stack(keys), torch.stack(values)) if length else (empty, empty)


class Harness:
    """Runs the op and the oracle side by side on shuffled, non-contiguous pages."""

    def __init__(
        self,
        setup: Setup,
        batch: int,
        seed: int = 0,
        dtype=torch.float32,
        cache_dtype=None,
        norm_dtype=None,
    ):
        self.s, self.batch, self.dtype = setup, batch, dtype
        cache_dtype, norm_dtype = cache_dtype or dtype, norm_dtype or dtype
        self.gen = torch.Generator().manual_seed(seed)
        # garbage everywhere, so reading a slot that was never written cannot go unnoticed
        self.cache = torch.randn(
            setup.num_pages, 2, setup.hkv, setup.page_size, setup.d, generator=self.gen
        ).to(cache_dtype)
        perm = torch.randperm(setup.num_pages, generator=self.gen)
        used = perm[: batch * setup.pages_per_seq]
        self.page_table = used.reshape(batch, setup.pages_per_seq).to(torch.int32)
        self.table = cos_sin_table(setup.rotary_dim, setup.theta)
        self.q_w = self.k_w = None
        if setup.qk_norm:
            self.q_w = (1 + 0.5 * torch.randn(setup.d, generator=self.gen)).to(norm_dtype)
            self.k_w = (1 + 0.5 * torch.randn(setup.d, generator=self.gen)).to(norm_dtype)
        self.oracle = DenseOracle(setup, batch, self.table, self.q_w, self.k_w, dtype, cache_dtype)

    def qkv(self, rows: int, lengths) -> torch.Tensor:
        x = torch.randn(self.batch, rows, self.s.width, generator=self.gen).to(self.dtype)
        for b, n in enumerate(lengths):
            x[b, n:] = float("nan")  # padding rows must never be read
        return x

    def run(self, qkv, past, lengths, positions, *, causal=True, write=True, tree_mask=None):
        s = self.s
        return paged_attention(
            qkv,
            self.cache,
            self.page_table,
            torch.tensor(past, dtype=torch.int32),
            torch.tensor(lengths, dtype=torch.int32),
            positions,
            self.table,
            self.q_w,
            self.k_w,
            tree_mask,
            num_q_heads=s.hq,
            num_kv_heads=s.hkv,
            head_dim=s.d,
            rotary_dim=s.rotary_dim,
            causal=causal,
            write_kv=write,
            sliding_window=s.window,
            scale=s.d**-0.5,
            rms_norm_eps=s.eps,
            page_size=s.page_size,
        )

    def step(
        self,
        rows,
        past,
        lengths,
        positions=None,
        *,
        causal=True,
        write=True,
        tree_mask=None,
        tol=TOL,
    ):
        """One call of op and oracle; checks outputs, padding rows and the cache contents."""
        qkv = self.qkv(rows, lengths)
        if positions is None:
            positions = torch.tensor(past, dtype=torch.int32)[:, None] + torch.arange(rows)
            positions = positions.to(torch.int32)
        before = self.cache.clone()
        out = self.run(
            qkv, past, lengths, positions, causal=causal, write=write, tree_mask=tree_mask
        )
        expected = self.oracle.step(qkv, past, lengths, positions, causal, write, tree_mask)
        assert out.shape == (self.batch, rows, self.s.hq * self.s.d) and out.dtype == self.dtype
        for b, n in enumerate(lengths):
            assert (out[b, :n].double() - expected[b, :n]).abs().max().item() <= tol if n else True
            assert torch.equal(out[b, n:], torch.zeros_like(out[b, n:])), "padding rows not zero"
        if not write:
            assert torch.equal(self.cache, before), "write_kv=False changed the cache"
        self.check_cache(tol)
        return out

    def check_cache(self, tol=TOL):
        for b in range(self.batch):
            length = self.oracle.keys[b].shape[0]
            keys, values = read_dense(self.cache, self.page_table, b, length)
            assert (
                (keys.double() - self.oracle.keys[b]).abs().max().item() <= tol if length else True
            )
            assert (
                (values.double() - self.oracle.values[b]).abs().max().item() <= tol
                if length
                else True
            )


HEADS = [pytest.param((4, 2), id="gqa-4-2"), pytest.param((2, 2), id="mha-2-2")]


@pytest.mark.parametrize("heads", HEADS)
def test_prefill_then_decode_matches_dense_attention(heads):
    h = Harness(Setup(hq=heads[0], hkv=heads[1]), batch=2)
    h.step(9, past=[0, 0], lengths=[9, 9])
    for step in range(3):
        h.step(1, past=[9 + step, 9 + step], lengths=[1, 1])


@pytest.mark.parametrize("heads", HEADS)
def test_chunked_prefill_matches_dense_attention(heads):
    h = Harness(Setup(hq=heads[0], hkv=heads[1]), batch=1)
    h.step(6, past=[0], lengths=[6])
    h.step(5, past=[6], lengths=[5])
    h.step(4, past=[11], lengths=[4])


def test_two_chunks_equal_one_prefill():
    setup = Setup()
    one, two = Harness(setup, batch=1, seed=3), Harness(setup, batch=1, seed=3)
    qkv = one.qkv(10, [10])
    positions = torch.arange(10, dtype=torch.int32)[None]
    full = one.run(qkv, [0], [10], positions)
    first = two.run(qkv[:, :6], [0], [6], positions[:, :6])
    second = two.run(qkv[:, 6:], [6], [4], positions[:, 6:])
    torch.testing.assert_close(torch.cat((first, second), dim=1), full, rtol=0, atol=1e-6)
    k_one, v_one = read_dense(one.cache, one.page_table, 0, 10)
    k_two, v_two = read_dense(two.cache, two.page_table, 0, 10)
    assert torch.equal(k_one, k_two) and torch.equal(v_one, v_two)


def test_chain_verify_and_rollback_match_dense_attention():
    h = Harness(Setup(), batch=2)
    h.step(7, past=[0, 0], lengths=[7, 5])
    h.step(4, past=[7, 5], lengths=[4, 4])  # verify anchor + 3 drafts
    # seq 0 accepted 1 draft, seq 1 accepted all 3: the next verify starts there
    h.step(4, past=[9, 9], lengths=[4, 4])


def test_tree_verify_matches_dense_attention():
    # node parents (-1 = root): 0 <- 1, 0 <- 2, 1 <- 3, 2 <- 4, 3 <- 5
    parents = [-1, 0, 0, 1, 2, 3]
    nodes = len(parents)
    mask = torch.zeros(nodes, nodes, dtype=torch.bool)
    depth = [0] * nodes
    for i in range(nodes):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
        depth[i] = int(mask[i].sum()) - 1
    h = Harness(Setup(), batch=2)
    h.step(6, past=[0, 0], lengths=[6, 3])
    past = [6, 3]
    positions = torch.tensor([[p + dd for dd in depth] for p in past], dtype=torch.int32)
    tree = torch.stack([mask, mask])
    tree_out = h.step(nodes, past=past, lengths=[nodes, nodes], positions=positions, tree_mask=tree)
    # the tree mask really replaced the causal rule: node 2 does not see node 1
    chain = Harness(Setup(), batch=2)
    chain.step(6, past=[0, 0], lengths=[6, 3])
    chain_out = chain.step(nodes, past=past, lengths=[nodes, nodes], positions=positions)
    assert not torch.allclose(tree_out[:, 2], chain_out[:, 2])


def test_draft_context_update_and_non_causal_block_leave_only_context_in_cache():
    h = Harness(Setup(qk_norm=True), batch=2)
    h.step(5, past=[0, 0], lengths=[5, 3])  # context update (outputs ignored by the caller)
    h.step(4, past=[5, 3], lengths=[4, 4], causal=False, write=False)  # draft block
    h.step(2, past=[5, 3], lengths=[2, 1])  # accepted rows' context
    h.step(4, past=[7, 4], lengths=[4, 4], causal=False, write=False)


def test_unequal_lengths_with_padding_rows_and_an_idle_sequence():
    h = Harness(Setup(), batch=3)
    h.step(6, past=[0, 0, 0], lengths=[6, 4, 2])
    h.step(3, past=[6, 4, 2], lengths=[3, 1, 0])
    h.step(2, past=[9, 5, 2], lengths=[1, 2, 2])


def test_qk_norm_matches_dense_attention():
    h = Harness(Setup(qk_norm=True, hq=4, hkv=1), batch=2)
    h.step(8, past=[0, 0], lengths=[8, 6])
    h.step(2, past=[8, 6], lengths=[2, 1])


def test_sliding_window_matches_dense_attention():
    h = Harness(Setup(window=3), batch=2)
    h.step(7, past=[0, 0], lengths=[7, 4])
    h.step(3, past=[7, 4], lengths=[3, 3])
    h.step(1, past=[10, 7], lengths=[1, 1])
    h.step(3, past=[11, 8], lengths=[3, 3], causal=False, write=False)


def test_partial_rotary_matches_dense_attention():
    h = Harness(Setup(rotary_dim=8, qk_norm=True), batch=2)
    h.step(6, past=[0, 0], lengths=[6, 2])
    h.step(1, past=[6, 2], lengths=[1, 1])


def test_bf16_follows_the_oracle_with_rounding_and_writes_bf16():
    h = Harness(Setup(qk_norm=True), batch=2, dtype=torch.bfloat16)
    h.step(6, past=[0, 0], lengths=[6, 4], tol=3e-2)
    h.step(2, past=[6, 4], lengths=[2, 2], tol=3e-2)
    assert h.cache.dtype == torch.bfloat16


def test_fp32_rows_with_a_bf16_cache_attend_with_the_rounded_keys_at_once():
    h = Harness(Setup(qk_norm=True), batch=2, cache_dtype=torch.bfloat16)
    h.step(6, past=[0, 0], lengths=[6, 4])
    h.step(3, past=[6, 4], lengths=[3, 2])
    assert h.cache.dtype == torch.bfloat16


def test_a_tree_row_that_sees_nothing_outputs_zeros():
    h = Harness(Setup(), batch=2)
    tree = torch.ones(4, 4, dtype=torch.bool).tril().expand(2, 4, 4).clone()
    tree[0, 2] = False  # sequence 0 has no cached rows: its row 2 sees no key at all
    out = h.step(4, past=[0, 0], lengths=[4, 4], tree_mask=tree)
    assert torch.equal(out[0, 2], torch.zeros_like(out[0, 2]))
    assert out[0, 3].abs().sum() > 0


def test_gather_kv_reads_the_pages_in_logical_order():
    h = Harness(Setup(), batch=2)
    h.step(7, past=[0, 0], lengths=[7, 5])
    keys, values = gather_kv(h.cache, h.page_table, 1, 5)
    k_ref, v_ref = read_dense(h.cache, h.page_table, 1, 5)
    assert keys.shape == (2, 5, 16)
    assert torch.equal(keys, k_ref.transpose(0, 1)) and torch.equal(values, v_ref.transpose(0, 1))


def test_rms_norm_equals_qwen3_rms_norm():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        hf = Qwen3RMSNorm(32, eps=1e-6).to(dtype)
        with torch.no_grad():
            hf.weight.copy_(torch.randn(32))
        x = (torch.randn(3, 5, 32) * 4).to(dtype)
        assert torch.equal(rms_norm(x, hf.weight.detach(), 1e-6), hf(x).detach())


def test_a_page_table_too_small_is_refused_before_writing():
    h = Harness(Setup(page_size=4, pages_per_seq=2), batch=1)
    before = h.cache.clone()
    with pytest.raises(ValueError, match=r"needs 3 pages for 9 slots .* page_table has 2 columns"):
        h.run(h.qkv(9, [9]), [0], [9], torch.arange(9, dtype=torch.int32)[None])
    assert torch.equal(h.cache, before)
    # without write_kv only the cached rows need pages
    h.step(8, past=[0], lengths=[8])
    h.step(3, past=[8], lengths=[3], causal=False, write=False)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"qkv_width": 10}, ValueError, r"qkv must be float \[B, S, \(Hq \+ 2\*Hkv\) \* D\]"),
        ({"num_kv_heads": 3}, ConfigError, "multiple of num_kv_heads"),
        (
            {"rotary_dim": 32},
            ConfigError,
            r"rotary_dim \(32\) must be even and in \[0, head_dim=16\]",
        ),
        ({"position": MAX_POSITION}, ValueError, "rope_cos_sin has 128 rows"),
        ({"page_table_dtype": torch.int64}, ValueError, "page_table must be int32"),
    ],
)
def test_bad_inputs_raise_clear_errors(change, error, match):
    setup = Setup()
    h = Harness(setup, batch=1)
    qkv = h.qkv(3, [3])
    if "qkv_width" in change:
        qkv = qkv[..., : change["qkv_width"]]
    positions = torch.arange(3, dtype=torch.int32)[None]
    if "position" in change:
        positions[0, 2] = change["position"]
    page_table = h.page_table.to(change.get("page_table_dtype", torch.int32))
    table = h.table
    if "rotary_dim" in change:
        table = cos_sin_table(change["rotary_dim"], 1e4)
    with pytest.raises(error, match=match):
        paged_attention(
            qkv,
            h.cache,
            page_table,
            torch.tensor([0], dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32),
            positions,
            table,
            num_q_heads=setup.hq,
            num_kv_heads=change.get("num_kv_heads", setup.hkv),
            head_dim=setup.d,
            rotary_dim=change.get("rotary_dim", setup.rotary_dim),
            causal=True,
            write_kv=True,
            scale=0.25,
            page_size=setup.page_size,
        )


def test_op_schema_and_fake_implementation_pass_opcheck():
    h = Harness(Setup(qk_norm=True), batch=2)
    h.step(5, past=[0, 0], lengths=[5, 3])
    s = h.s
    args = (
        h.qkv(2, [2, 1]).nan_to_num(0.0),
        h.cache,
        h.page_table,
        torch.tensor([5, 3], dtype=torch.int32),
        torch.tensor([2, 1], dtype=torch.int32),
        torch.tensor([[5, 6], [3, 4]], dtype=torch.int32),
        h.table,
        h.q_w,
        h.k_w,
        None,
    )
    kwargs = dict(
        num_q_heads=s.hq,
        num_kv_heads=s.hkv,
        head_dim=s.d,
        rotary_dim=s.rotary_dim,
        causal=True,
        write_kv=True,
        sliding_window=0,
        scale=0.25,
        rms_norm_eps=1e-6,
        page_size=s.page_size,
    )
    # schema (declared mutation of kv_cache only), autograd registration, fake impl, AOT dispatch
    torch.library.opcheck(torch.ops.edgebuild.paged_attention.default, args, kwargs)
