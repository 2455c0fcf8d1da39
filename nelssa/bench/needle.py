"""RULER-style needle-in-a-haystack prompts (our own generator, seeded) and scoring.

Needle: "One of the special magic numbers for {key} is: {value}." inserted at a sentence boundary
at a given depth of a real-text haystack (CPython's documentation) or the RULER noise haystack;
question after the haystack, answer prefix opening the assistant turn. Score: the 7-digit value
appears in the greedy output (case-insensitive substring), averaged x100.
"""

from __future__ import annotations

import random

from nelssa.bench.corpus import sentences

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
ADJ = ["amused", "brave", "calm", "eager", "fancy", "gentle", "happy", "jolly", "kind", "lively", "proud", "silly"]
NOUN = ["apple", "badger", "canyon", "dolphin", "engine", "forest", "garden", "harbor", "island", "jacket"]


def make_prompt(tok, length: int, depth: float, seed: int, haystack: str = "essay") -> tuple[list[int], str]:
    """(prompt token ids of about `length` tokens, expected value): one needle at ``depth``."""
    return make_multi_prompts(tok, length, (depth,), seed, haystack)[0]


def make_multi_prompts(tok, length: int, depths, seed: int, haystack: str = "essay") -> list[tuple[list[int], str]]:
    """One haystack of about ``length`` tokens holding a needle (its own key and value) at each of
    ``depths``, and one prompt per needle asking for its value: [(prompt ids, expected value)]. The
    prompts share everything up to the question, so a prefix cache prefills the haystack once."""
    rng = random.Random(seed)
    keys: list[str] = []
    while len(keys) < len(depths):
        k = f"{rng.choice(ADJ)}-{rng.choice(NOUN)}"
        if k not in keys:
            keys.append(k)
    values = [str(rng.randint(1_000_000, 9_999_999)) for _ in depths]
    head = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the numbers afterwards.\n")
    pool = sentences() if haystack == "essay" else NOISE.split(". ")
    start = rng.randrange(len(pool)) if haystack == "essay" else 0

    def build(n_sent: int) -> str:
        hay = [pool[(start + i) % len(pool)] for i in range(n_sent)]
        for d, k, v in sorted(zip(depths, keys, values), reverse=True):  # deepest first: indices stay valid
            hay.insert(int(round(d * n_sent)), f"One of the special magic numbers for {k} is: {v}.")
        return " ".join(hay)

    def encode(n_sent: int, k: str) -> list[int]:
        msg = head + build(n_sent) + "\n" + f"What is the special magic number for {k} mentioned in the provided text?"
        ids = tok.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        return ids + tok.encode(f" The special magic number for {k} mentioned in the provided text is",
                                add_special_tokens=False)

    longest = max(keys, key=len)  # searched with the longest key's prompt, then checked for all
    lo, hi = 1, max(2, length // 2)  # sentences of the haystack: each is more than 2 tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(encode(mid, longest)) <= length:
            lo = mid
        else:
            hi = mid - 1
    while True:
        out = [(encode(lo, k), v) for k, v in zip(keys, values)]
        if lo == 1 or max(len(x) for x, _ in out) <= length:
            return out
        lo -= 1


def score(outputs: list[str], expected: list[str]) -> float:
    return 100.0 * sum(e.lower() in o.lower() for o, e in zip(outputs, expected)) / max(1, len(expected))


def cases(lengths=(2500, 4000, 5500, 7000), depths=(0.1, 0.35, 0.6, 0.85), seed: int = 0):
    return [(L, d, seed + 100 * i + j) for i, L in enumerate(lengths) for j, d in enumerate(depths)]
