"""One draft plan: `pair_draft` opens, reads and validates a draft and its target once.

Oracles: counters on ``WeightSource.__init__`` (each checkpoint opened once) and
``DSparkConfig.validate`` (the pair validated once) around ``edgebuild run CKPT
--speculative-config ...`` on the shipped example pair; the plan's tensors against the
checkpoint files.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from edgebuild.checkpoint.draft import pair_draft
from edgebuild.checkpoint.dspark_config import DSparkConfig
from edgebuild.checkpoint.source import COMPONENT, TARGET, WeightSource
from edgebuild.cli import main
from edgebuild.example import example_draft_dir
from edgebuild.models.dspark import DSparkDraft, check_draft

DRAFT = example_draft_dir()


@pytest.fixture
def counters(monkeypatch):
    """{"opens": Counter(resolved path), "validations": [n]} while the test runs."""
    opens: collections.Counter = collections.Counter()
    validations = [0]
    init, validate = WeightSource.__init__, DSparkConfig.validate

    def counting_init(self, path, *args, **kwargs):
        opens[str(Path(path).resolve())] += 1
        init(self, path, *args, **kwargs)

    def counting_validate(self, *args, **kwargs):
        validations[0] += 1
        return validate(self, *args, **kwargs)

    monkeypatch.setattr(WeightSource, "__init__", counting_init)
    monkeypatch.setattr(DSparkConfig, "validate", counting_validate)
    return {"opens": opens, "validations": validations}


def test_run_with_a_draft_opens_each_checkpoint_once_and_validates_the_pair_once(
    smollm2_dir, counters
):
    spec = {"method": "dspark", "model": str(DRAFT), "num_speculative_tokens": 3}
    args = ["run", str(smollm2_dir), "--prompt", "Hi", "--max-tokens", "3", "--json"]
    args += ["--speculative-config", json.dumps(spec), "--backend", "torch", "--threads", "1"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{") :])
    assert report["mode"] == "dspark" and report["metrics"]["generated_tokens"] == 3
    assert dict(counters["opens"]) == {
        str(Path(smollm2_dir).resolve()): 1,
        str(DRAFT.resolve()): 1,
    }
    assert counters["validations"] == [1]


def test_the_plan_holds_the_validated_config_and_the_resolved_head_and_embedding(smollm2_dir):
    target = WeightSource(smollm2_dir)  # opened by the runtime as its component
    plan = pair_draft(target, DRAFT)
    assert plan.target.checkpoint_source == TARGET and plan.draft.checkpoint_source == COMPONENT
    assert plan.target.path == target.path and target.checkpoint_source == COMPONENT
    assert plan.config.block_size == 7 and plan.config.packaging.value == "DSparkDraftModel"
    assert plan.provenance() == {"lm_head": TARGET, "embed_tokens": TARGET}  # tied target
    assert plan.lm_head.name == plan.embed_tokens.name == "model.embed_tokens.weight"
    assert torch.equal(plan.lm_head.value, target.get("model.embed_tokens.weight"))
    assert plan.names["fc.weight"] in plan.draft
    same = check_draft(plan.pair, plan.target_config)  # the checks pair_draft ran
    assert same.config == plan.config and same.lm_head.name == plan.lm_head.name


def test_a_draft_loaded_from_the_plan_equals_one_loaded_from_its_source(smollm2_dir):
    plan = pair_draft(smollm2_dir, DRAFT)
    a = DSparkDraft.from_plan(plan, torch.float32)
    b = DSparkDraft.from_source(
        plan.draft,
        plan.target_config,
        plan.lm_head.value,
        plan.embed_tokens.value,
        torch.float32,
    )
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


def test_a_retagged_source_shares_the_read_headers(smollm2_dir, counters):
    source = WeightSource(smollm2_dir)
    view = source.as_source(TARGET)
    assert sum(counters["opens"].values()) == 1  # the view re-read nothing
    assert view.names() == source.names() and view.config is source.config
    name = view.names()[0]
    assert view.info(name).checkpoint_source == TARGET
    assert source.info(name).checkpoint_source == COMPONENT
    with pytest.raises(ValueError, match="checkpoint_source"):
        source.as_source("draft")
