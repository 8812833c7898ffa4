"""Training data at scale, written by the target itself (self-distillation).

Three steps, each resumable and seeded; the committed result is compact (prompt text and the
target's greedy answer token ids, never features):

1. ``pool``: a large prompt pool from templates x topics (the 36 original templates plus
   more, ~300 train topics) and small tasks; every prompt that mentions a held-out eval topic
   (``HELD_OUT_STEMS``) or equals an eval prompt is dropped.
2. ``selfinstruct``: the target writes new user requests from five seed requests of the
   pool (a list to continue, seeded sampling); one line, 4-40 words, deduplicated, held-out topics filtered out.
3. ``answers``: the target answers the mixed pool greedily through its chat template
   (transformers batched ``generate``, bf16, left padding; measured faster than the
   project's runtime here: 346 vs 187 tokens/s at batch 64, one thread), within
   ``--budget-tokens`` / ``--budget-minutes``, appending to a jsonl cache (resumable).
   ``--part I/N`` answers every N-th bucket of 8 batches of the whole order into
   ``answers.partIofN.jsonl`` (one process per core; the split does not move on a rerun;
   prompts answered in any other answers file are skipped).
4. ``pack``: the answers cache (``answers.jsonl`` and any part files, merged in the prompt
   order) -> ``data/distill/answers.npz`` (uint16 token ids + offsets) and
   ``data/distill/prompts.jsonl.gz`` (id, source, prompt), committed. ``unpack`` turns
   them back into the answers jsonl that ``cache_features`` reads (prompt ids re-made by the
   tokenizer's chat template).
5. ``dev``: ``data/distill/dev_prompts.jsonl``, the last ``--n`` prompts of the order (train
   topics, never answered): a set for choosing checkpoints by the runtime's tau, so the
   held-out eval prompts are used for the final measurement only.

    python -m tools.train_dspark.datagen pool
    python -m tools.train_dspark.datagen selfinstruct --n 1500
    python -m tools.train_dspark.datagen answers --budget-minutes 45
    python -m tools.train_dspark.datagen pack
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import time
from pathlib import Path

import numpy as np

from tools.train_dspark.prompts import (
    DATA_DIR,
    TASK_TEMPLATES,
    TEMPLATES,
    TOPICS,
    read_jsonl,
)

DISTILL_DIR = DATA_DIR / "distill"
CACHE = Path(".cache/train_dspark/distill")

# The 20 eval topics (prompts.make_prompts, seed 0) and close relatives: never in training.
HELD_OUT_STEMS = (
    "recycl",
    "castle",
    "olympic",
    "baking bread",
    "bake bread",
    "healthy eating",
    "video game",
    "chess",
    "volcan",
    "earthquake",
    "swim",
    "curiosity",
    "machine learning",
    "printing press",
    "snow",
    "friendship",
    "space exploration",
    "human rights",
    "statistic",
    "human heart",
    "heart",
    "elephant",
)

MORE_TEMPLATES = (
    "How does {t} work?",
    "Tell me something surprising about {t}.",
    "Write a short blog post about {t}.",
    "What is the most important thing to know about {t}?",
    "Explain {t} step by step.",
    "Write a limerick about {t}.",
    "What are some common mistakes people make with {t}?",
    "How would a teacher explain {t} to a class?",
    "Give me a simple example that shows {t}.",
    "What is the difference between {t} and {u}?",
    "How are {t} and {u} related?",
    "Write a short story that involves {t} and {u}.",
    "Explain {t} like I am a complete beginner.",
    "Give me a short summary of {t}.",
    "What should everyone know about {t}?",
    "Write a product description inspired by {t}.",
    "What are five words that describe {t}? Explain each one.",
    "Write a short speech about {t}.",
    "What are the biggest challenges related to {t}?",
    "Can you give me a fun fact about {t}?",
    "Write a short letter to a friend about {t}.",
    "What are some good books or resources about {t}?",
    "Create a lesson plan about {t} for high school students.",
    "What would the world be like without {t}?",
    "Give me an analogy that explains {t}.",
    "Write a riddle about {t} and give the answer.",
    "What do experts say about {t}?",
    "Write three multiple-choice questions about {t}.",
    "Describe a day in the life of someone who works with {t}.",
    "Why do people find {t} interesting?",
)

MORE_TOPICS = (
    "artificial intelligence",
    "the solar system",
    "the Milky Way",
    "comets",
    "asteroids",
    "the Big Bang",
    "stars",
    "telescopes",
    "satellites",
    "the International Space Station",
    "rockets",
    "the speed of light",
    "quantum physics",
    "energy",
    "heat",
    "temperature",
    "friction",
    "motion",
    "Newton's laws",
    "electric circuits",
    "nuclear power",
    "fossil fuels",
    "hydropower",
    "geothermal energy",
    "the atmosphere",
    "clouds",
    "rain",
    "wind",
    "hurricanes",
    "tornadoes",
    "weather forecasts",
    "seasons",
    "glaciers",
    "mountains",
    "caves",
    "islands",
    "lakes",
    "wetlands",
    "grasslands",
    "the Arctic",
    "Antarctica",
    "soil",
    "rocks and minerals",
    "crystals",
    "gold",
    "diamonds",
    "iron",
    "water",
    "oxygen",
    "carbon",
    "chemical reactions",
    "acids and bases",
    "cells",
    "evolution",
    "genetics",
    "the brain",
    "the lungs",
    "bones",
    "muscles",
    "the skin",
    "the eyes",
    "hearing",
    "teeth",
    "digestion",
    "vitamins",
    "protein",
    "sugar",
    "salt",
    "drinking water",
    "hand washing",
    "viruses",
    "antibiotics",
    "hospitals",
    "nurses",
    "doctors",
    "mental health",
    "stress",
    "happiness",
    "gratitude",
    "patience",
    "honesty",
    "empathy",
    "courage",
    "motivation",
    "habits",
    "goal setting",
    "productivity",
    "note taking",
    "memory",
    "critical thinking",
    "problem solving",
    "decision making",
    "negotiation",
    "job interviews",
    "writing a resume",
    "customer service",
    "small businesses",
    "marketing",
    "advertising",
    "online shopping",
    "banks",
    "credit cards",
    "taxes",
    "insurance",
    "investing",
    "cryptocurrency",
    "economics",
    "supply and demand",
    "trade",
    "globalization",
    "cities",
    "villages",
    "public transport",
    "traffic",
    "cars",
    "motorcycles",
    "ships",
    "submarines",
    "helicopters",
    "maps and GPS",
    "the post office",
    "newspapers",
    "radio",
    "television",
    "movies",
    "cartoons",
    "comic books",
    "poetry",
    "novels",
    "fairy tales",
    "mythology",
    "Greek mythology",
    "theater",
    "dance",
    "ballet",
    "opera",
    "rock music",
    "the guitar",
    "the piano",
    "drums",
    "singing",
    "sculpture",
    "architecture",
    "interior design",
    "fashion",
    "knitting",
    "pottery",
    "woodworking",
    "origami",
    "drawing",
    "calligraphy",
    "board games",
    "card games",
    "puzzles",
    "crossword puzzles",
    "magic tricks",
    "camping",
    "hiking",
    "fishing",
    "cycling",
    "running",
    "yoga",
    "basketball",
    "baseball",
    "golf",
    "skiing",
    "surfing",
    "boxing",
    "martial arts",
    "cricket",
    "rugby",
    "volleyball",
    "table tennis",
    "marathons",
    "cats",
    "dogs",
    "horses",
    "cows",
    "sheep",
    "chickens",
    "owls",
    "eagles",
    "parrots",
    "sharks",
    "whales",
    "octopuses",
    "jellyfish",
    "frogs",
    "snakes",
    "turtles",
    "lions",
    "tigers",
    "bears",
    "wolves",
    "monkeys",
    "giraffes",
    "kangaroos",
    "koalas",
    "ants",
    "spiders",
    "mosquitoes",
    "earthworms",
    "trees",
    "flowers",
    "roses",
    "cacti",
    "mushrooms",
    "seeds",
    "fruit",
    "apples",
    "bananas",
    "vegetables",
    "potatoes",
    "rice",
    "pizza",
    "soup",
    "salads",
    "cheese",
    "ice cream",
    "breakfast",
    "lunch boxes",
    "spices",
    "vegetarian food",
    "street food",
    "restaurants",
    "table manners",
    "birthdays",
    "weddings",
    "holidays",
    "festivals",
    "New Year celebrations",
    "family traditions",
    "grandparents",
    "siblings",
    "parenting",
    "babies",
    "teenagers",
    "school uniforms",
    "homework",
    "exams",
    "universities",
    "online learning",
    "teachers",
    "scholarships",
    "the alphabet",
    "grammar",
    "punctuation",
    "spelling",
    "dictionaries",
    "translation",
    "sign language",
    "Spanish",
    "French",
    "Chinese writing",
    "Japanese culture",
    "India",
    "Brazil",
    "Africa",
    "Europe",
    "Australia",
    "Canada",
    "Mexico",
    "ancient Greece",
    "ancient China",
    "the Vikings",
    "the Middle Ages",
    "knights",
    "the Silk Road",
    "explorers",
    "Christopher Columbus",
    "the Great Wall of China",
    "the pyramids of Giza",
    "the Eiffel Tower",
    "the Statue of Liberty",
    "world wars",
    "the Cold War",
    "the United Nations",
    "elections",
    "voting",
    "laws",
    "courts",
    "police",
    "firefighters",
    "the army",
    "peace",
    "volunteering",
    "charity",
    "community gardens",
    "zoos",
    "national parks",
    "wildlife conservation",
    "endangered species",
    "deforestation",
    "air pollution",
    "noise pollution",
    "composting",
    "electric scooters",
    "smart homes",
    "the cloud",
    "computers",
    "keyboards",
    "the mouse",
    "operating systems",
    "Linux",
    "web browsers",
    "websites",
    "HTML",
    "JavaScript",
    "databases",
    "algorithms",
    "sorting algorithms",
    "binary numbers",
    "encryption",
    "passwords",
    "email",
    "spam",
    "online privacy",
    "open source software",
    "apps",
    "virtual reality",
    "drones",
    "self-driving cars",
    "the blockchain",
    "big data",
    "data science",
    "spreadsheets",
    "calculators",
    "algebra",
    "multiplication",
    "division",
    "percentages",
    "decimals",
    "negative numbers",
    "probability",
    "angles",
    "triangles",
    "circles",
    "the number pi",
    "infinity",
    "measurement",
    "the metric system",
    "money",
    "coins",
    "time zones",
    "the leap year",
)

MORE_TASKS = (
    "What is {a} times {b}? Show your work.",
    "What is {a} minus {b}?",
    "Divide {a} by {b} and explain the result.",
    "Write a Python function that checks whether a number is even.",
    "Write a Python function that reverses a string.",
    "Write a Python loop that prints the numbers from 1 to {b}.",
    "A box holds {b} eggs. How many boxes are needed for {a} eggs?",
    "Sam is {a} years old. How old will he be in {b} years?",
    "What is {b} squared?",
    "Round {a}.{b} to the nearest whole number.",
    "A book has {a} pages. If I read {b} pages a day, how many days will it take?",
    "List the multiples of {b} that are smaller than {a}.",
)

# a list to continue (raw text, no chat template): the model writes the next request
SELF_INSTRUCT = "Requests that users sent to a helpful AI assistant:\n{examples}\n-"
STARTS = (
    "what",
    "how",
    "why",
    "when",
    "where",
    "who",
    "which",
    "can",
    "could",
    "is",
    "are",
    "do",
    "does",
    "should",
    "write",
    "explain",
    "describe",
    "give",
    "list",
    "tell",
    "create",
    "compare",
    "summarize",
    "make",
    "suggest",
    "help",
    "imagine",
    "translate",
    "name",
)


def blocked(prompt: str) -> bool:
    """True if ``prompt`` mentions a held-out eval topic (``HELD_OUT_STEMS``)."""
    low = prompt.lower()
    return any(s in low for s in HELD_OUT_STEMS)


# Extra phrasings of every template prompt (``variants`` > 1, the GPU path's larger pool).
STYLES = (
    "{p}",
    "Briefly: {p}",
    "{p} Please answer in a few sentences.",
    "For a school project: {p}",
    "{p} Use simple words.",
    "Quick question. {p}",
    "{p} Give examples.",
    "My friend asked me this and I did not know: {p}",
)


def make_pool(seed: int = 0, variants: int = 1) -> list[dict]:
    """The template x topic pool (train topics only, held-out topics filtered), shuffled.

    ``variants`` > 1 adds the prompts again in the next ``STYLES`` phrasings (and new topic
    pairings for two-topic templates), for budgets larger than the ~31k base prompts.
    """
    rng = random.Random(seed)
    eval_prompts = {r["prompt"] for r in read_jsonl(DATA_DIR / "eval_prompts.jsonl")}
    topics = [t for t in dict.fromkeys(TOPICS + MORE_TOPICS) if not blocked(t)]
    out: list[str] = []
    for style in STYLES[: max(1, variants)]:
        for tpl in TEMPLATES + MORE_TEMPLATES:
            for t in topics:
                u = rng.choice(topics)
                if "{u}" in tpl and u == t:
                    continue
                out.append(style.format(p=tpl.format(t=t, u=u)))
    for _ in range(len(out) // 12):
        a, b = rng.randint(12, 99), rng.randint(2, 11)
        out.append(rng.choice(TASK_TEMPLATES + MORE_TASKS).format(a=a, b=b))
    out = [p for p in dict.fromkeys(out) if p not in eval_prompts and not blocked(p)]
    rng.shuffle(out)
    return [{"id": f"pool-{i:05d}", "source": "template", "prompt": p} for i, p in enumerate(out)]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def clean_request(text: str) -> str | None:
    """The first line of a generated request if it looks like one, else None."""
    line = text.strip().split("\n")[0].strip()
    line = re.sub(r"^(\d+[.)]|[-*])\s*", "", line).strip().strip('"').strip()
    words = line.split()
    if not 4 <= len(words) <= 40 or line[-1:] not in "?." or blocked(line):
        return None
    if words[0].lower().strip(",") not in STARTS:
        return None
    return line


def self_instruct(model, tok, pool: list[dict], n: int, batch: int, seed: int, out: Path):
    """``n`` new requests written by the target (seeded sampling), appended to ``out``."""
    import torch

    rng = random.Random(seed)
    have = read_jsonl(out) if out.exists() else []
    seen = {r["prompt"].lower() for r in have} | {r["prompt"].lower() for r in pool}
    eos = int(model.generation_config.eos_token_id or tok.eos_token_id)
    k, t0, tries = len(have), time.perf_counter(), 0
    with out.open("a", encoding="utf-8") as f:
        while k < n and tries < 50 * n:
            chunk = []
            for _ in range(batch):
                ex = "\n".join(f"- {r['prompt']}" for r in rng.sample(pool, 5))
                chunk.append(tok(SELF_INSTRUCT.format(examples=ex))["input_ids"])
            tries += batch
            width = max(len(c) for c in chunk)
            ids = torch.full((len(chunk), width), eos, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, c in enumerate(chunk):
                ids[i, width - len(c) :] = torch.tensor(c)
                mask[i, width - len(c) :] = 1
            torch.manual_seed(seed * 1_000_003 + tries)
            with torch.inference_mode():
                gen = model.generate(
                    input_ids=ids.to(model.device),
                    attention_mask=mask.to(model.device),
                    do_sample=True,
                    temperature=0.9,
                    top_p=0.95,
                    max_new_tokens=48,
                    eos_token_id=eos,
                    pad_token_id=eos,
                )
            for row in gen[:, width:].cpu().tolist():
                req = clean_request(tok.decode(row, skip_special_tokens=True))
                if req is None or req.lower() in seen or k >= n:
                    continue
                seen.add(req.lower())
                f.write(json.dumps({"id": f"si-{k:05d}", "source": "self-instruct", "prompt": req}))
                f.write("\n")
                k += 1
            f.flush()
            print(
                f"self-instruct: {k}/{n} kept of {tries} tried, {time.perf_counter() - t0:.0f} s",
                flush=True,
            )


def mixed_prompts(pool: list[dict], si: list[dict], seed: int, si_fraction: float) -> list[dict]:
    """Pool and self-instruct prompts interleaved (seeded): any prefix is a mix of both.

    ``si_fraction`` > 0: self-instruct prompts take that share of every prefix until they run
    out (the committed CPU data predates this and used 0: one shuffle of both lists, i.e. a
    1.6 % share with 500 self-instruct prompts among ~31.7k).
    """
    rng = random.Random(seed + 1)
    if si_fraction <= 0:
        rows = pool + si
        rng.shuffle(rows)
        return rows
    pool, si = pool[:], si[:]
    rng.shuffle(pool)
    rng.shuffle(si)
    out, i, j = [], 0, 0
    while i < len(pool) or j < len(si):
        if j < len(si) and (i >= len(pool) or j < si_fraction * (i + j + 1)):
            out.append(si[j])
            j += 1
        else:
            out.append(pool[i])
            i += 1
    return out


def answer(model, tok, rows: list[dict], out: Path, args, done: list[Path] = ()) -> None:
    """Greedy answers in prompt order (buckets of 8 batches sorted by length), budgeted.

    Appends to ``out`` (a rerun resumes); prompts answered in ``out`` or in the ``done`` files
    (the other parts, the unpacked committed data) are skipped. ``--budget-tokens`` counts this
    file's answers only.
    """
    from tools.train_dspark.regenerate import chat_ids, generate_batch

    eos = int(model.generation_config.eos_token_id or tok.eos_token_id)
    answered, n_tok = set(), 0
    for path in done:
        answered.update(r["id"] for r in read_jsonl(path))
    if out.exists():
        for r in read_jsonl(out):
            answered.add(r["id"])
            n_tok += len(r["answer_ids"])
    part, parts = args.part
    if parts > 1:  # --part: every parts-th bucket of the whole order (stable across reruns)
        size = 8 * args.batch
        rows = [r for k, r in enumerate(rows) if (k // size) % parts == part]
    todo = [r for r in rows if r["id"] not in answered]
    t0, new_tok = time.perf_counter(), 0
    bucket = 8 * args.batch
    with out.open("a", encoding="utf-8") as f:
        for b0 in range(0, len(todo), bucket):
            group = [(chat_ids(tok, r["prompt"]), r) for r in todo[b0 : b0 + bucket]]
            group.sort(key=lambda x: len(x[0]))
            for i in range(0, len(group), args.batch):
                if args.budget_tokens and n_tok >= args.budget_tokens:
                    return
                if args.budget_minutes and time.perf_counter() - t0 > 60 * args.budget_minutes:
                    return
                chunk = group[i : i + args.batch]
                answers = generate_batch(
                    model, [c[0] for c in chunk], args.max_new_tokens, eos, eos
                )
                for (p, r), a in zip(chunk, answers, strict=True):
                    rec = {
                        "id": r["id"],
                        "source": r["source"],
                        "prompt": r["prompt"],
                        "prompt_ids": p,
                        "answer_ids": a,
                    }
                    f.write(json.dumps(rec) + "\n")
                    n_tok += len(a)
                    new_tok += len(a)
                f.flush()
                dt = time.perf_counter() - t0
                print(
                    f"{len(answered) + b0 + i + len(chunk)} answers, {n_tok} tokens "
                    f"({new_tok / dt:.1f} tok/s this run, {dt:.0f} s)",
                    flush=True,
                )


def parse_part(text: str) -> tuple[int, int]:
    """``"I/N"`` -> (I, N) with 0 <= I < N (``--part``: this process's share of the buckets)."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--part {text!r}: expected I/N, e.g. 0/2") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"--part {text!r}: need 0 <= I < N")
    return i, n


def answer_files(cache: Path) -> list[Path]:
    """``answers.jsonl`` and the ``answers.part*.jsonl`` files of ``--part`` runs, if any."""
    main = cache / "answers.jsonl"
    return ([main] if main.exists() else []) + sorted(cache.glob("answers.part*.jsonl"))


def merged_answers(files: list[Path], order: list[dict]) -> list[dict]:
    """Answer records of several files, in the mixed prompt ``order`` (ids must be unique)."""
    rank = {r["id"]: i for i, r in enumerate(order)}
    rows = [r for f in files for r in read_jsonl(f)]
    ids = [r["id"] for r in rows]
    if len(set(ids)) != len(ids):
        raise SystemExit(f"answers repeated across {', '.join(map(str, files))}")
    missing = [i for i in ids if i not in rank]
    if missing:
        raise SystemExit(f"{len(missing)} answers (e.g. {missing[0]}) are not in the prompt order")
    return sorted(rows, key=lambda r: rank[r["id"]])


def dev_prompts(order: list[dict], answered: list[Path], n: int) -> list[dict]:
    """The last ``n`` prompts of the mixed ``order``: train-topic prompts no answer file holds.

    A model-selection set for the runtime's tau that is neither training data nor the held-out
    eval prompts (those stay for the final measurement). Raises SystemExit if one of them has
    been answered (the data would then overlap it).
    """
    rows = [{"id": r["id"], "prompt": r["prompt"]} for r in order[-n:]]
    ids = {r["id"] for r in rows}
    seen = [r["id"] for f in answered for r in read_jsonl(f) if r["id"] in ids]
    if seen:
        raise SystemExit(f"dev prompts already answered (training data): {seen[:3]}")
    return rows


def pack(rows: list[dict], out_dir: Path) -> dict:
    """answer records -> ``answers.npz`` (uint16 ids, offsets) + ``prompts.jsonl.gz``."""
    ids = np.array([t for r in rows for t in r["answer_ids"]], dtype=np.uint16)
    if ids.size and max(max(r["answer_ids"]) for r in rows if r["answer_ids"]) >= 2**16:
        raise SystemExit("token id >= 65536: uint16 is too small")
    lens = np.array([len(r["answer_ids"]) for r in rows], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    out_dir.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out_dir / "answers.npz", ids=ids, offsets=offsets)
    with gzip.open(out_dir / "prompts.jsonl.gz", "wt", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({"id": r["id"], "source": r["source"], "prompt": r["prompt"]}))
            f.write("\n")
    return {"answers": len(rows), "answer_tokens": int(lens.sum())}


def unpack(data_dir: Path, tok, limit_tokens: int = 0) -> list[dict]:
    """The committed data -> answer records (prompt ids re-made by the chat template).

    ``limit_tokens``: keep the shortest prefix of the (mixed, seeded) order holding at least
    that many answer tokens; 0 keeps everything. Prefixes are nested (data-size study).
    """
    from tools.train_dspark.regenerate import chat_ids

    z = np.load(data_dir / "answers.npz")
    ids, off = z["ids"].astype(np.int64), z["offsets"]
    with gzip.open(data_dir / "prompts.jsonl.gz", "rt", encoding="utf-8") as f:
        meta = [json.loads(line) for line in f if line.strip()]
    out, n = [], 0
    for i, m in enumerate(meta):
        if limit_tokens and n >= limit_tokens:
            break
        a = ids[off[i] : off[i + 1]].tolist()
        out.append({**m, "prompt_ids": chat_ids(tok, m["prompt"]), "answer_ids": a})
        n += len(a)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=["pool", "selfinstruct", "answers", "pack", "unpack", "dev"])
    ap.add_argument("--target", type=Path, default=Path("examples/smollm2-135m"))
    ap.add_argument("--cache", type=Path, default=CACHE)
    ap.add_argument("--data", type=Path, default=DISTILL_DIR)
    ap.add_argument("--n", type=int, default=1500, help="self-instruct requests / dev prompts")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budget-tokens", type=int, default=0)
    ap.add_argument("--budget-minutes", type=float, default=0)
    ap.add_argument("--limit-tokens", type=int, default=0, help="unpack: nested prefix")
    ap.add_argument("--out", type=Path, default=None, help="unpack: answers jsonl")
    ap.add_argument("--variants", type=int, default=1, help="pool phrasings (GPU path: 4)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--si-fraction", type=float, default=0.25, help="0: the committed data's mix")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--part", type=parse_part, default=(0, 1), help="answers: I/N, this process's share"
    )
    args = ap.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    pool_path, si_path = args.cache / "pool.jsonl", args.data / "selfinstruct_prompts.jsonl"
    if args.step == "pool":
        pool = make_pool(args.seed, args.variants)
        _write_jsonl(pool_path, pool)
        print(f"{len(pool)} pool prompts -> {pool_path}")
        return
    if args.step == "dev":
        si = read_jsonl(si_path) if si_path.exists() else []
        order = mixed_prompts(make_pool(args.seed, args.variants), si, args.seed, args.si_fraction)
        rows = dev_prompts(order, answer_files(args.cache), args.n)
        _write_jsonl(args.data / "dev_prompts.jsonl", rows)
        print(f"{len(rows)} dev prompts -> {args.data / 'dev_prompts.jsonl'}")
        return
    if args.step == "pack":
        si = read_jsonl(si_path) if si_path.exists() else []
        order = mixed_prompts(make_pool(args.seed, args.variants), si, args.seed, args.si_fraction)
        print(json.dumps(pack(merged_answers(answer_files(args.cache), order), args.data)))
        return
    import torch

    from tools.train_dspark.regenerate import load_target

    torch.set_num_threads(args.threads)
    if args.step == "unpack":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(args.target), local_files_only=True)
        rows = unpack(args.data, tok, args.limit_tokens)
        out = args.out or args.cache / "answers_unpacked.jsonl"
        _write_jsonl(out, rows)
        print(f"{len(rows)} answers, {sum(len(r['answer_ids']) for r in rows)} tokens -> {out}")
        return
    tok, model = load_target(args.target, torch.bfloat16)
    model.to(args.device)
    pool = make_pool(args.seed, args.variants)
    if args.step == "selfinstruct":
        args.data.mkdir(parents=True, exist_ok=True)
        self_instruct(model, tok, pool, args.n, args.batch, args.seed, si_path)
        return
    si = read_jsonl(si_path) if si_path.exists() else []
    rows = mixed_prompts(pool, si, args.seed, args.si_fraction)
    part, parts = args.part
    out = args.cache / ("answers.jsonl" if parts == 1 else f"answers.part{part}of{parts}.jsonl")
    answer(model, tok, rows, out, args, done=[f for f in answer_files(args.cache) if f != out])


if __name__ == "__main__":
    main()
