"""A decode / verify step's layers as flat kernel calls (``FusedLayers``) give the modules' bits.

The program exists only to drop the Python between the kernels, so its oracle is the module
path itself (tested against transformers in test_llama_parity.py): logits, taps and every KV
page must be equal bit for bit over prefill, decode, verify and batched steps, and the program
must actually have run the decode / verify steps (not fallen back everywhere).
"""

from __future__ import annotations

import pytest
import torch
from tiny_checkpoints import write_tiny_checkpoint

from edgebuild.checkpoint.source import WeightSource
from edgebuild.models import common
from edgebuild.models.common import FusedLayers
from edgebuild.models.llama import LlamaForCausalLM
from edgebuild.ops import attention_kernel, f32_linear
from edgebuild.runtime.torch_backend import TorchTarget

needs_kernels = pytest.mark.skipif(
    not (f32_linear.available() and attention_kernel.available()),
    reason="edgebuild's fp32 / int4 and decode attention kernels do not run here (AVX2 + g++)",
)

FIELDS = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    tie_word_embeddings=True,
)  # fmt: skip


def steps(target: TorchTarget) -> list[torch.Tensor]:
    """Prefill three prompts, then decode / verify steps of one and of several sequences
    (equal row counts: the program's; unequal: the packed-rows path); every output."""
    g = torch.Generator().manual_seed(1)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, 96, (n,), generator=g)

    seqs = [target.new_sequence() for _ in range(3)]
    taps = (0, 2)
    outs = []

    def step(which: list[int], lengths: list[int], prefill: bool = False) -> None:
        rows = [ids(n) for n in lengths]
        logits_rows = [list(range(n)) for n in lengths]
        out = target.forward(
            [seqs[i] for i in which], rows, logits_rows, tap_layers=taps, prefill=prefill
        )
        outs.extend(out.logits)
        outs.extend(out.taps)

    step([0, 1, 2], [9, 40, 3], prefill=True)
    step([0], [1])  # a lone decode
    step([0], [8])  # a lone verify
    step([0, 1, 2], [1, 1, 1])  # a batched decode
    step([0, 1, 2], [5, 5, 5])  # a batched verify
    step([0, 1, 2], [1, 4, 7])  # unequal rows: run unpadded by the modules
    for _ in range(40):  # past a page (page_size 8) and a KEY_ALIGN block
        step([1], [1])
    outs.extend(p.clone() for p in target.pools)
    return outs


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("quant", [None, "int4"])
@pytest.mark.parametrize("cpp", [True, False], ids=["cpp-loop", "python-loop"])
def test_fused_layers_equal_the_modules_bit_for_bit(tmp_path, monkeypatch, arch, quant, cpp):
    monkeypatch.setattr(common, "CPP_LAYERS", cpp)
    ckpt = write_tiny_checkpoint(tmp_path / arch, arch, seed=3, sharpen=4.0, **FIELDS)
    ran = []
    run = FusedLayers.run

    def counted(self, x, *args):
        ran.append(tuple(x.shape[:2]))
        return run(self, x, *args)

    monkeypatch.setattr(FusedLayers, "run", counted)
    got = {}
    for fused in (True, False):
        model = LlamaForCausalLM.from_source(WeightSource(ckpt)).pack_for_cpu(quant)
        assert model.fused_layers is not None and model.fused_layers.flat is not None
        if not fused:
            model.fused_layers = None
        got[fused] = steps(TorchTarget(model, max_kv_rows=512, page_size=8))
    assert len(got[True]) == len(got[False])
    for i, (a, b) in enumerate(zip(got[True], got[False], strict=True)):
        assert torch.equal(a, b), f"output {i} differs"
    # the decode / verify steps of equal row counts ran as the program; prefill did not
    assert ran == [(1, 1), (1, 8), (3, 1), (3, 5)] + [(1, 1)] * 40


@needs_kernels
def test_a_layer_the_program_cannot_run_keeps_the_modules(tmp_path):
    """Linears off edgebuild's fp32 / int4 kernels (int8, bf16) build no program."""
    ll = write_tiny_checkpoint(tmp_path / "ll", "llama", seed=3, **FIELDS)
    model = LlamaForCausalLM.from_source(WeightSource(ll))
    assert model.pack_for_cpu("int8").fused_layers is None
    bf16 = LlamaForCausalLM.from_source(WeightSource(ll), dtype=torch.bfloat16)
    assert bf16.pack_for_cpu().fused_layers is None
