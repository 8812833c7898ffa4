"""Model references: Hub ids resolved through huggingface_hub's own code, offline against a Hub
cache the tests write in its on-disk layout, online against a local stand-in of the Hub's HTTP
API (:class:`hub_fixtures.FakeHub`). Oracles: the cache's ``refs/main`` and snapshot folders,
the requests the server saw, and target-only decoding of the same checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from hub_fixtures import IDS, FakeHub, folder_files, publish

from edgebuild.checkpoint.hub import resolve_model_ref, split_ref
from edgebuild.cli import main
from edgebuild.errors import CheckpointError
from edgebuild.example import example_draft_dir

EDGEBUILD = [sys.executable, "-m", "edgebuild.cli"]


@pytest.fixture
def offline_hub(hub_cache, monkeypatch):
    """HF_HUB_CACHE at the session's Hub cache, offline."""
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache["cache"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_cache


def _snapshot(hub: dict, role: str) -> Path:
    repo = hub["cache"] / f"models--{IDS[role].replace('/', '--')}"
    return repo / "snapshots" / (repo / "refs" / "main").read_text()


# ---------------------------------------------------------------------- resolution
def test_an_id_resolves_to_its_snapshot_in_the_hub_cache_offline(offline_hub):
    src = resolve_model_ref(IDS["bf16"])
    assert src.path == _snapshot(offline_hub, "bf16")
    assert src.commit == offline_hub["commits"]["bf16"] and src.revision == "main"
    assert src.repo_id == IDS["bf16"] and src.display_name == IDS["bf16"]
    assert (src.path / "config.json").is_symlink()  # the Hub's layout: links into blobs/
    by_commit = resolve_model_ref(f"{IDS['bf16']}@{src.commit}")
    assert by_commit.path == src.path


def test_a_revision_picks_another_snapshot(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    main_commit = publish(cache, "org/draft", example_draft_dir())
    v1 = publish(cache, "org/draft", example_draft_dir(), revision="v1", commit="1" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert resolve_model_ref("org/draft").commit == main_commit
    assert resolve_model_ref("org/draft@v1").commit == v1 == "1" * 40
    assert resolve_model_ref("org/draft", "v1").path.name == v1
    with pytest.raises(CheckpointError, match="names revision 'v1' but --revision is 'v2'"):
        split_ref("org/draft@v1", "v2")


def test_a_local_folder_wins_over_an_id_of_the_same_spelling(tmp_path, monkeypatch):
    folder = tmp_path / "org" / "name"
    folder.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    src = resolve_model_ref("org/name")
    assert not src.is_hub and src.path == Path("org/name")


# ---------------------------------------------------------------------- the commands take ids
def test_inspect_takes_ids_for_target_and_draft(offline_hub):
    result = CliRunner().invoke(main, ["inspect", IDS["nvfp4"], "--draft", IDS["draft"], "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["model"] == f"{IDS['nvfp4']}@{offline_hub['commits']['nvfp4']}"
    assert report["target"]["quant_format"] == "NVFP4"
    assert report["draft"]["path"] == str(_snapshot(offline_hub, "draft"))


def test_run_compare_takes_ids_and_dspark_equals_target_only(offline_hub):
    spec = json.dumps({"method": "dspark", "model": IDS["draft"], "num_speculative_tokens": 7})
    args = ["run", IDS["bf16"], "--prompt", "The capital of France is", "--max-tokens", "16"]
    result = CliRunner().invoke(
        main, [*args, "--threads", "1", "--speculative-config", spec, "--compare", "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{") :])
    assert report["mode"] == "dspark" and report["identical_to_target_only"] == [True]
    assert report["metrics"]["generated_tokens"] == 16


def test_build_records_the_hub_commits_and_verify_checks_them(offline_hub, tmp_path):
    out = tmp_path / "bundle"
    result = CliRunner().invoke(
        main,
        ["build", IDS["bf16"], "--draft", IDS["draft"], "-o", str(out), "--onnx-only",
         "--no-progress", "--max-input-len", "64", "--max-kv-cache-capacity", "128"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    for role, key in (("target", "bf16"), ("draft", "draft")):
        hub = manifest["sources"][role]["hub"]
        assert hub == {
            "repo_id": IDS[key],
            "revision": "main",
            "commit": offline_hub["commits"][key],
        }
        assert manifest["sources"][role]["path"] == str(_snapshot(offline_hub, key))
    assert manifest["name"] == IDS["bf16"].replace("/", "--")
    ok = CliRunner().invoke(main, ["verify", str(out)])
    assert ok.exit_code == 0, ok.output
    # a manifest whose commit is not the snapshot it names is refused by verify
    manifest["sources"]["draft"]["hub"]["commit"] = "0" * 40
    (out / "manifest.json").write_text(json.dumps(manifest))
    bad = CliRunner().invoke(main, ["verify", str(out)])
    assert bad.exit_code == 2
    assert f"{IDS['draft']} was built from commit {'0' * 40}" in bad.output


# ---------------------------------------------------------------------- offline errors
def _cli_error(args: list[str], env: dict) -> tuple[int, str]:
    r = subprocess.run(
        [*EDGEBUILD, *args], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )
    return r.returncode, r.stdout + r.stderr


def test_offline_and_not_cached_names_the_id_the_cache_and_the_command(tmp_path):
    cache = tmp_path / "empty-hub"
    code, out = _cli_error(
        ["inspect", "org/not-there"], {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    )
    assert code == 2, out
    assert "error: model org/not-there@main is not in the Hub cache" in out
    assert str(cache) in out and "HF_HUB_OFFLINE is set" in out
    assert "hf download org/not-there" in out
    assert "Traceback" not in out


@pytest.mark.parametrize(
    "files, message",
    [
        ({"config.json": b"{}", "pytorch_model.bin": b"x"}, "has no safetensors weights (it has pytorch_model.bin)"),
        ({"config.json": b"{}", "model-q4.gguf": b"x"}, "has no safetensors weights (it has model-q4.gguf)"),
        ({"README.md": b"# a dataset card"}, "is not a model checkpoint: it has no config.json"),
        ({"config.json": b"{}", "tokenizer.json": b"{}"}, "has a config but no weights; download them"),
    ],
    ids=["bin-only", "gguf-only", "not-a-checkpoint", "incomplete-snapshot"],
)  # fmt: skip
def test_a_cached_repo_that_is_not_a_safetensors_checkpoint_is_refused(tmp_path, files, message):
    folder = tmp_path / "repo"
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    cache = tmp_path / "hub"
    publish(cache, "org/odd", folder)
    code, out = _cli_error(
        ["inspect", "org/odd"], {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    )
    assert code == 2, out
    assert message in out and "org/odd" in out
    assert "Traceback" not in out


# ---------------------------------------------------------------------- online (a local Hub)
@pytest.fixture(scope="module")
def fake_hub():
    hub = FakeHub()
    files = folder_files(example_draft_dir())
    files["pytorch_model.bin"] = b"pickled duplicate of the weights"
    files["onnx/model.safetensors"] = b"a subfolder edgebuild does not read"
    hub.add("org/draft", files)
    hub.add("org/gated", {"config.json": b"{}"}, gated=True)
    hub.add("org/private", {"config.json": b"{}"}, private=True)
    hub.add("org/binonly", {"config.json": b"{}", "pytorch_model.bin": b"x"})
    hub.add("org/notckpt", {"README.md": b"hi"})
    url = hub.start()
    yield hub, url
    hub.stop()


def _online(url: str, cache: Path, **env) -> dict:
    return {"HF_ENDPOINT": url, "HF_HUB_OFFLINE": "0", "HF_HUB_CACHE": str(cache), **env}


def test_online_download_fetches_only_what_edgebuild_reads_with_the_hubs_bars(fake_hub, tmp_path):
    hub, url = fake_hub
    hub.requests.clear()
    code, out = _cli_error(["inspect", "org/draft"], _online(url, tmp_path / "hub"))
    assert code == 0, out
    fetched = sorted(
        {p.rsplit("/", 1)[1] for m, p in hub.requests if m == "GET" and "/resolve/" in p}
    )
    # no .bin, README, PNG or onnx/; the draft's token map (speculative/token_map.py) is read
    assert fetched == ["config.json", "model.safetensors", "token_map.json"]
    assert "Fetching 1 files" in out  # huggingface_hub's own progress bar
    commit = hub.repos["org/draft"]["commit"]
    snapshot = tmp_path / "hub" / "models--org--draft" / "snapshots" / commit
    assert (snapshot / "model.safetensors").read_bytes() == (
        example_draft_dir() / "model.safetensors"
    ).read_bytes()
    # the filled cache then serves offline, as any other tool's cache would
    code, out = _cli_error(
        ["inspect", "org/draft"], {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    )
    assert code == 0 and f"org/draft@{commit}" in out, out


@pytest.mark.parametrize(
    "ref, env, message",
    [
        ("org/gated", {}, "the repo is gated: accept its licence at https://huggingface.co/org/gated"),
        ("org/private", {"HF_TOKEN": "hf_not_a_token"}, "unauthorised (401); set HF_TOKEN to a valid token"),
        ("org/missing", {}, "no such repo on the Hub, or it is private and no valid token was sent"),
        ("org/draft@no-such-branch", {}, "the repo has no revision 'no-such-branch'"),
        ("org/binonly", {}, "has no safetensors weights (it has pytorch_model.bin)"),
        ("org/notckpt", {}, "is not a model checkpoint: it has no config.json"),
    ],
    ids=["gated", "401", "unknown-id", "unknown-revision", "bin-only", "not-a-checkpoint"],
)  # fmt: skip
def test_online_errors_name_the_fix(fake_hub, tmp_path, ref, env, message):
    _, url = fake_hub
    code, out = _cli_error(["inspect", ref], _online(url, tmp_path / "hub", **env))
    assert code == 2, out
    assert message in out, out
    assert "Traceback" not in out


# ---------------------------------------------------------------------- the one-line deployment
def test_build_ids_into_the_engine_cache_twice_the_second_is_a_hit(offline_hub, tmp_path):
    args = ["build", IDS["nvfp4"], "--draft", IDS["draft"], "--cache-dir", str(tmp_path / "c"),
            "--onnx-only", "--no-progress", "--max-input-len", "64",
            "--max-kv-cache-capacity", "128"]  # fmt: skip
    first = CliRunner().invoke(main, args)
    second = CliRunner().invoke(main, args)
    assert first.exit_code == 0 and second.exit_code == 0, first.output + second.output
    assert "built: " in first.output and "cache hit" not in first.output
    assert "cache hit: " in second.output
    key = first.output.split("(key ")[1].split(",")[0]
    assert f"(key {key}," in second.output


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_seed_line_serves_the_pair_by_id_with_dspark(hub_cache, tmp_path):
    """``edgellm-serve ORG/TARGET --cache-dir DIR --speculative-config '{"model":"ORG/DRAFT"}'``
    as written, offline against the test Hub cache: the torch backend here (no TensorRT),
    /health 503 ``loading`` while it loads, /v1/models names the id, a chat answer with
    drafts accepted."""
    import time

    import httpx

    port = _free_port()
    spec = {"method": "dspark", "model": IDS["draft"], "num_speculative_tokens": 7}
    cmd = [sys.executable, "-m", "edgebuild.serve", IDS["nvfp4"],
           "--cache-dir", str(tmp_path / "cache"), "--speculative-config", json.dumps(spec),
           "--port", str(port), "--threads", "1"]  # fmt: skip
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache["cache"]), "HF_HUB_OFFLINE": "1"}
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url, statuses = f"http://127.0.0.1:{port}", []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                h = httpx.get(f"{url}/health", timeout=5)
            except httpx.TransportError:
                time.sleep(0.1)
                continue
            statuses.append((h.status_code, h.json().get("status")))
            if h.status_code == 200:
                break
            assert "retry-after" in h.headers
            time.sleep(0.2)
        assert statuses[-1] == (200, "ok"), statuses
        assert (503, "loading") in statuses  # the server listened while it loaded
        models = httpx.get(f"{url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [IDS["nvfp4"]]
        chat = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": IDS["nvfp4"], "max_tokens": 24, "temperature": 0,
                  "messages": [{"role": "user", "content": "What is the capital of France?"}]},
            timeout=300,
        )  # fmt: skip
        assert chat.status_code == 200, chat.text
        assert "Paris" in chat.json()["choices"][0]["message"]["content"]
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        accepted = [
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("edgellm_spec_decode_draft_accepted_total")
        ]
        assert sum(accepted) > 0, metrics
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
    text = (tmp_path / "serve.log").read_text()
    assert "backend: torch (no engines:" in text and "tensorrt Python module" in text


def test_no_network_with_the_model_cached_uses_the_snapshot(hub_cache, monkeypatch, caplog):
    """HF_HUB_OFFLINE unset and the Hub unreachable (a closed port): the cached snapshot is
    used, as huggingface_hub itself does, with a warning; never a traceback."""
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache["cache"]))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hc, "ENDPOINT", "http://127.0.0.1:9")
    with caplog.at_level("WARNING", logger="edgebuild"):
        src = resolve_model_ref(IDS["draft"])
    assert src.commit == hub_cache["commits"]["draft"]
    assert "cannot be reached" in caplog.text, caplog.text


@pytest.mark.parametrize("ref", ["org/名前", "org/name.", "org/-name", "org/x.git", "org/name@"])
def test_malformed_ids_are_refused_with_exit_2(ref, tmp_path):
    code, out = _cli_error(["inspect", ref], {"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert code == 2 and "Traceback" not in out, out
    assert "not a Hugging Face Hub id" in out or "empty revision" in out, out
