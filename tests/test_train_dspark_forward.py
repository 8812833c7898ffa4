"""The draft trainer's dense masked forward equals the runtime's paged draft forward.

Oracle: :class:`edgebuild.models.dspark.DSparkDraft` run the way the decoder runs it
(``context_update`` with the target features of positions ``< s``, then ``block_forward`` at
``s .. s+B-1``), one anchor at a time, against ``tools/train_dspark/model.train_forward`` with
several anchors of two sequences in one batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from dspark_fixtures import make_random_draft
from tiny_checkpoints import write_tiny_llama

from edgebuild.checkpoint.source import WeightSource
from edgebuild.runtime.dspark_loader import prepare_torch_draft as prepare_draft
from edgebuild.runtime.llm import RuntimeOptions
from edgebuild.runtime.torch_backend import make_batch
from edgebuild.speculative.config import SpeculativeConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tools.train_dspark.model import (  # noqa: E402
    AnchorBatch,
    labels_and_valid,
    markov_prev_ids,
    train_forward,
)

transformers = pytest.importorskip("transformers")


def _tiny_target(path: Path) -> Path:
    """The DSpark tests' tiny tied Llama target, unsharpened (tests/tiny_checkpoints.py)."""
    return write_tiny_llama(path, sharpen=1.0)


def test_training_forward_matches_the_paged_runtime_forward(tmp_path):
    target = _tiny_target(tmp_path / "target")
    draft_dir = make_random_draft(tmp_path / "draft", target, num_layers=2, scale=0.2)
    spec = SpeculativeConfig.parse(  # the draft unquantized: the training forward's weights
        {"method": "dspark", "model": str(draft_dir), "num_speculative_tokens": 7,
         "quantization": "none"}
    )  # fmt: skip
    backend = prepare_draft(spec, WeightSource(target))(
        RuntimeOptions(max_kv_rows=512, page_size=8)
    )
    model = backend.model
    n_feat = model.fc.in_features
    g = torch.Generator().manual_seed(1)
    lengths = [23, 17]
    ids = torch.randint(0, 90, (2, 23), generator=g)
    feats = torch.randn(2, 23, n_feat, generator=g) * 3
    anchors = torch.tensor([[4, 11, 19], [1, 9, 0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    batch = AnchorBatch(feats, ids, torch.tensor(lengths), anchors, valid)
    with torch.no_grad():
        h = train_forward(model, batch)  # [2, 3, 7, d]
    for b in range(2):
        for j in range(3):
            if not valid[b, j]:
                continue
            s = int(anchors[b, j])
            seq = backend.new_sequence()
            backend.update_context([seq], [feats[b, :s]])
            blk = make_batch(backend.allocator, [seq], [7])
            want = model.block_forward(
                model.block_input_ids(ids[b, s : s + 1]), backend.pools, blk
            )[0]
            backend.free(seq)
            torch.testing.assert_close(h[b, j], want, rtol=1e-4, atol=1e-4)


def test_teacher_forced_markov_inputs_and_labels_are_the_next_tokens():
    ids = torch.arange(10)[None] * 3
    batch = AnchorBatch(
        torch.zeros(1, 10, 4),
        ids,
        torch.tensor([9]),
        torch.tensor([[2, 6]]),
        torch.tensor([[True, True]]),
    )
    prev = markov_prev_ids(batch, 3)
    labels, ok = labels_and_valid(batch, 3)
    assert prev.tolist() == [[[6, 9, 12], [18, 21, 24]]]
    assert labels[0, 0].tolist() == [9, 12, 15]
    assert ok.tolist() == [[[True, True, True], [True, True, False]]]  # position 9 >= length 9
