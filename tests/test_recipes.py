"""Recipes: the shipped ones validate; bad ones fail naming the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from edgebuild.errors import ConfigError
from edgebuild.recipe import Device, Precision, load_recipe

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))

GOOD = {
    "name": "t",
    "target": {"path": "target"},
    "draft": {"path": "draft"},
    "speculative": {"method": "dspark", "num_speculative_tokens": 7},
    "build": {
        "device": "thor",
        "precision": "nvfp4",
        "max_batch_size": 1,
        "max_input_len": 1024,
        "max_kv_cache_capacity": 2048,
        "page_size": 32,
    },
}


def write(tmp_path: Path, data: dict, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def changed(path: str, value) -> dict:
    """GOOD with one dotted field replaced (value None = removed)."""
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    *parents, leaf = path.split(".")
    node = data
    for p in parents:
        node = node[p]
    if value is None:
        del node[leaf]
    else:
        node[leaf] = value
    return data


def test_the_three_shipped_recipes_are_there():
    names = {p.name for p in RECIPES}
    assert {
        "smollm2-135m-dspark.yaml",
        "smollm2-135m-nvfp4-dspark.yaml",
        "qwen3.8-27b-nvfp4-dspark-thor.yaml",
    } <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_each_shipped_recipe_validates(path):
    recipe = load_recipe(path)
    assert recipe.speculative_config()["method"] == "dspark"


def test_production_recipe_validates_without_its_weights():
    recipe = load_recipe(ROOT / "recipes" / "qwen3.8-27b-nvfp4-dspark-thor.yaml")
    assert not recipe._local_path(recipe.target).exists()  # nothing resolved or fetched
    assert recipe.target.repo == "RadixArk/Qwen3.8-27B-NVFP4"
    assert recipe.speculative_config()["model"] == "RadixArk/Qwen3.8-27B-DSpark"
    b = recipe.build
    assert (b.device, b.precision) == (Device.THOR, Precision.NVFP4)
    assert (b.max_batch_size, b.max_input_len, b.max_kv_cache_capacity) == (4, 32768, 65536)
    assert recipe.speculative.num_speculative_tokens == 7
    assert recipe.draft.repo == "RadixArk/Qwen3.8-27B-DSpark"


def test_example_recipe_paths_resolve_against_the_project_root():
    recipe = load_recipe(ROOT / "recipes" / "smollm2-135m-dspark.yaml")
    assert recipe.resolve(recipe.draft) == ROOT / "edgebuild" / "data" / "smollm2-135m-dspark"
    assert recipe.resolve(recipe.target) == ROOT / "examples" / "smollm2-135m"


def test_paths_next_to_the_recipe_win(tmp_path):
    (tmp_path / "target").mkdir()
    recipe = load_recipe(write(tmp_path, GOOD))
    assert recipe.resolve(recipe.target) == tmp_path / "target"


def test_orin_with_nvfp4_is_refused_with_the_reason(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_recipe(write(tmp_path, changed("build.device", "orin")))
    msg = str(err.value)
    assert "build.precision" in msg and "sm_87" in msg and "FP4" in msg
    assert "thor" in msg and "bf16" in msg  # the fix


def test_orin_with_fp8_is_refused_too(tmp_path):
    data = changed("build.device", "orin")
    data["build"]["precision"] = "fp8"
    with pytest.raises(ConfigError, match=r"build\.precision.*FP8"):
        load_recipe(write(tmp_path, data))


@pytest.mark.parametrize(
    ("field", "value", "pattern"),
    [
        ("build.devce", "thor", r"'build\.devce' is not a recipe key"),
        ("tuning", 1, r"'tuning' is not a recipe key"),
        ("build.device", "xavier", r"'build\.device'.*thor.*orin"),
        ("build.precision", "int4", r"'build\.precision'"),
        ("build.max_batch_size", "four", r"'build\.max_batch_size'"),
        ("build.max_batch_size", 0, r"'build\.max_batch_size' is 0.*positive"),
        ("build.page_size", 48, r"'build\.page_size' is 48.*power of two"),
        ("build.max_kv_cache_capacity", 1024, r"max_kv_cache_capacity' is 1024.*at least 1032"),
        ("build.max_kv_cache_capacity", 2050, r"not a multiple of build\.page_size.*2080"),
        ("build.max_images", 0, r"'build\.max_images' is 0; fix: use a positive integer"),
        ("build.max_image_tokens", -4, r"'build\.max_image_tokens' is -4.*positive"),
        ("build.max_images", 2000, r"'build\.max_images' is 2000, more than .*1024.*at most 1024"),
        ("speculative.method", "eagle9", r"'speculative\.method' is 'eagle9'.*dspark"),
        ("speculative.num_speculative_tokens", 0, r"num_speculative_tokens' is 0.*1\.\.16"),
        ("speculative.num_speculative_tokens", 40, r"num_speculative_tokens' is 40"),
        ("speculative.draft_top_k", -1, r"draft_top_k' is -1"),
        ("speculative.confidence_threshold", 1.5, r"confidence_threshold' is 1\.5.*\[0, 1\)"),
        ("build.device", None, r"'build\.device' is required"),
        ("target", None, r"'target' is required"),
    ],
)
def test_bad_recipes_fail_naming_the_field(tmp_path, field, value, pattern):
    data = changed(field, value) if "." in field or value is None else {**GOOD, field: value}
    if field == "build.devce":
        data["build"]["devce"] = value
    with pytest.raises(ConfigError, match=pattern):
        load_recipe(write(tmp_path, data))


def test_a_draft_without_speculative_settings_is_refused(tmp_path):
    data = {k: v for k, v in GOOD.items() if k != "speculative"}
    with pytest.raises(ConfigError, match=r"'draft' is set without speculative settings"):
        load_recipe(write(tmp_path, data))


def test_not_a_mapping_and_missing_file(tmp_path):
    bad = tmp_path / "list.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="YAML mapping"):
        load_recipe(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_recipe(tmp_path / "nope.yaml")
