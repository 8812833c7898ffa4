"""The real example model (SmolLM2-135M) exported as a portable graph matches torch in onnxruntime.

fp32 graph, batch of two with unequal lengths and a cached past: logits of the requested rows
and the updated caches against :class:`LlamaForCausalLM` over the same (dense) cache.
"""

from __future__ import annotations

import pytest
import torch
from export_fixtures import base_feeds, run_ort

from edgebuild.checkpoint.source import WeightSource
from edgebuild.export import ExportOptions, GraphKind, export_base
from edgebuild.models.common import PagedBatch
from edgebuild.models.llama import LlamaForCausalLM

pytestmark = pytest.mark.slow


def test_smollm2_portable_base_matches_torch_within_1e_3(smollm2_dir, tmp_path):
    options = ExportOptions(kind=GraphKind.PORTABLE, dtype="float32", rope_rows=512)
    exported = export_base(WeightSource(smollm2_dir), tmp_path, options)
    model = LlamaForCausalLM.from_source(WeightSource(smollm2_dir), torch.float32)
    feeds = base_feeds(model.config, rows=6, capacity=16)
    pages = torch.arange(2, dtype=torch.int32).unsqueeze(1)
    caches = [torch.zeros_like(feeds[f"kv_cache_{i}"]) for i in range(30)]
    # a real past for sequence 1: its first 4 tokens prefilled by the model itself
    past_ids = torch.tensor([[1, 2, 3, 4], [504, 2683, 314, 260]], dtype=torch.int32)
    zero, four = torch.zeros(2, dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32)
    positions = torch.arange(4, dtype=torch.int32).expand(2, 4)
    with torch.no_grad():
        model(caches, PagedBatch(pages, zero, four, positions), input_ids=past_ids)
    feeds.update({f"kv_cache_{i}": c.clone() for i, c in enumerate(caches)})
    batch = PagedBatch(pages, feeds["past_lengths"], feeds["input_lengths"], feeds["positions"])
    with torch.no_grad():
        logits, _ = model(
            caches, batch, input_ids=feeds["input_ids"], logits_rows=feeds["logits_rows"].long()
        )
    got = run_ort(exported.onnx_path, feeds)
    torch.testing.assert_close(torch.from_numpy(got["logits"]), logits, atol=1e-3, rtol=0)
    assert logits[0, 0].argmax() == torch.from_numpy(got["logits"])[0, 0].argmax()
    for i in (0, 29):
        torch.testing.assert_close(
            torch.from_numpy(got[f"present_kv_cache_{i}"]), caches[i], atol=1e-3, rtol=0
        )
