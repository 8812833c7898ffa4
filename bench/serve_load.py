"""Load benchmark of `edgellm-serve`: aggregate tokens/s and latency at several concurrencies,
target-only and with DSpark, against servers this script starts (and stops) itself.

Each level runs `clients` concurrent streaming chat clients; each client sends its requests
one after another (different prompts, greedy, `ignore_eos` so every request generates exactly
`--max-tokens`). Reported per level: requests, generated tokens, wall time, aggregate
tokens/s (all tokens / wall time), p50/p95 end-to-end latency, p50 time to first token, and
for DSpark the server's tau (mean accepted length) from /metrics.

    python bench/serve_load.py                        # SmolLM2 example, 1/4/16 clients
    python bench/serve_load.py --draft DIR --max-tokens 32 --requests-per-client 2

Without a trained draft (edgebuild/data/smollm2-135m-dspark) a random 7-token draft is
written to a temporary directory: its acceptance is ~0, so that row measures the cost of
drafting and verifying, not a speedup.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
TOPICS = ["cats", "the moon", "Paris", "the sea", "iron", "Python", "music", "tea", "bees",
          "snow", "trains", "stars", "bread", "chess", "rivers", "clocks"]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, spec: dict | None, threads: int | None, batch: int):
    """Start `edgellm-serve` on a free loopback port; return (process, base url)."""
    port = free_port()
    cmd = [sys.executable, "-m", "edgebuild.serve", str(model), "--port", str(port),
           "--max-batch-size", str(batch), "--served-model-name", "bench",
           "--log-level", "warning"]  # fmt: skip
    if threads:
        cmd += ["--threads", str(threads)]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
    proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not start")


def stop_server(proc) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    body = {
        "model": "bench", "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and any(c["delta"].get("content") for c in chunk["choices"]):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"latency": time.perf_counter() - t0, "ttft": ttft or 0.0, "tokens": tokens}


async def run_level(url: str, clients: int, per_client: int, max_tokens: int) -> dict:
    async def client_loop(c: int, http: httpx.AsyncClient):
        out = []
        for k in range(per_client):
            topic = TOPICS[(c * per_client + k) % len(TOPICS)]
            prompt = f"Write a short story about {topic} (#{c}.{k})."
            out.append(await one_request(http, url, prompt, max_tokens))
        return out

    async with httpx.AsyncClient(timeout=600) as http:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(client_loop(c, http) for c in range(clients)))
        wall = time.perf_counter() - t0
    rows = [r for per in results for r in per]
    lat = sorted(r["latency"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    return {
        "clients": clients,
        "requests": len(rows),
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 2),
        "p50_s": round(statistics.median(lat), 2),
        "p95_s": round(lat[min(len(lat) - 1, int(0.95 * len(lat)))], 2),
        "ttft_p50_s": round(statistics.median(r["ttft"] for r in rows), 2),
    }


def scrape_tau(url: str) -> float | None:
    text = httpx.get(url + "/metrics").text
    m = re.search(r"^edgellm_spec_decode_mean_accepted_length (\S+)$", text, re.M)
    return round(float(m.group(1)), 3) if m else None


def draft_config(args, tmp: Path) -> tuple[dict, str]:
    draft = args.draft
    note = "trained draft"
    if draft is None or not (Path(draft) / "config.json").is_file():
        sys.path.insert(0, str(ROOT / "tests"))
        from dspark_fixtures import make_random_draft

        draft = make_random_draft(tmp / "random-draft", args.model, block_size=7)
        note = "random draft (acceptance ~0: cost of speculation only)"
    spec = {"method": "dspark", "model": str(draft), "num_speculative_tokens": args.spec_tokens}
    return spec, note


def markdown(rows: list[dict]) -> str:
    head = ("| mode | clients | requests | tokens | wall s | tokens/s | p50 s | p95 s "
            "| TTFT p50 s | tau |\n|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    lines = [
        f"| {r['mode']} | {r['clients']} | {r['requests']} | {r['tokens']} | {r['wall_s']} "
        f"| {r['tokens_per_s']} | {r['p50_s']} | {r['p95_s']} | {r['ttft_p50_s']} "
        f"| {r.get('tau') or '-'} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "examples" / "smollm2-135m")
    ap.add_argument("--draft", type=Path, default=ROOT / "edgebuild/data/smollm2-135m-dspark")
    ap.add_argument("--spec-tokens", type=int, default=7)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests-per-client", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="server torch threads")
    ap.add_argument("--modes", default="target,dspark")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            spec, note = (None, "") if mode == "target" else draft_config(args, Path(tmp))
            proc, url = start_server(args.model, spec, args.threads, max(levels))
            try:
                asyncio.run(run_level(url, 1, 1, 4))  # warm-up
                for clients in levels:
                    row = asyncio.run(
                        run_level(url, clients, args.requests_per_client, args.max_tokens)
                    )
                    row["mode"] = "dspark" if spec else "target-only"
                    row["tau"] = scrape_tau(url) if spec else None
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                stop_server(proc)
            if note:
                print(f"dspark: {note}")
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
