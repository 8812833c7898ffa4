"""The attention plugin contract is stated once in ``plugins/contract.json``; check its copies.

Owns the consistency checks between the contract file and
    (a) the TensorRT plugin source ``plugins/src/attention_plugin.cpp``: name, version,
        namespace, the input/output name tables and the PluginFieldCollection table
        (``kAttributeFields``), parsed from the C++ text so no TensorRT is needed;
    (b) the golden reference op ``edgebuild.ops.attention.paged_attention``: its tensor
        arguments (order, optional = defaults to None) and keyword attributes (names,
        required = no default, defaults, int/bool vs float);
    (c) the prose copies: ``plugins/README.md`` and the op's module docstring mention every
        input, attribute and output.
The exporter (another module) is checked against the same file.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

import edgebuild.ops.attention as attention_module
from edgebuild.ops.attention import paged_attention

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = json.loads((ROOT / "plugins" / "contract.json").read_text())
PLUGIN_SOURCE = (ROOT / "plugins" / "src" / "attention_plugin.cpp").read_text()

FIELD_TYPES = {"int": "INT32", "float": "FLOAT32"}
ANNOTATION_TYPES = {"int": "int", "bool": "int", "float": "float"}


def _cpp_string_table(name: str) -> list[str]:
    """The string literals of ``constexpr char const* NAME[] = {...};`` in the plugin source."""
    match = re.search(rf"{name}\[\]\s*=\s*\{{(.*?)\}};", PLUGIN_SOURCE, re.S)
    assert match, f"table {name} not found in attention_plugin.cpp"
    return re.findall(r'"([^"]*)"', match.group(1))


def _cpp_attribute_fields() -> list[tuple[str, str, bool]]:
    """(name, PluginFieldType suffix, required) of each kAttributeFields entry."""
    match = re.search(r"kAttributeFields\[\]\s*=\s*\{(.*?)\n\};", PLUGIN_SOURCE, re.S)
    assert match, "kAttributeFields not found in attention_plugin.cpp"
    entries = re.findall(r'\{"(\w+)",\s*PluginFieldType::k(\w+),\s*(true|false)', match.group(1))
    return [(name, kind, required == "true") for name, kind, required in entries]


def _cpp_constant(name: str) -> str:
    match = re.search(rf'{name}\[\]\s*=\s*"([^"]*)"', PLUGIN_SOURCE)
    assert match, f"constant {name} not found in attention_plugin.cpp"
    return match.group(1)


def test_plugin_source_declares_the_contract_name_version_and_namespace():
    plugin = CONTRACT["plugin"]
    assert _cpp_constant("kPluginName") == plugin["name"]
    assert _cpp_constant("kPluginVersion") == plugin["version"]
    assert _cpp_constant("kPluginNamespace") == plugin["namespace"]
    assert CONTRACT["onnx"]["op_type"] == plugin["name"]
    assert CONTRACT["onnx"]["node_attributes"] == {
        "plugin_version": plugin["version"],
        "plugin_namespace": plugin["namespace"],
    }


def test_plugin_source_inputs_and_outputs_follow_the_contract_order():
    assert _cpp_string_table("kInputNames") == [i["name"] for i in CONTRACT["inputs"]]
    assert _cpp_string_table("kOutputNames") == [o["name"] for o in CONTRACT["outputs"]]


def test_plugin_field_collection_matches_the_contract_attributes():
    fields = _cpp_attribute_fields()
    expected = [(a["name"], FIELD_TYPES[a["type"]], a["required"]) for a in CONTRACT["attributes"]]
    assert fields == expected


def test_optional_inputs_are_switched_by_existing_int_attributes():
    attributes = {a["name"]: a for a in CONTRACT["attributes"]}
    for spec in CONTRACT["inputs"]:
        if spec["optional"]:
            switch = attributes[spec["present_when"]]
            assert switch["type"] == "int" and switch["default"] == 0, spec["name"]
        else:
            assert "present_when" not in spec, spec["name"]


def test_present_kv_cache_aliases_kv_cache_in_contract_and_source():
    aliased = [o for o in CONTRACT["outputs"] if "aliases_input" in o]
    assert [(o["name"], o["aliases_input"]) for o in aliased] == [("present_kv_cache", "kv_cache")]
    assert re.search(r"outputIndex == 1 \? kKvCache : -1", PLUGIN_SOURCE)


def _reference_parameters() -> tuple[list[inspect.Parameter], list[inspect.Parameter]]:
    params = list(inspect.signature(paged_attention).parameters.values())
    tensors = [p for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    keywords = [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    return tensors, keywords


def test_reference_op_tensor_arguments_are_the_contract_inputs():
    tensors, _ = _reference_parameters()
    assert [p.name for p in tensors] == [i["name"] for i in CONTRACT["inputs"]]
    for param, spec in zip(tensors, CONTRACT["inputs"], strict=True):
        optional = param.default is None
        assert optional == spec["optional"], f"{param.name}: optional in op vs contract"


def test_reference_op_keyword_attributes_are_the_contract_attributes():
    _, keywords = _reference_parameters()
    by_kwarg = {a["reference_kwarg"]: a for a in CONTRACT["attributes"] if a["reference_kwarg"]}
    assert [p.name for p in keywords] == list(by_kwarg)
    for param in keywords:
        spec = by_kwarg[param.name]
        annotation = (
            param.annotation if isinstance(param.annotation, str) else param.annotation.__name__
        )
        assert ANNOTATION_TYPES[annotation] == spec["type"], param.name
        required = param.default is inspect.Parameter.empty
        assert required == spec["required"], f"{param.name}: required in op vs contract"
        if not required:
            assert param.default == pytest.approx(spec["default"]), param.name


def test_plugin_only_attributes_say_what_they_are_derived_from():
    for spec in CONTRACT["attributes"]:
        if spec["reference_kwarg"] is None:
            assert spec["derived_from"] and not spec["required"], spec["name"]


def test_readme_and_op_docstring_mention_every_contract_name():
    readme = (ROOT / "plugins" / "README.md").read_text()
    docstring = attention_module.__doc__ or ""
    names = [i["name"] for i in CONTRACT["inputs"]] + [o["name"] for o in CONTRACT["outputs"]]
    names += [a["name"] for a in CONTRACT["attributes"]]
    missing_readme = [n for n in names if f"`{n}`" not in readme]
    assert not missing_readme, f"plugins/README.md does not mention {missing_readme}"
    op_names = [i["name"] for i in CONTRACT["inputs"]] + [
        a["reference_kwarg"] for a in CONTRACT["attributes"] if a["reference_kwarg"]
    ]
    missing_doc = [n for n in op_names if n not in docstring]
    assert not missing_doc, f"edgebuild.ops.attention docstring does not mention {missing_doc}"
