"""The speculative-method registry: one record per method, and everything derives from it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from edgebuild.checkpoint.dspark_config import DSparkConfig
from edgebuild.errors import ConfigError
from edgebuild.speculative import config as spec_config
from edgebuild.speculative import registry
from edgebuild.speculative.registry import METHODS, SpeculativeMethod, get_method, method_names

ROOT = Path(__file__).resolve().parent.parent


def test_every_import_path_of_every_record_resolves():
    for method in METHODS.values():
        for field in ("config_parser", "torch_loader", "tensorrt_loader", "decoder"):
            assert callable(method.resolve(field)), (method.name, field)
    dspark = get_method("dspark")
    assert dspark.resolve("config_parser") is DSparkConfig
    assert dspark.bundle_role == "draft"
    with pytest.raises(ValueError, match="not an import-path field"):
        dspark.resolve("name")


def test_the_registry_module_imports_neither_runtime_nor_build():
    tree = ast.parse((ROOT / "edgebuild" / "speculative" / "registry.py").read_text())
    imported = {
        n.module if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    }
    assert imported <= {"__future__", "importlib", "dataclasses", "typing", "edgebuild.errors"}


def test_config_recipe_and_cli_choices_derive_from_the_registry(monkeypatch):
    assert spec_config.SUPPORTED_METHODS == {m.name: m.description for m in METHODS.values()}
    assert method_names() == tuple(METHODS) == ("dspark",)
    assert "dspark" in registry.speculative_help()
    with pytest.raises(ConfigError, match=r"unknown method 'eagle3' \(eagle3 is planned"):
        get_method("eagle3")
    with pytest.raises(ConfigError, match="recipe.yaml: unknown method 'x'; supported: dspark"):
        get_method("x", "recipe.yaml")
    # a second record is accepted by the recipe validation and named in the messages
    extra = SpeculativeMethod("toy", "a toy", *(["edgebuild.errors:ConfigError"] * 4))
    monkeypatch.setitem(METHODS, "toy", extra)
    assert method_names() == ("dspark", "toy")
    with pytest.raises(ConfigError, match="supported: dspark, toy"):
        get_method("nope")


def test_a_recipe_with_an_unknown_method_is_refused_naming_the_registrys_methods(tmp_path):
    from edgebuild.recipe import load_recipe

    (tmp_path / "t").mkdir()
    (tmp_path / "d").mkdir()
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: x\ntarget: {path: t}\ndraft: {path: d}\n"
        "speculative: {method: medusa, num_speculative_tokens: 3}\n"
        "build: {device: thor, precision: bf16}\n"
    )
    with pytest.raises(ConfigError, match="speculative.method.*'medusa'.*use one of dspark"):
        load_recipe(recipe)
