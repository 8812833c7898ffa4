"""onnxruntime-genai in a separate Python (its own venv), driven over JSON lines.

onnxruntime-genai pins its own onnxruntime, so it cannot live in the project's venv; the
benches (``cpu_compare.py``, ``quant_quality.py``) run it through this worker, started with
that venv's python (``--ortgenai-python``). One worker holds one model at one thread count.
Requests on stdin, one JSON object a line, each answered by one line on stdout:

* ``{"cmd": "load", "model_dir": DIR, "threads": N}`` -> ``{"ok": true, "versions": {...}}``;
* ``{"cmd": "generate", "ids": [...], "max_tokens": n}`` -> ``{"tokens": [...], "decode_s": s}``:
  greedy, EOS ignored (exactly ``n`` tokens), ``decode_s`` the time after the first token
  (as ``cpu_compare.OrtGenai.run``);
* ``{"cmd": "teacher_forced", "ids": [...], "cont": [...]}`` -> ``{"argmax": [...],
  "logp": [...]}``: one pass of the model's ``model.onnx`` (onnxruntime, empty past KV) over
  ``ids + cont[:-1]``; for each continuation position the argmax token and the log-softmax
  (float32) of ``cont``'s token, as ``quant_quality.teacher_forced`` computes them;
* ``{"cmd": "quit"}``.

The client (:class:`Worker`) is imported by the benches; it needs only the standard library.

    /work/venv-genai/bin/python bench/ortgenai_worker.py   # then JSON lines on stdin
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_PYTHON = Path("/work/venv-genai/bin/python")


def default_python() -> str | None:
    """The genai venv's python if it exists, else ``None`` (import in-process)."""
    return str(DEFAULT_PYTHON) if DEFAULT_PYTHON.is_file() else None


def load_model(og, model_dir, threads: int):
    """An ``og.Model`` of ``model_dir`` whose decoder session runs ``threads`` intra-op threads."""
    config = og.Config(str(model_dir))
    opts = {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
    config.overlay(json.dumps({"model": {"decoder": {"session_options": opts}}}))
    return og.Model(config)


def greedy(og, model, ids: list[int], n: int) -> tuple[list[int], float]:
    """Exactly ``n`` greedy tokens after ``ids`` (EOS ignored) and the decode seconds: the
    time after the first token (the prefill excluded), as every engine of cpu_compare.py."""
    params = og.GeneratorParams(model)
    total = len(ids) + n
    params.set_search_options(do_sample=False, max_length=total, min_length=total)
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    toks, t_first = [], None
    while not gen.is_done() and len(toks) < n:
        gen.generate_next_token()
        toks.append(int(gen.get_next_tokens()[0]))
        if t_first is None:
            t_first = time.perf_counter()
    return toks, time.perf_counter() - t_first


class Worker:
    """Client: a long-lived worker process (``python`` runs this file)."""

    def __init__(self, python: str, model_dir: Path, threads: int):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
        env.pop("PYTHONPATH", None)  # the project's paths are not the genai venv's
        self.proc = subprocess.Popen(
            [python, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.versions = self.call({"cmd": "load", "model_dir": str(model_dir), "threads": threads})[
            "versions"
        ]

    def call(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"onnxruntime-genai worker exited ({self.proc.wait()})")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"onnxruntime-genai worker: {out['error']}")
        return out

    def generate(self, ids: list[int], n: int) -> tuple[list[int], float]:
        out = self.call({"cmd": "generate", "ids": list(ids), "max_tokens": n})
        return out["tokens"], out["decode_s"]

    def teacher_forced(self, ids: list[int], cont: list[int]) -> tuple[list[int], list[float]]:
        out = self.call({"cmd": "teacher_forced", "ids": list(ids), "cont": list(cont)})
        return out["argmax"], out["logp"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"cmd": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


def build(python: str, target: Path, model: Path, precision: str, cache: Path) -> None:
    """onnxruntime-genai's own model builder (defaults: int4 = RTN, symmetric, block 32,
    accuracy_level 4 on cpu), offline, with ``python``."""
    cmd = [python, "-m", "onnxruntime_genai.models.builder", "-i", str(target),
           "-o", str(model), "-p", precision, "-e", "cpu", "-c", str(cache)]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    subprocess.run(cmd, check=True, env=env)


class _Server:
    def __init__(self):
        self.model = self.session = None

    def load(self, model_dir: str, threads: int) -> dict:
        import onnxruntime_genai as og

        self.og, self.dir, self.threads = og, Path(model_dir), threads
        self.model = load_model(og, model_dir, threads)
        import onnxruntime

        versions = {"onnxruntime-genai": og.__version__, "onnxruntime": onnxruntime.__version__}
        return {"ok": True, "versions": versions}

    def generate(self, ids: list[int], max_tokens: int) -> dict:
        toks, decode_s = greedy(self.og, self.model, ids, max_tokens)
        return {"tokens": toks, "decode_s": decode_s}

    def teacher_forced(self, ids: list[int], cont: list[int]) -> dict:
        import numpy as np

        if self.session is None:
            import onnxruntime as ort

            so = ort.SessionOptions()
            so.intra_op_num_threads, so.inter_op_num_threads = self.threads, 1
            path = str(self.dir / "model.onnx")
            self.session = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        rows = np.array([ids + cont[:-1]], dtype=np.int64)
        feeds = {"input_ids": rows, "attention_mask": np.ones_like(rows)}
        dec = json.loads((self.dir / "genai_config.json").read_text())["model"]["decoder"]
        empty = np.zeros((1, dec["num_key_value_heads"], 0, dec["head_size"]), np.float32)
        for i in self.session.get_inputs():
            if i.name.startswith("past_key_values."):  # [batch, kv heads, past, head size]
                feeds[i.name] = empty
        logits = self.session.run(["logits"], feeds)[0][0, len(ids) - 1 :].astype(np.float32)
        want = np.array(cont)
        m = logits.max(-1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(logits - m).sum(-1))
        logp = logits[np.arange(len(cont)), want] - lse
        return {"argmax": logits.argmax(-1).tolist(), "logp": logp.astype(float).tolist()}


def main() -> None:
    # only JSON lines on the protocol's stdout: anything the libraries print goes to stderr
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    server = _Server()
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req.pop("cmd")
        if cmd == "quit":
            break
        try:
            out = getattr(server, cmd)(**req)
        except Exception as exc:  # noqa: BLE001 - reported to the client
            out = {"error": f"{type(exc).__name__}: {exc}"}
        proto.write(json.dumps(out) + "\n")
        proto.flush()


if __name__ == "__main__":
    main()
