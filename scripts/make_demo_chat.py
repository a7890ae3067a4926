"""Generate dspark/assets/demo_chat.jsonl, the demo's small chat dataset.

Conversations follow a handful of templates with real regularities (arithmetic,
counting, spelling, facts, echoing), so a tiny verifier pre-trained on them has a
next-token distribution a drafter can learn. Deterministic: rerun to reproduce.
"""

import json
import random
import sys
from pathlib import Path

ANIMALS = {
    "cat": ("small", "meows", "fish", "house"), "dog": ("loyal", "barks", "bones", "yard"),
    "cow": ("large", "moos", "grass", "farm"), "owl": ("wise", "hoots", "mice", "forest"),
    "duck": ("noisy", "quacks", "bread", "pond"), "lion": ("strong", "roars", "meat", "savanna"),
    "frog": ("green", "croaks", "flies", "swamp"), "horse": ("fast", "neighs", "hay", "stable"),
    "sheep": ("woolly", "bleats", "clover", "meadow"), "bee": ("busy", "buzzes", "nectar", "hive"),
}
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"]
THINGS = ["apple", "sky", "leaf", "sun", "grape", "carrot", "coal", "snow"]
WORDS = ["river", "planet", "garden", "window", "silver", "market", "pencil", "bridge",
         "candle", "forest", "rocket", "butter", "winter", "castle", "dragon", "ticket"]


def arithmetic(r):
    a, b = r.randint(0, 50), r.randint(0, 50)
    return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}. The answer is {a + b}."


def counting(r):
    a = r.randint(1, 30)
    n = r.randint(4, 10)
    seq = ", ".join(str(i) for i in range(a, a + n))
    return f"Count from {a} to {a + n - 1}.", f"Sure. Counting from {a}: {seq}. Done counting."


def spelling(r):
    w = r.choice(WORDS)
    return f"How do you spell {w}?", f"The word {w} is spelled {'-'.join(w)}. That is {len(w)} letters."


def animal(r):
    name = r.choice(sorted(ANIMALS))
    size, sound, food, home = ANIMALS[name]
    return (f"Tell me about the {name}.",
            f"The {name} is a {size} animal. The {name} {sound}, eats {food} and lives in the {home}.")


def color(r):
    i = r.randrange(len(THINGS))
    return f"What color is the {THINGS[i]}?", f"The {THINGS[i]} is {COLORS[i]}. Many things are {COLORS[i]}."


def echo(r):
    words = " ".join(r.choice(WORDS) for _ in range(r.randint(3, 7)))
    return f"Repeat after me: {words}", f"You said: {words}. I repeated: {words}."


TEMPLATES = [arithmetic, counting, spelling, animal, color, echo]


def conversation(r):
    messages = []
    if r.random() < 0.3:
        messages.append({"role": "system", "content": "You are a helpful assistant."})
    for _ in range(r.randint(1, 4)):
        question, answer = r.choice(TEMPLATES)(r)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def main(out: Path, n: int = 400, seed: int = 0) -> None:
    r = random.Random(seed)
    out.write_text("".join(json.dumps(conversation(r)) + "\n" for _ in range(n)))
    print(f"wrote {n} conversations to {out}")


def tasks(out: Path, n: int = 10, seed: int = 1) -> None:
    """One prompt set per template, from another seed than the training data: the demo's decode table
    compares tasks the way a drafter card compares datasets. Spelling is written as ShareGPT."""
    out.mkdir(parents=True, exist_ok=True)
    r = random.Random(seed)
    for template in (arithmetic, spelling, echo):
        pairs = [template(r) for _ in range(n)]
        if template is spelling:
            records = [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]} for q, a in pairs]
        else:
            records = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                       for q, a in pairs]
        (out / f"{template.__name__}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in records))
    print(f"wrote {n} prompts per task to {out}: arithmetic, spelling (ShareGPT), echo")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--tasks"]:
        tasks(Path(sys.argv[2]))
    else:
        main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parents[1] / "dspark/assets/demo_chat.jsonl")
