"""`open_torch_runtime` and `open_trt_runtime` return the same kind of runtime record, which
`LLM.__init__` takes as it comes (one path for both backends)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dspark_fixtures import make_random_draft
from serve_fixtures import write_tiny_chat_model

from edgebuild.bundle.manifest import resolve_model_path
from edgebuild.checkpoint.source import WeightSource
from edgebuild.errors import ConfigError
from edgebuild.runtime.decoding import DSparkDecoder, TargetOnlyDecoder
from edgebuild.runtime.llm import LLM, RuntimeOptions
from edgebuild.runtime.torch_backend import TorchRuntime, open_torch_runtime
from edgebuild.runtime.trt_backend import TrtRuntime
from edgebuild.speculative.config import SpeculativeConfig

OPTIONS = RuntimeOptions(max_kv_rows=512, page_size=8)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("open_runtime")
    target = write_tiny_chat_model(root / "target")
    draft = make_random_draft(root / "draft", target, block_size=4)
    spec = SpeculativeConfig.parse(
        {"method": "dspark", "model": str(draft), "num_speculative_tokens": 3}
    )
    return target, spec


def test_both_runtime_records_have_the_fields_and_methods_the_llm_reads():
    read = {"target", "draft", "config", "vision", "target_model"}
    for record in (TorchRuntime, TrtRuntime):
        assert read <= {f.name for f in dataclasses.fields(record)}
        assert callable(record.runtime_options) and callable(record.decoder)


def test_open_torch_runtime_loads_target_and_draft_with_the_dtype_resolved(pair):
    target, spec = pair
    rt = open_torch_runtime(resolve_model_path(target), spec, OPTIONS, WeightSource(target))
    assert rt.options.dtype == torch.float32 and OPTIONS.dtype is None  # the caller's is kept
    assert rt.runtime_options(OPTIONS) is rt.options
    assert rt.target.model is rt.target_model and rt.config is rt.target_model.config
    assert rt.draft is not None and rt.vision is None
    assert isinstance(rt.decoder(spec), DSparkDecoder)


def test_open_torch_runtime_without_a_spec_is_target_only(pair):
    target, _ = pair
    rt = open_torch_runtime(resolve_model_path(target), None, OPTIONS, WeightSource(target))
    assert rt.draft is None and isinstance(rt.decoder(None), TargetOnlyDecoder)


def test_llm_takes_the_torch_record_as_it_comes(pair):
    target, spec = pair
    llm = LLM(target, speculative=spec, options=OPTIONS)
    assert llm.options.dtype == torch.float32 and llm.options.max_kv_rows == 512
    assert llm.target.model is llm.target_model and isinstance(llm.decoder, DSparkDecoder)


def test_an_unsupported_quant_is_refused_before_loading(pair):
    target, _ = pair
    with pytest.raises(ConfigError, match="--quant 'int3' is not supported"):
        open_torch_runtime(
            resolve_model_path(target),
            None,
            dataclasses.replace(OPTIONS, quant="int3"),
            WeightSource(target),
        )
