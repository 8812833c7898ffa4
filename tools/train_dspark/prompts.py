"""Make the chat prompt sets of the example draft: templates x topics, seeded, made locally.

Train and eval prompts are disjoint by construction: the eval set draws only from topics that
never appear in the train set (held-out topics), so the measured acceptance is on prompts the
draft has not seen. Writes ``data/train_prompts.jsonl`` and ``data/eval_prompts.jsonl`` next to
this file (one ``{"id": ..., "prompt": ...}`` per line; the files are committed).

    python -m tools.train_dspark.prompts [--train 800 --eval 64 --seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"

# {t} = a topic (a noun phrase). Every template reads naturally with every topic.
TEMPLATES = (
    "What is {t}?",
    "Explain {t} in simple terms.",
    "Can you explain {t} to a ten-year-old?",
    "Give me three interesting facts about {t}.",
    "Write a short paragraph about {t}.",
    "What are the main benefits of {t}?",
    "What are the most common misconceptions about {t}?",
    "Summarize the history of {t} in a few sentences.",
    "Why is {t} important?",
    "How would you describe {t} to someone who has never heard of it?",
    "List five key ideas related to {t}.",
    "Write a haiku about {t}.",
    "Write a short poem about {t}.",
    "Tell me a fun story that involves {t}.",
    "What questions should a beginner ask about {t}?",
    "Give me a study plan for learning about {t}.",
    "What are the pros and cons of {t}?",
    "How has {t} changed over the last hundred years?",
    "Write a tweet about {t}.",
    "Write an introduction for a school essay about {t}.",
    "What would be a good title for a blog post about {t}?",
    "Describe {t} in one sentence.",
    "What is a good way to start learning about {t}?",
    "Compare {t} with something from everyday life.",
    "What careers are connected to {t}?",
    "Give me a quiz question about {t} and its answer.",
    "What are some tips for teaching {t} to students?",
    "Write a short dialogue between two friends discussing {t}.",
    "What is the future of {t}?",
    "Explain the basic vocabulary someone needs to talk about {t}.",
    "I am curious about {t}. Where should I start?",
    "Please write a brief, friendly explanation of {t}.",
    "What are three questions scientists still ask about {t}?",
    "Make a list of dos and don'ts related to {t}.",
    "How can {t} affect our daily lives?",
    "Write a short advertisement that mentions {t}.",
)

TOPICS = (
    "photosynthesis",
    "the water cycle",
    "black holes",
    "volcanoes",
    "the human heart",
    "climate change",
    "renewable energy",
    "solar panels",
    "electric cars",
    "the internet",
    "machine learning",
    "computer programming",
    "the Python programming language",
    "cloud computing",
    "cybersecurity",
    "smartphones",
    "video games",
    "social media",
    "the Roman Empire",
    "ancient Egypt",
    "the Renaissance",
    "the Industrial Revolution",
    "the printing press",
    "the Olympic Games",
    "democracy",
    "human rights",
    "the stock market",
    "inflation",
    "saving money",
    "budgeting",
    "healthy eating",
    "regular exercise",
    "a good night's sleep",
    "meditation",
    "time management",
    "public speaking",
    "learning a new language",
    "reading books",
    "classical music",
    "jazz",
    "painting",
    "photography",
    "gardening",
    "cooking pasta",
    "baking bread",
    "coffee",
    "tea",
    "chocolate",
    "honey bees",
    "dolphins",
    "elephants",
    "penguins",
    "the Amazon rainforest",
    "deserts",
    "the ocean",
    "coral reefs",
    "the Moon",
    "Mars",
    "the Sun",
    "gravity",
    "electricity",
    "magnets",
    "light",
    "sound",
    "atoms",
    "DNA",
    "vaccines",
    "bacteria",
    "the immune system",
    "recycling",
    "plastic pollution",
    "clean water",
    "bicycles",
    "trains",
    "airplanes",
    "space exploration",
    "robots",
    "3D printing",
    "mathematics",
    "fractions",
    "prime numbers",
    "geometry",
    "statistics",
    "chess",
    "football",
    "tennis",
    "swimming",
    "mountain climbing",
    "friendship",
    "kindness",
    "teamwork",
    "leadership",
    "creativity",
    "curiosity",
    "libraries",
    "museums",
    "maps",
    "clocks",
    "the calendar",
    "rainbows",
    "thunderstorms",
    "snow",
    "earthquakes",
    "tides",
    "forests",
    "rivers",
    "farming",
    "bread making in history",
    "the wheel",
    "bridges",
    "skyscrapers",
    "castles",
    "pyramids",
    "birds migrating",
    "butterflies",
    "dinosaurs",
    "fossils",
    "the periodic table",
    "nutrition labels",
    "first aid",
    "recycling paper",
    "wind turbines",
    "batteries",
)

# Prompts with a different shape (numbers and tasks, not topics); {a}, {b} are small integers.
TASK_TEMPLATES = (
    "What is {a} plus {b}? Explain your answer.",
    "If I have {a} apples and give away {b}, how many do I have left?",
    "A train travels {a} kilometers in {b} hours. What is its average speed?",
    "Write a Python function that returns the sum of the numbers from 1 to {a}.",
    "Count from {b} to {a} and say which numbers are even.",
    "Is {a} a prime number? Explain.",
    "Convert {a} minutes into hours and minutes.",
    "A shop sells pens for {b} dollars each. How much do {a} pens cost?",
)


def _task_prompts(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        a, b = rng.randint(12, 99), rng.randint(2, 11)
        out.append(rng.choice(TASK_TEMPLATES).format(a=a, b=b))
    return out


def make_prompts(n_train: int, n_eval: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """Disjoint (train, eval) prompt lists; eval topics never appear in train."""
    rng = random.Random(seed)
    topics = list(TOPICS)
    rng.shuffle(topics)
    held_out = topics[: max(1, len(topics) // 6)]
    train_topics = topics[len(held_out) :]
    train_pool = [t.format(t=topic) for t in TEMPLATES for topic in train_topics]
    eval_pool = [t.format(t=topic) for t in TEMPLATES for topic in held_out]
    rng.shuffle(train_pool)
    rng.shuffle(eval_pool)
    n_task_train, n_task_eval = n_train // 10, n_eval // 8
    train = train_pool[: n_train - n_task_train] + _task_prompts(rng, n_task_train)
    evals = eval_pool[: n_eval - n_task_eval]
    seen = set(train)
    tasks = [p for p in _task_prompts(rng, 10 * n_eval) if p not in seen]
    evals += list(dict.fromkeys(tasks))[:n_task_eval]
    train = list(dict.fromkeys(train))
    rng.shuffle(train)
    if set(train) & set(evals):
        raise RuntimeError("train and eval prompts overlap")
    return train, evals


def write_jsonl(path: Path, prompts: list[str], prefix: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"id": f"{prefix}-{i:04d}", "prompt": p}) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text("utf-8").splitlines() if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=800)
    ap.add_argument("--eval", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    train, evals = make_prompts(args.train, args.eval, args.seed)
    write_jsonl(DATA_DIR / "train_prompts.jsonl", train, "train")
    write_jsonl(DATA_DIR / "eval_prompts.jsonl", evals, "eval")
    print(f"{len(train)} train, {len(evals)} eval prompts in {DATA_DIR}")


if __name__ == "__main__":
    main()
