"""The engine cache (edgebuild.bundle.cache): built once, reused, refused when tampered with,
one build for two concurrent starts, nothing left by a killed build, and the server that
says ``building`` while it builds.

``--onnx-only`` builds stand in for TensorRT (the cache logic is the same: the key names the
builder and its version). The oracle of "built once" is the number of ``build_bundle`` calls,
or in a subprocess the ``built:`` / ``cache hit:`` lines; a rebuild is asserted by a new
entry, not by timing.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from dspark_fixtures import make_random_draft
from export_fixtures import make_tiny_target, write_tiny_tokenizer
from hub_fixtures import publish

import edgebuild.bundle.build as build_module
from edgebuild.bundle.build import BuildOptions, recipe_from_flags
from edgebuild.bundle.cache import EngineCache, build_cached, parse_age, parse_size
from edgebuild.checkpoint.hub import resolve_model_ref
from edgebuild.cli import main
from edgebuild.errors import ConfigError

LIMITS = dict(max_input_len=64, max_kv_cache_capacity=128)
ONNX = BuildOptions(onnx_only=True, progress=False)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    target = make_tiny_target(root / "qwen3", "qwen3", num_hidden_layers=2)
    write_tiny_tokenizer(target, 256)
    draft = make_random_draft(root / "draft", target, num_layers=1, block_size=4)
    return target, draft


@pytest.fixture
def builds(monkeypatch) -> list[Path]:
    """Every build_bundle call's output folder, in order (the real build still runs)."""
    calls: list[Path] = []
    real = build_module.build_bundle

    def counting(recipe, out, options, sources=None):
        calls.append(Path(out))
        return real(recipe, out, options, sources)

    monkeypatch.setattr(build_module, "build_bundle", counting)
    return calls


def _cached(pair, cache, **limits):
    target, draft = pair
    recipe = recipe_from_flags(target, draft, **{**LIMITS, **limits})
    return build_cached(recipe, ONNX, cache)


def test_a_second_build_is_a_hit_and_reads_no_build(pair, tmp_path, builds):
    cache = EngineCache(tmp_path / "cache")
    first = _cached(pair, cache)
    second = _cached(pair, cache)
    assert (first.hit, second.hit) == (False, True)
    assert second.path == first.path and len(builds) == 1
    (entry,) = cache.entries()
    assert entry["key"] == first.key and entry["status"] == "ok"
    assert entry["last_used"] >= entry["created"]


def test_a_changed_build_flag_or_source_builds_a_new_entry(pair, tmp_path, builds):
    cache = EngineCache(tmp_path / "cache")
    base = _cached(pair, cache)
    flag = _cached(pair, cache, max_input_len=32)
    assert not flag.hit and flag.key != base.key
    target, _ = pair
    config = target / "config.json"
    before, st = config.read_text(), config.stat()
    try:  # the local fingerprint covers small files' contents and every file's size/mtime
        config.write_text(before.replace("}", ', "edgebuild_test_marker": 1}', 1))
        changed = _cached(pair, cache)
    finally:  # the same bytes and mtime again: the same fingerprint
        config.write_text(before)
        os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert not changed.hit and changed.key not in {base.key, flag.key}
    assert _cached(pair, cache).key == base.key  # the original entry is still a hit
    assert len(builds) == 3
    assert sorted(e["key"] for e in cache.entries()) == sorted({base.key, flag.key, changed.key})


