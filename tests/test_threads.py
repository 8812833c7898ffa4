"""torch's intra-op threads around the CPU runtime's small ops (edgebuild/ops/threads.py).

Oracles: ``Tensor.to`` for the values; torch.set_num_threads, recorded, for the thread count
each conversion ran at; torch.get_num_threads for the setting being restored.
"""

from __future__ import annotations

import pytest
import torch

from edgebuild.ops import threads


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _recording(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = torch.set_num_threads

    def record(n: int) -> None:
        calls.append(n)
        real(n)

    monkeypatch.setattr(torch, "set_num_threads", record)
    return calls


@pytest.mark.parametrize(
    "src,dst", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]
)
def test_a_large_conversion_runs_on_one_thread_and_restores_the_setting(
    src, dst, two_threads, monkeypatch
):
    """A SmolLM2 logits row (49,152 values, over torch's OpenMP grain): the values of
    ``Tensor.to``, converted at one thread, the two threads set back after."""
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(1, 49152, generator=g) * 30).to(src)
    calls = _recording(monkeypatch)
    got = threads.converted(t, dst)
    assert calls == [1, 2]
    assert torch.get_num_threads() == 2
    assert got.dtype == dst and torch.equal(got, t.to(dst))


def test_small_or_same_dtype_tensors_are_converted_in_place_of_the_call(two_threads, monkeypatch):
    """At or under the grain (a decode row's hidden state, a draft's 8,192 logits) no switch;
    a tensor already of the dtype comes back itself."""
    calls = _recording(monkeypatch)
    small = torch.randn(4, threads.OPENMP_GRAIN // 4)
    assert torch.equal(threads.converted(small, torch.bfloat16), small.to(torch.bfloat16))
    big = torch.randn(2, threads.OPENMP_GRAIN)
    assert threads.converted(big, torch.float32) is big
    assert calls == []
