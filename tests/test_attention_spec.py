"""`AttentionSpec`: the attention settings as one frozen record, whose attribute names are the
op's schema and the plugin contract's (neither changes with it)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import edgebuild.ops  # noqa: F401 (registers edgebuild::paged_attention)
from edgebuild.ops.attention import ATTRIBUTES, AttentionSpec
from tests.conftest import ROOT

SPEC = AttentionSpec(
    num_q_heads=4, num_kv_heads=2, head_dim=16, causal=True, write_kv=True, scale=0.25
)


def test_the_attribute_names_are_the_ops_keyword_only_arguments_in_schema_order():
    schema = torch.ops.edgebuild.paged_attention.default._schema
    kwarg_only = tuple(a.name for a in schema.arguments if a.kwarg_only)
    assert kwarg_only == ATTRIBUTES


def test_the_attribute_names_are_the_plugin_contracts_reference_kwargs():
    contract = json.loads((ROOT / "plugins" / "contract.json").read_text())
    kwargs = tuple(a["reference_kwarg"] for a in contract["attributes"] if a.get("reference_kwarg"))
    assert kwargs == ATTRIBUTES


def test_bind_takes_rotary_dim_and_page_size_from_the_tensors():
    table, cache = torch.zeros(64, 8), torch.zeros(3, 2, 2, 32, 16)
    attrs = SPEC.bind(table, cache).attributes()
    assert list(attrs) == list(ATTRIBUTES)
    assert attrs["rotary_dim"] == 8 and attrs["page_size"] == 32
    assert attrs["sliding_window"] == 0 and attrs["rms_norm_eps"] == 1e-6
    assert SPEC.rotary_dim is None  # frozen: bind returns a copy
    assert SPEC.replace(rotary_dim=4).bind(table, cache).rotary_dim == 4


def test_an_unbound_spec_has_no_attributes():
    with pytest.raises(ValueError, match="bind"):
        SPEC.attributes()


def test_from_attributes_round_trips_and_names_what_is_wrong():
    bound = SPEC.replace(rotary_dim=16, page_size=8)
    assert AttentionSpec.from_attributes(bound.attributes()) == bound
    with pytest.raises(ValueError, match=r"missing \['page_size'\], unknown \['pagesize'\]"):
        attrs = {**bound.attributes(), "pagesize": 8}
        del attrs["page_size"]
        AttentionSpec.from_attributes(attrs)


def test_the_record_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SPEC.causal = False  # type: ignore[misc]