def test_a_new_hub_revision_builds_a_new_entry(pair, tmp_path, monkeypatch, builds):
    hub = tmp_path / "hub"
    target, draft = pair
    c1 = publish(hub, "edgebuild-test/tiny", target, revision="main", commit="a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = EngineCache(tmp_path / "cache")

    def via_hub():
        src = resolve_model_ref("edgebuild-test/tiny")
        recipe = recipe_from_flags(src.path, draft, **LIMITS)
        sources = {"target": src, "draft": resolve_model_ref(str(draft))}
        return src, build_cached(recipe, ONNX, cache, sources)

    src1, first = via_hub()
    assert src1.commit == c1
    c2 = publish(hub, "edgebuild-test/tiny", target, revision="main", commit="b" * 40)
    src2, second = via_hub()
    assert src2.commit == c2 and not second.hit and second.key != first.key
    assert json.loads(cache.record_path(second.key).read_text())["material"]["sources"][
        "target"
    ] == {"repo_id": "edgebuild-test/tiny", "commit": c2}
    assert len(builds) == 2


def _tamper_weights(entry: Path) -> str:
    data = next(entry.rglob("*.onnx.data"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    return data.relative_to(entry).as_posix()


def _tamper_small_file_keeping_its_stamp(entry: Path) -> str:
    manifest = json.loads((entry / "manifest.json").read_text())
    rel = next(r for r, rec in manifest["files"].items() if 0 < rec["size"] <= 4096)
    path = entry / rel
    st = path.stat()
    raw = bytearray(path.read_bytes())
    raw[0] ^= 0x01
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime
    return rel


def _add_unlisted(entry: Path) -> str:
    (entry / "base" / "extra.bin").write_bytes(b"not from the build")
    return "base/extra.bin"


@pytest.mark.parametrize(
    "tamper, expected",
    [
        (_tamper_weights, "changed after the entry was built"),
        (_tamper_small_file_keeping_its_stamp, "sha256 differs from the manifest"),
        (_add_unlisted, "extra.bin"),
    ],
    ids=["weights", "small-file-same-stamp", "unlisted-file"],
)
def test_a_tampered_entry_is_refused_logged_and_rebuilt(
    pair, tmp_path, builds, tamper, expected, caplog
):
    cache = EngineCache(tmp_path / "cache")
    first = _cached(pair, cache)
    rel = tamper(first.path)
    assert any(expected in p for p in cache.check(first.key)), cache.check(first.key)
    events = []
    target, draft = pair
    recipe = recipe_from_flags(target, draft, **LIMITS)
    with caplog.at_level("WARNING", logger="edgebuild"):
        again = build_cached(recipe, ONNX, cache, on_event=lambda k, i: events.append((k, i)))
    assert not again.hit and again.key == first.key and len(builds) == 2
    refused = [i for k, i in events if k == "refused"]
    assert refused and any(rel in p or expected in p for p in refused[0]["problems"])
    assert f"refusing entry {first.key}" in caplog.text
    assert cache.check(first.key) == []  # the rebuilt entry is good ...
    assert _cached(pair, cache).hit  # ... and reused
    from edgebuild.bundle.manifest import verify_bundle

    verify_bundle(again.path, check_sources=True)


def _build_cmd(pair, cache: Path, *extra: str) -> list[str]:
    target, draft = pair
    return [
        sys.executable, "-m", "edgebuild.cli", "build", str(target), "--draft", str(draft),
        "--onnx-only", "--no-progress", "--max-input-len", "64",
        "--max-kv-cache-capacity", "128", "--cache-dir", str(cache), *extra,
    ]  # fmt: skip


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def test_two_concurrent_builds_build_once_and_the_second_waits(pair, tmp_path):
    cache = tmp_path / "cache"
    procs = [
        subprocess.Popen(
            _build_cmd(pair, cache),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_env(),
        )  # fmt: skip
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    built = [o for o in outs if "\nbuilt: " in "\n" + o]
    hits = [o for o in outs if "cache hit: " in o]
    assert len(built) == 1 and len(hits) == 1, outs
    # the loser either waited on the lock or came after the winner had committed
    entries = EngineCache(cache).entries()
    assert len(entries) == 1 and entries[0]["status"] == "ok"


def test_kill_9_during_a_build_leaves_nothing_that_passes_as_a_hit(pair, tmp_path):
    cache = tmp_path / "cache"
    bundles = cache / "bundles"
    proc = subprocess.Popen(
        _build_cmd(pair, cache), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env()
    )
    deadline = time.monotonic() + 300
    staged = []
    while not staged and proc.poll() is None and time.monotonic() < deadline:
        staged = list(bundles.glob(".*.partial-*")) if bundles.is_dir() else []
        time.sleep(0.01)
    if not staged:
        proc.kill()
        pytest.fail("never saw the staging folder of the build (it finished too fast?)")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    store = EngineCache(cache)
    assert all(e["status"] != "ok" for e in store.entries())  # nothing counts as a hit
    out = subprocess.run(
        _build_cmd(pair, cache), capture_output=True, text=True, env=_env(), timeout=600
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "built: " in out.stdout and "cache hit" not in out.stdout
    (entry,) = [e for e in store.entries() if e["status"] == "ok"]
    assert store.check(entry["key"]) == []
    store.prune()  # the killed build's staging folder goes with prune
    assert not list(bundles.glob(".*.partial-*"))


def test_cache_list_verify_prune(pair, tmp_path):
    cache = EngineCache(tmp_path / "cache")
    a = _cached(pair, cache)
    b = _cached(pair, cache, max_input_len=32)
    run = CliRunner()
    listed = run.invoke(main, ["cache", "list", "--cache-dir", str(cache.root), "--json"])
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.output)
    assert {r["key"] for r in rows} == {a.key, b.key}
    assert all(r["size"] > 0 and r["last_used"] > 0 for r in rows)
    table = run.invoke(main, ["cache", "list", "--cache-dir", str(cache.root)])
    assert a.key in table.output and b.key in table.output

    ok = run.invoke(main, ["cache", "verify", "--cache-dir", str(cache.root)])
    assert ok.exit_code == 0 and ok.output.count("ok") >= 2, ok.output
    _tamper_weights(b.path)
    bad = run.invoke(main, ["cache", "verify", "--cache-dir", str(cache.root)])
    assert bad.exit_code != 0 and b.key in bad.output, bad.output

    # prune: by age (a was used long ago), then by size
    record = json.loads(cache.record_path(a.key).read_text())
    record["last_used"] = time.time() - 40 * 86400
    cache.record_path(a.key).write_text(json.dumps(record))
    dry = run.invoke(
        main, ["cache", "prune", "--cache-dir", str(cache.root), "--older-than", "30d", "--dry-run"]
    )
    assert dry.exit_code == 0 and a.key in dry.output and a.path.is_dir(), dry.output
    pruned = run.invoke(
        main, ["cache", "prune", "--cache-dir", str(cache.root), "--older-than", "30d"]
    )
    assert pruned.exit_code == 0 and not a.path.exists() and b.path.is_dir(), pruned.output
    sized = run.invoke(main, ["cache", "prune", "--cache-dir", str(cache.root), "--max-size", "1K"])
    assert sized.exit_code == 0 and not b.path.exists() and cache.entries() == []


def test_cache_flag_errors_name_the_fix(pair, tmp_path):
    target, draft = pair
    run = CliRunner()
    both = run.invoke(
        main, ["build", str(target), "-o", str(tmp_path / "b"), "--cache-dir", str(tmp_path)]
    )
    assert both.exit_code == 2 and "not both" in both.output, both.output
    bad = run.invoke(main, ["cache", "prune", "--cache-dir", str(tmp_path), "--max-size", "lots"])
    assert bad.exit_code == 2 and "'lots' is not a size" in bad.output, bad.output
    with pytest.raises(ConfigError, match="not a duration"):
        parse_age("a while")
    assert parse_size("1.5G") == 3 << 29 and parse_age("2h") == 7200


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    from edgebuild.bundle.cache import default_cache_dir

    monkeypatch.setenv("EDGEBUILD_CACHE_DIR", str(tmp_path / "eb"))
    assert default_cache_dir() == tmp_path / "eb"
    monkeypatch.delenv("EDGEBUILD_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "edgebuild"


# --------------------------------------------------------------------------- the server
THOR = {"tensorrt": "10.13.3", "gpu": "sm_110", "gpu_name": "test Thor"}


def _serve_config(target, draft, cache, **kw):
    from edgebuild.serve.config import ServeConfig

    spec = {"method": "dspark", "model": str(draft), "num_speculative_tokens": 3}
    return ServeConfig(
        model=str(target), cache_dir=cache, speculative_config=json.dumps(spec),
        max_batch_size=2, max_input_len=64, max_kv_cache_capacity=256, port=0, **kw,
    )  # fmt: skip


@pytest.fixture
def as_thor(monkeypatch):
    """A TensorRT host (Thor) where the builds are ``--onnx-only`` and the engines' bundle is
    then served by the torch runtime over its sources (no GPU here to run engines)."""
    import edgebuild.deploy as deploy
    import edgebuild.serve.config as serve_config
    from edgebuild.runtime.select import BackendChoice, HostProbe

    monkeypatch.setattr(
        deploy, "BuildOptions", lambda **kw: replace(ONNX, **{**kw, "onnx_only": True})
    )
    real_load = serve_config.load_state

    def load_on_cpu(config, plan=None):
        return real_load(config, replace(plan, backend=BackendChoice("torch", "test host")))

    monkeypatch.setattr(serve_config, "load_state", load_on_cpu)
    return HostProbe.from_mapping(THOR)


def test_serve_on_a_tensorrt_host_builds_into_the_cache_once(pair, tmp_path, as_thor, builds):
    from edgebuild.deploy import prepare_serve
    from edgebuild.serve.startup import Startup

    target, draft = pair
    config = _serve_config(target, draft, tmp_path / "cache")
    stages = []

    class Recorder(Startup):
        def stage(self, status, name, eta_s=None):
            stages.append((status, name))

    plans = [prepare_serve(config, as_thor)(Recorder(lambda s: None)) for _ in range(2)]
    assert len(builds) == 1
    assert plans[0].model == plans[1].model and plans[0].backend.name == "tensorrt"
    assert "cache hit" in plans[1].backend.reason and "built in" in plans[0].backend.reason
    assert plans[1].verify_bundle is False  # a hit reads no weights
    assert stages and all(s == "building" for s, _ in stages)
    manifest = json.loads((plans[0].model / "manifest.json").read_text())
    # the draft's whole block is built, so num_speculative_tokens 1..block_size need no rebuild
    assert manifest["speculative"]["num_speculative_tokens"] == 4


def test_health_says_building_while_a_slow_build_runs(pair, tmp_path, as_thor, monkeypatch):
    from edgebuild.deploy import serve_loader
    from edgebuild.serve.server import EdgeServer
    from edgebuild.serve.startup import Startup

    release = threading.Event()
    real = build_module.build_bundle

    def slow(recipe, out, options, sources=None):
        release.wait(120)
        return real(recipe, out, options, sources)

    monkeypatch.setattr(build_module, "build_bundle", slow)
    target, draft = pair
    config = _serve_config(target, draft, tmp_path / "cache", graceful_shutdown_s=1.0)
    server = EdgeServer(
        None, "warning", startup=Startup(serve_loader(config, as_thor)), config=config
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503 and int(health.headers["retry-after"]) > 0
        body = health.json()
        assert body["status"] == "building" and "building" in body["stage"]
        assert body["elapsed_s"] >= 0
        assert httpx.get(f"{url}/health/live", timeout=10).status_code == 200
        chat = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "x", "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        )
        assert chat.status_code == 503 and "retry-after" in chat.headers
        assert chat.json()["error"]["code"] == "model_not_ready"
        release.set()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                break
            assert server.startup_error is None, server.startup_error
            time.sleep(0.2)
        assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
        done = httpx.post(  # the tiny target has no chat template
            f"{url}/v1/completions",
            json={"model": "qwen3", "prompt": "hello", "max_tokens": 4},
            timeout=120,
        )
        assert done.status_code == 200, done.text
        assert done.json()["usage"]["completion_tokens"] > 0
    finally:
        release.set()
        server.should_exit = True
        thread.join(60)
        sock.close()


@pytest.mark.parametrize(
    "record",
    ["[]", '"x"', '{"key": "K", "stamps": {"manifest.json": 5}}', '{"key": "K", "stamps": {}, '
     '"last_used": "yesterday"}'],
    ids=["list", "string", "int-stamp", "str-last-used"],
)  # fmt: skip
def test_a_malformed_entry_record_is_refused_listed_and_rebuilt(pair, tmp_path, builds, record):
    cache = EngineCache(tmp_path / "cache")
    first = _cached(pair, cache)
    cache.record_path(first.key).write_text(record.replace('"K"', json.dumps(first.key)))
    assert cache.check(first.key), "a malformed record must not be a hit"
    run = CliRunner()
    listed = run.invoke(main, ["cache", "list", "--cache-dir", str(cache.root)])
    assert listed.exit_code == 0, listed.output
    dry = run.invoke(main, ["cache", "prune", "--cache-dir", str(cache.root), "--dry-run"])
    assert dry.exit_code == 0, dry.output
    again = _cached(pair, cache)
    assert not again.hit and len(builds) == 2 and cache.check(first.key) == []


def test_a_file_added_at_the_bundle_top_level_is_refused(pair, tmp_path, builds):
    cache = EngineCache(tmp_path / "cache")
    first = _cached(pair, cache)
    (first.path / "added_tokens.json").write_text('{"<hack>": 49152}')
    assert any("added_tokens.json: not listed" in p for p in cache.check(first.key))
    bad = CliRunner().invoke(main, ["verify", str(first.path), "--no-sources"])
    assert bad.exit_code == 2 and "added_tokens.json" in bad.output, bad.output
    assert not _cached(pair, cache).hit


def test_cache_remove_deletes_a_bad_entry_so_the_next_build_rebuilds(pair, tmp_path, builds):
    cache = EngineCache(tmp_path / "cache")
    first = _cached(pair, cache)
    run = CliRunner()
    gone = run.invoke(main, ["cache", "remove", "nope", "--cache-dir", str(cache.root)])
    assert gone.exit_code == 2 and "no cache entry nope" in gone.output
    ok = run.invoke(main, ["cache", "remove", first.key, "--cache-dir", str(cache.root)])
    assert ok.exit_code == 0 and not first.path.exists(), ok.output
    assert not _cached(pair, cache).hit and len(builds) == 2


@pytest.mark.parametrize("flag, value", [("--max-size", "inf"), ("--max-size", "-5G"),
                                         ("--older-than", "-1d"), ("--older-than", "nan")])  # fmt: skip
def test_prune_refuses_negative_or_non_finite_limits(tmp_path, flag, value):
    r = CliRunner().invoke(main, ["cache", "prune", "--cache-dir", str(tmp_path), flag, value])
    assert r.exit_code == 2 and f"'{value}' is not a" in r.output, r.output


def test_a_cache_dir_that_is_a_file_is_refused_before_building(pair, tmp_path, builds):
    target, draft = pair
    afile = tmp_path / "afile"
    afile.write_text("x")
    r = CliRunner().invoke(
        main,
        ["build", str(target), "--draft", str(draft), "--onnx-only", "--cache-dir", str(afile)],
    )
    assert r.exit_code == 2 and "is not a directory" in r.output, r.output
    assert builds == []


@pytest.mark.parametrize("command", ["prune", "list", "verify"])
def test_cache_commands_on_a_file_refuse_it_instead_of_finding_no_entries(tmp_path, command):
    afile = tmp_path / "afile"
    afile.write_text("x")
    r = CliRunner().invoke(main, ["cache", command, "--cache-dir", str(afile)])
    assert r.exit_code == 2 and f"engine cache {afile} is not a directory" in r.output, r.output
    assert afile.read_text() == "x"


def test_build_refuses_draft_flags_without_a_draft(pair, tmp_path, builds):
    target, _ = pair
    args = ["build", str(target), "-o", str(tmp_path / "b"), "--onnx-only"]
    r = CliRunner().invoke(main, [*args, "--num-speculative-tokens", "3"])
    assert r.exit_code == 2 and "--num-speculative-tokens" in r.output, r.output
    assert "no --draft" in r.output and builds == [] and not (tmp_path / "b").exists()
