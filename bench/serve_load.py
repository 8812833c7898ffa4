"""Load benchmark of `edgellm-serve`: aggregate tokens/s and latency at several concurrencies,
target-only, fixed-length DSpark and confidence-scheduled DSpark, and a multi-turn chat, against
servers this script starts (and stops) itself.

Each level runs `clients` concurrent streaming chat clients; each client sends its requests
one after another (different prompts, greedy, `ignore_eos` so every request generates exactly
`--max-tokens`). Reported per level: requests, generated tokens, wall time, aggregate
tokens/s (all tokens / wall time), p50/p95 end-to-end latency, p50 time to first token, and
for DSpark the server's tau (mean accepted length) from /metrics.

Modes (`--modes`, comma-separated):

- ``target``: target only; ``dspark``: fixed ``num_speculative_tokens``; ``scheduled``:
  ``"confidence_scheduling": true``;
- a ``-noprefill`` suffix (e.g. ``target-noprefill``) starts that server with
  ``--no-enable-chunked-prefill``: new prompts are prefilled one by one, whole, inside a step
  (the behaviour before batched prefill), for the TTFT comparison.

Multi-turn (`--multi-turn N`, on the ``scheduled`` server and on one with
``--no-enable-prefix-caching``): N conversations one after another; turn 1 sends a ~1k-token
document and a question, turn 2 the whole history (document, question, the answer) plus a new
question. TTFT of each turn; with prefix caching turn 2 reuses turn 1's KV pages.

    python bench/serve_load.py                        # SmolLM2 example, 1/4/16 clients
    python bench/serve_load.py --modes target,scheduled --max-tokens 32 --multi-turn 4

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


def start_server(
    model: Path, spec: dict | None, threads: int | None, batch: int, extra: list[str] = ()
):
    """Start `edgellm-serve` on a free loopback port; return (process, base url)."""
    port = free_port()
    cmd = [sys.executable, "-m", "edgebuild.serve", str(model), "--port", str(port),
           "--max-batch-size", str(batch), "--served-model-name", "bench",
           "--log-level", "warning"]  # fmt: skip
    if threads:
        cmd += ["--threads", str(threads)]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
    cmd += list(extra)
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


async def one_request(
    client: httpx.AsyncClient, url: str, prompt: str | list[dict], max_tokens: int
) -> dict:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    body = {
        "model": "bench", "messages": messages,
        "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    t0 = time.perf_counter()
    ttft, tokens, text = None, 0, []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and any(c["delta"].get("content") for c in chunk["choices"]):
                ttft = time.perf_counter() - t0
            text += [c["delta"].get("content") or "" for c in chunk["choices"]]
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {
        "latency": time.perf_counter() - t0, "ttft": ttft or 0.0, "tokens": tokens,
        "text": "".join(text),
    }  # fmt: skip


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


def scrape(url: str, name: str) -> float | None:
    """The value of an unlabelled metric `name` in /metrics (None when absent)."""
    text = httpx.get(url + "/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def document(k: int, tokens: int = 1000) -> str:
    """A ~`tokens`-token text, different for each k (numbered facts about rotating topics)."""
    out, i = [], 0
    while len(" ".join(out)) < tokens * 4:  # ~4 characters per token for English BPE
        topic = TOPICS[(k + i) % len(TOPICS)]
        out.append(f"Fact {i + 1} of note {k}: {topic} are discussed in chapter {i % 7 + 2}, "
                   f"with {3 + (i * k) % 11} examples and one open question.")  # fmt: skip
        i += 1
    return " ".join(out)


async def multi_turn(url: str, conversations: int, max_tokens: int) -> dict:
    """Turn 1 (a ~1k-token document + a question), then turn 2 (the history + a new
    question), `conversations` times one after another; TTFT per turn."""
    first, second = [], []
    async with httpx.AsyncClient(timeout=600) as http:
        for k in range(conversations):
            history = [{"role": "user", "content": document(k) + "\n\nSummarise the note."}]
            r1 = await one_request(http, url, history, max_tokens)
            history += [
                {"role": "assistant", "content": r1["text"]},
                {"role": "user", "content": "Which chapter is mentioned most often?"},
            ]
            r2 = await one_request(http, url, history, max_tokens)
            first.append(r1["ttft"])
            second.append(r2["ttft"])
    t1, t2 = statistics.median(first), statistics.median(second)
    return {
        "conversations": conversations,
        "ttft_turn1_p50_s": round(t1, 3),
        "ttft_turn2_p50_s": round(t2, 3),
        "turn2_over_turn1": round(t2 / t1, 3) if t1 else None,
    }


MODES = {  # name -> (speculative: None | "fixed" | "scheduled", extra server flags)
    "target": (None, []),
    "dspark": ("fixed", []),
    "scheduled": ("scheduled", []),
}


def mode_settings(name: str) -> tuple[str | None, list[str]]:
    base, _, suffix = name.partition("-")
    if base not in MODES or suffix not in ("", "noprefill", "nocache"):
        raise SystemExit(f"unknown mode {name!r}: use target|dspark|scheduled[-noprefill|-nocache]")
    spec, extra = MODES[base]
    if suffix == "noprefill":
        extra = [*extra, "--no-enable-chunked-prefill"]
    elif suffix == "nocache":
        extra = [*extra, "--no-enable-prefix-caching"]
    return spec, extra


def draft_config(args, tmp: Path, scheduled: bool = False) -> tuple[dict, str]:
    draft = args.draft
    note = "trained draft"
    if draft is None or not (Path(draft) / "config.json").is_file():
        sys.path.insert(0, str(ROOT / "tests"))
        from dspark_fixtures import make_random_draft

        draft = make_random_draft(tmp / "random-draft", args.model, block_size=7)
        note = "random draft (acceptance ~0: cost of speculation only)"
    spec = {"method": "dspark", "model": str(draft), "num_speculative_tokens": args.spec_tokens}
    if scheduled:
        spec["confidence_scheduling"] = True
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


def plot(rows: list[dict], turns: list[dict], path: Path) -> None:
    """tokens/s against clients per mode (left); TTFT p50 per mode at the top level and the
    multi-turn TTFTs (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        pts = [r for r in rows if r["mode"] == mode]
        ax.plot([r["clients"] for r in pts], [r["tokens_per_s"] for r in pts], "o-", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate tokens/s")
    ax.legend(fontsize=8)
    top = max(r["clients"] for r in rows)
    labels = [f"{r['mode']}\n{top} clients" for r in rows if r["clients"] == top]
    values = [r["ttft_p50_s"] for r in rows if r["clients"] == top]
    for t in turns:
        labels += [f"{t['mode']}\nturn 1", f"{t['mode']}\nturn 2"]
        values += [t["ttft_turn1_p50_s"], t["ttft_turn2_p50_s"]]
    bx.bar(range(len(values)), values)
    bx.set_xticks(range(len(values)), labels, fontsize=6, rotation=45, ha="right")
    bx.set_ylabel("TTFT p50 (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "examples" / "smollm2-135m")
    ap.add_argument("--draft", type=Path, default=ROOT / "edgebuild/data/smollm2-135m-dspark")
    ap.add_argument("--spec-tokens", type=int, default=7)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests-per-client", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="server torch threads")
    ap.add_argument("--modes", default="target,dspark,scheduled")
    ap.add_argument("--multi-turn", type=int, default=0, help="conversations (0 = skip)")
    ap.add_argument("--server-args", default="", help="extra edgellm-serve flags, every mode")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--png", type=Path, default=None, help="also plot the rows here")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    modes = args.modes.split(",")
    settings = {m: mode_settings(m) for m in modes}
    rows, turns = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            kind, extra = settings[mode]
            spec, note = (None, "") if kind is None else draft_config(
                args, Path(tmp), kind == "scheduled"
            )  # fmt: skip
            extra = [*extra, *args.server_args.split()]
            proc, url = start_server(args.model, spec, args.threads, max(levels), extra)
            try:
                asyncio.run(run_level(url, 1, 1, 4))  # warm-up
                for clients in levels:
                    row = asyncio.run(
                        run_level(url, clients, args.requests_per_client, args.max_tokens)
                    )
                    row["mode"] = mode
                    row["tau"] = scrape_tau(url) if spec else None
                    if kind == "scheduled":
                        steps = scrape(url, "edgellm_spec_decode_scheduled_steps_total") or 0
                        skipped = scrape(url, "edgellm_spec_decode_draft_skipped_steps_total")
                        row["skipped_draft_share"] = round((skipped or 0) / max(steps, 1), 3)
                        row["predicted_accepted"] = scrape(
                            url, "edgellm_spec_decode_predicted_accepted_tokens_total"
                        )
                        row["realised_accepted"] = scrape(
                            url, "edgellm_spec_decode_realised_accepted_tokens_total"
                        )
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                stop_server(proc)
            if note:
                print(f"{mode}: {note}")
        if args.multi_turn:
            for mode in ("scheduled", "scheduled-nocache"):
                kind, extra = mode_settings(mode)
                spec, _ = draft_config(args, Path(tmp), True)
                proc, url = start_server(args.model, spec, args.threads, max(levels), extra)
                try:
                    asyncio.run(run_level(url, 1, 1, 4))  # warm-up
                    turn = asyncio.run(multi_turn(url, args.multi_turn, args.max_tokens))
                    turn["mode"] = mode
                    turn["prefix_cache_hit_rate"] = scrape(url, "edgellm_prefix_cache_hit_rate")
                    turns.append(turn)
                    print(json.dumps(turn), flush=True)
                finally:
                    stop_server(proc)
    print(markdown(rows))
    for t in turns:
        print(f"multi-turn {t['mode']}: TTFT turn 1 {t['ttft_turn1_p50_s']} s, turn 2 "
              f"{t['ttft_turn2_p50_s']} s (x{t['turn2_over_turn1']})")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"levels": rows, "multi_turn": turns}, indent=2))
    if args.png:
        plot(rows, turns, args.png)


if __name__ == "__main__":
    main()
