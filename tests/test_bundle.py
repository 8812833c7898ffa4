"""Bundles: reproducible builds, the manifest, ``verify``, corrupt bundles, and the runtime.

One tiny target (Qwen3, 2 layers, a word-level tokenizer) with a random DSpark draft is built
``--onnx-only`` once through the Python API and once through ``edgebuild build RECIPE``; the
two bundles must be byte-identical. Corrupted copies are refused by ``edgebuild verify`` and
by the runtime (``LLM(bundle)``), each with a message naming the problem.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from dspark_fixtures import make_random_draft
from export_fixtures import make_tiny_target, write_tiny_tokenizer

from edgebuild.bundle import FORMAT_VERSION, verify_bundle
from edgebuild.bundle.build import BuildOptions, build_bundle, recipe_from_flags
from edgebuild.cli import main
from edgebuild.errors import BundleError, PairingError
from edgebuild.runtime.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = json.loads((ROOT / "plugins" / "contract.json").read_text())
LIMITS = dict(max_input_len=64, max_kv_cache_capacity=128)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    target = make_tiny_target(root / "qwen3", "qwen3", num_hidden_layers=2)
    write_tiny_tokenizer(target, 256)
    draft = make_random_draft(root / "draft", target, num_layers=1, block_size=4)
    return target, draft


@pytest.fixture(scope="module")
def bundle(pair, tmp_path_factory) -> Path:
    target, draft = pair
    out = tmp_path_factory.mktemp("bundles") / "tiny"
    recipe = recipe_from_flags(target, draft, **LIMITS)
    build_bundle(recipe, out, BuildOptions(onnx_only=True, progress=False))
    return out


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_building_the_same_inputs_twice_gives_byte_identical_onnx_and_manifest(
    pair, bundle, tmp_path
):
    target, draft = pair
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(
        f"name: {target.name}\ntarget: {{path: {target}}}\ndraft: {{path: {draft}}}\n"
        "speculative: {method: dspark, num_speculative_tokens: 4}\n"
        "build: {device: thor, precision: bf16, max_input_len: 64, max_kv_cache_capacity: 128}\n"
    )
    result = CliRunner().invoke(
        main, ["build", str(recipe), "-o", str(tmp_path / "again"), "--onnx-only", "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    assert "engines: not built: --onnx-only" in result.output
    first, second = _files(bundle), _files(tmp_path / "again")
    assert sorted(first) == sorted(second)
    assert [k for k in first if first[k] != second[k]] == []


def test_the_manifest_records_sources_roles_plugin_tokenizer_and_dspark_fields(pair, bundle):
    target, draft = pair
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["format"] == "edgebuild-bundle" and m["format_version"] == FORMAT_VERSION
    weights = (target / "model.safetensors").read_bytes()
    source = m["sources"]["target"]
    assert source["path"] == str(target.resolve())
    assert source["files"]["model.safetensors"]["sha256"] == hashlib.sha256(weights).hexdigest()
    assert set(source["files"]) == {"config.json", "model.safetensors"}
    assert m["sources"]["draft"]["path"] == str(draft.resolve())
    assert m["plugin"]["name"] == CONTRACT["plugin"]["name"]
    assert m["plugin"]["version"] == CONTRACT["plugin"]["version"]
    assert m["plugin"]["library"] == CONTRACT["plugin"]["library"]
    assert m["build"]["max_kv_cache_capacity"] == 128 and m["build"]["device"] == "thor"
    assert m["speculative"]["num_speculative_tokens"] == 4
    d = m["dspark"]
    assert d["block_size"] == 4 and d["target_layer_ids"] == [0]
    assert d["mask_token_id"] == 255 and d["markov_rank"] == 8
    assert d["markov_head_type"] == "vanilla" and d["enable_confidence_head"] is True
    assert d["lm_head_source"] == "target" and d["embed_tokens_source"] == "target"
    base, dr = m["roles"]["base"], m["roles"]["draft"]
    assert base["onnx"] == "base/model.onnx" and base["tap_layers"] == [0]
    assert dr["weight_sources"]["lm_head.weight"]["checkpoint_source"] == "target"
    assert [i["name"] for i in dr["inputs"]][:2] == ["context_features", "context_positions"]
    assert m["tokenizer"] == ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
    assert (bundle / "tokenizer.json").read_bytes() == (target / "tokenizer.json").read_bytes()
    for rel in ("base/model.onnx", "base/model.onnx.data", "draft/config.json", "tokenizer.json"):
        assert m["files"][rel]["size"] == (bundle / rel).stat().st_size
    assert m["engines"]["status"] == "not built: --onnx-only"


def test_the_draft_graph_reads_the_targets_embedding_and_head_from_one_shared_file(pair, bundle):
    """Issue 27: the borrowed tensors are stored once, in base/shared.onnx.data, which both
    graphs name at the same offsets; the draft's own data file holds no copy of them."""
    import onnx

    target, _ = pair
    m = json.loads((bundle / "manifest.json").read_text())
    base, dr = m["roles"]["base"], m["roles"]["draft"]
    assert base["onnx_shared_data"] == dr["onnx_shared_data"] == "base/shared.onnx.data"
    assert dr["onnx"] == "base/draft.onnx" and dr["config"] == "draft/config.json"
    assert sorted(dr["shared_initializers"]) == ["embed_tokens.weight", "lm_head.weight"]
    assert sorted(base["shared_initializers"]) == ["lm_head.weight", "model.embed_tokens.weight"]

    def external(path):
        model = onnx.load(str(bundle / path), load_external_data=False)
        return {i.name: {e.key: e.value for e in i.external_data} for i in model.graph.initializer}

    b, d = external(base["onnx"]), external(dr["onnx"])
    for draft_name, base_name in (
        ("embed_tokens.weight", "model.embed_tokens.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ):
        assert d[draft_name] == b[base_name]  # same file, offset, length
        assert d[draft_name]["location"] == "shared.onnx.data"
    tcfg = json.loads((target / "config.json").read_text())
    vocab_hidden = tcfg["vocab_size"] * tcfg["hidden_size"] * 2  # build.precision bf16
    shared = m["files"]["base/shared.onnx.data"]["size"]
    assert 2 * vocab_hidden <= shared < 2 * vocab_hidden + 8192
    # the plan states the bytes not copied: head + embedding as stored (fp32 checkpoint)
    assert m["dspark"]["shared_bytes"] == 2 * 2 * vocab_hidden
    own = {n: int(e["length"]) for n, e in d.items() if e.get("location") == "draft.onnx.data"}
    data = m["files"]["base/draft.onnx.data"]["size"]
    assert sum(own.values()) <= data <= sum(own.values()) + 4096 * len(own)  # no other bytes
    assert vocab_hidden not in own.values()  # no copy of the embedding / head


def test_verify_accepts_the_fresh_bundle(bundle):
    result = CliRunner().invoke(main, ["verify", str(bundle)])
    assert result.exit_code == 0, result.output
    assert "ok:" in result.output and "sources draft, target unchanged" in result.output


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _corrupt(kind: str, root: Path, pair: tuple[Path, Path]) -> str:
    """Damage the bundle copy at ``root``; returns a regex the error must match."""
    if kind == "changed-byte":
        _flip_byte(root / "base" / "model.onnx.data")
        return r"base/model\.onnx\.data: sha256 .* changed after the build"
    if kind == "missing-file":
        (root / "base" / "draft.onnx").unlink()
        return r"base/draft\.onnx: missing from the bundle"
    if kind == "changed-shared-byte":  # the target tensors both graphs read
        _flip_byte(root / "base" / "shared.onnx.data")
        return r"base/shared\.onnx\.data: sha256 .* changed after the build"
    if kind == "unlisted-file":  # e.g. an engine copied in from another build
        (root / "base" / "model.engine").write_bytes(b"not from this build")
        return r"base/model\.engine: not listed in manifest\.json"
    manifest = json.loads((root / "manifest.json").read_text())
    if kind == "format-version":
        manifest["format_version"] = FORMAT_VERSION + 1
        (root / "manifest.json").write_text(json.dumps(manifest))
        return r"format_version is 2 but this edgebuild reads version 1"
    # source-changed: the manifest names a copy of the target whose weights then change
    copy = root.parent / "target-copy"
    shutil.copytree(pair[0], copy)
    manifest["sources"]["target"]["path"] = str(copy)
    (root / "manifest.json").write_text(json.dumps(manifest))
    _flip_byte(copy / "model.safetensors")
    return r"sources\.target: .*model\.safetensors changed since the bundle was built"


@pytest.mark.parametrize(
    "kind",
    [
        "changed-byte",
        "changed-shared-byte",
        "missing-file",
        "unlisted-file",
        "format-version",
        "source-changed",
    ],
)
def test_corrupt_bundles_are_refused_by_verify_and_by_the_runtime(kind, bundle, pair, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    pattern = _corrupt(kind, copy, pair)
    with pytest.raises(BundleError, match=pattern):
        verify_bundle(copy)
    result = CliRunner().invoke(main, ["verify", str(copy)])
    assert result.exit_code == 2 and result.output.startswith("error: ")
    from edgebuild.runtime.llm import LLM, RuntimeOptions

    with pytest.raises(BundleError, match=pattern):
        LLM(copy, options=RuntimeOptions(max_kv_rows=256))


def test_the_runtime_runs_a_bundle_with_its_draft_losslessly(bundle, pair):
    from edgebuild.runtime.llm import LLM, RuntimeOptions

    options = RuntimeOptions(max_kv_rows=512, page_size=8)
    llm = LLM(bundle, options=options)
    assert llm.bundle == bundle and llm.model_dir == pair[0].resolve()
    assert llm.speculative is not None and llm.speculative.model == pair[1].resolve()
    assert llm.speculative.num_speculative_tokens == 4 and llm.draft is not None
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = [[5, 9, 17, 33, 65, 129]]
    with torch.no_grad():
        drafted = llm.generate_ids(prompt, params)[0].output_ids
        plain = LLM(pair[0], options=options).generate_ids(prompt, params)[0].output_ids
    assert drafted == plain and len(drafted) == 12


def test_edgebuild_run_on_a_bundle_decodes_with_the_bundles_draft(bundle):
    args = ["run", str(bundle), "--prompt", "t5 t9 t17", "--max-tokens", "6", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{") :])
    assert report["mode"] == "dspark" and report["metrics"]["generated_tokens"] == 6


def test_an_interrupted_build_leaves_nothing_that_passes_as_a_bundle(pair, tmp_path, monkeypatch):
    import edgebuild.export as export

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "export_draft", interrupted)
    recipe = recipe_from_flags(*pair, **LIMITS)
    with pytest.raises(KeyboardInterrupt):
        build_bundle(recipe, tmp_path / "out", BuildOptions(onnx_only=True, progress=False))
    assert list(tmp_path.iterdir()) == []  # no output, no partial directory
    (tmp_path / "half").mkdir()  # what a killed build could leave: files but no manifest
    (tmp_path / "half" / "base").mkdir()
    with pytest.raises(BundleError, match="no manifest.json; this is not a finished bundle"):
        verify_bundle(tmp_path / "half")


def test_a_draft_for_another_target_fails_before_any_export(pair, tmp_path, monkeypatch):
    other = make_tiny_target(tmp_path / "other", "qwen3", hidden_size=32, num_hidden_layers=2)
    wrong = make_random_draft(tmp_path / "wrong", other, num_layers=1, block_size=4)
    import edgebuild.export as export

    def must_not_run(*args, **kwargs):
        raise AssertionError("export started before validation finished")

    monkeypatch.setattr(export, "export_base", must_not_run)
    recipe = recipe_from_flags(pair[0], wrong, **LIMITS)
    with pytest.raises(PairingError, match="hidden_size 32 .* != target hidden_size 64"):
        build_bundle(recipe, tmp_path / "out", BuildOptions(onnx_only=True, progress=False))
    assert not (tmp_path / "out").exists()


def test_an_existing_output_is_only_replaced_with_force(bundle, pair, tmp_path):
    target = pair[0]
    recipe = recipe_from_flags(target, None, **LIMITS)
    (tmp_path / "out").mkdir()
    with pytest.raises(BundleError, match="exists; pass --force"):
        build_bundle(recipe, tmp_path / "out", BuildOptions(onnx_only=True, progress=False))


def test_a_build_removes_the_staging_folders_of_killed_builds_only(pair, tmp_path, caplog):
    """A SIGKILLed build cannot remove its `.NAME.partial-PID`; verify reports it, the next
    build of NAME removes it."""
    import subprocess
    import sys

    recipe = recipe_from_flags(pair[0], None, **LIMITS)
    out = tmp_path / "out"
    build_bundle(recipe, out, BuildOptions(onnx_only=True, progress=False))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid no longer runs
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        leftovers = {
            "killed": tmp_path / f".out.partial-{dead.pid}",
            "killed-old": tmp_path / f".out.old-{dead.pid}",
            "running": tmp_path / f".out.partial-{alive.pid}",
            "other-output": tmp_path / f".other.partial-{dead.pid}",
        }
        for path in leftovers.values():
            (path / "base").mkdir(parents=True)
            (path / "base" / "model.onnx.data").write_bytes(b"x" * 100)
        verified = CliRunner().invoke(main, ["verify", str(out)])
        assert verified.exit_code == 0, verified.output
        assert f"note: {leftovers['killed']} was left by an interrupted build" in verified.stderr
        assert str(leftovers["running"]) not in verified.stderr
        with caplog.at_level("WARNING", logger="edgebuild.bundle"):
            build_bundle(recipe, out, BuildOptions(onnx_only=True, progress=False, force=True))
        assert not leftovers["killed"].exists() and not leftovers["killed-old"].exists()
        assert leftovers["running"].is_dir()  # a build still in progress keeps its folder
        assert leftovers["other-output"].is_dir()  # another output's folders are not ours
        assert str(leftovers["killed"]) in caplog.text and "interrupted build" in caplog.text
        verify_bundle(out)
    finally:
        alive.kill()
        alive.wait()


def test_inspect_on_a_bundle_reports_its_manifest(bundle, pair):
    """`edgebuild inspect BUNDLE` reads the manifest (oracle: the manifest's own fields)
    instead of failing on a missing config.json; --draft with a bundle is refused by name."""
    m = json.loads((bundle / "manifest.json").read_text())
    result = CliRunner().invoke(main, ["inspect", str(bundle), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert set(report["roles"]) == set(m["roles"]) == {"base", "draft"}
    assert report["roles"]["base"].startswith(m["roles"]["base"]["graph_kind"])
    assert report["sources"] == {k: v["path"] for k, v in m["sources"].items()}
    assert report["limits"]["max_kv_cache_capacity"] == 128
    assert report["dspark_kv_cache"] == m["dspark"]["kv_cache"]
    assert report["engines"] == "not built: --onnx-only"
    text = CliRunner().invoke(main, ["inspect", str(bundle)])
    assert text.exit_code == 0 and "max_kv_cache_capacity" in text.output, text.output
    refused = CliRunner().invoke(main, ["inspect", str(bundle), "--draft", str(pair[1])])
    assert refused.exit_code == 2 and "--draft" in refused.output, refused.output


def test_a_build_into_an_unwritable_folder_names_the_output(pair, tmp_path):
    """-o under a regular file (like /proc/x): a clear error naming the output, rc 2."""
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "x"
    args = ["build", str(pair[0]), "-o", str(out), "--onnx-only"]
    args += ["--max-input-len", "64", "--max-kv-cache-capacity", "128"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert f"cannot write the output {out}" in result.output
    assert not out.exists()
