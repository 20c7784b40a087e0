"""A seeded generator of structured English-like text: what the bundled tiny pair is trained on,
and where its held-out benchmark prompts come from (a different seed). Stdlib only."""
from __future__ import annotations

import random
import re

NOUNS = ("cat dog bird fox horse teacher doctor farmer child river garden city station engine "
         "kernel server cluster driver model token lamp window mountain forest village market").split()
ADJS = ("quick lazy small large bright quiet old young green silent happy careful clever "
        "patient ancient gentle").split()
VERBS = ("watches follows finds helps carries builds visits remembers answers compiles "
         "measures loads").split()
PLACES = ("near the river", "in the garden", "at the station", "on the mountain", "by the window",
          "inside the market", "behind the forest", "under the bright lamp")
NAMES = "alice bob carol dave erin frank grace heidi ivan judy".split()
TIMES = ("every morning", "at noon", "in the evening", "before dawn", "after the rain")


class Zipf:
    """Word choice with Zipf weights (1/rank), as in natural text: frequent words dominate."""

    def __init__(self, r: random.Random):
        self.r = r

    def choice(self, seq):
        return self.r.choices(seq, weights=[1.0 / (i + 1) for i in range(len(seq))])[0]

    def randrange(self, *a):
        return self.r.randrange(*a)


def sentence(r: random.Random) -> str:
    r = Zipf(r)
    k = r.randrange(6)
    a, b = r.choice(NOUNS), r.choice(NOUNS)
    if k == 0:
        return f"the {r.choice(ADJS)} {a} {r.choice(VERBS)} the {r.choice(ADJS)} {b} {r.choice(PLACES)}."
    if k == 1:
        return f"{r.choice(NAMES)} {r.choice(VERBS)} the {a} {r.choice(TIMES)}."
    if k == 2:
        return f"every {a} {r.choice(VERBS)} a {r.choice(ADJS)} {b}, and the {b} {r.choice(VERBS)} the {a}."
    if k == 3:
        n = r.randrange(1, 20)
        return f"there are {n} {a}s {r.choice(PLACES)}, and {n + 1} {b}s {r.choice(PLACES)}."
    if k == 4:
        return f"{r.choice(NAMES)} says that the {a} is {r.choice(ADJS)} {r.choice(TIMES)}."
    return f"when the {a} {r.choice(VERBS)} the {b}, the {r.choice(ADJS)} {a} {r.choice(VERBS)} it {r.choice(PLACES)}."


def document(r: random.Random) -> str:
    return " ".join(sentence(r) for _ in range(r.randrange(3, 8)))


def corpus(n_docs: int, seed: int = 0) -> list[str]:
    r = random.Random(seed)
    return [document(r) for _ in range(n_docs)]


def held_out_prompts(n: int = 8, seed: int = 12345) -> list[str]:
    """Prompts the pair never saw verbatim: a sentence or two and the start of the next."""
    r = random.Random(seed)
    out = []
    for _ in range(n):
        text = " ".join(sentence(r) for _ in range(r.randrange(1, 3))) + " " + sentence(r)
        out.append(text[: len(text) - r.randrange(10, 40)])
    return out


TOPICS = ("photosynthesis", "the water cycle", "gravity", "volcanoes", "the immune system", "black holes",
          "electricity", "the internet", "vaccines", "climate change", "the moon's phases", "rainbows",
          "earthquakes", "the human heart", "bees", "recycling", "compound interest", "machine learning",
          "the French Revolution", "the Roman Empire", "democracy", "inflation", "plate tectonics", "DNA",
          "the solar system", "tides", "sleep", "exercise", "coffee", "chess", "the printing press", "bridges",
          "airplanes", "batteries", "magnets", "clouds", "deserts", "coral reefs", "the stock market", "music")
THINGS = ("the ocean", "a lighthouse", "autumn leaves", "a cat", "the city at night", "a mountain", "friendship",
          "a rainy day", "the stars", "an old library", "a garden", "a train journey", "snow", "the sunrise")
GOALS = ("learning a new language", "sleeping better", "saving money", "staying focused", "writing an essay",
         "cooking for a family", "running a first marathon", "keeping a houseplant alive", "public speaking",
         "starting a small business", "studying for exams", "making friends in a new city")
TEMPLATES = ("Explain {topic} in simple terms.", "What is {topic}?", "Why does {topic} matter?",
             "Write a short poem about {thing}.", "Give me three tips for {goal}.",
             "Describe {thing} in a few sentences.", "How does {topic} work?",
             "Write a short story about {thing}.", "What are common mistakes when {goal}?",
             "Summarize what everyone should know about {topic}.", "Tell me a fun fact about {topic}.",
             "What are the pros and cons of {goal}?")


STYLES = ("", " Keep it brief.", " Use an example.", " Answer in two short paragraphs.",
          " Explain it to a ten-year-old.", " Use a numbered list.")
HELD_OUT = 8   # the last topics, and the last 3 things and goals, appear only in held-out prompts


def _prompts(topics, things, goals) -> list[str]:
    fill = {"topic": topics, "thing": things, "goal": goals}
    return [t.format(**{k: v}) + s for t in TEMPLATES for k in fill if "{" + k + "}" in t
            for v in fill[k] for s in STYLES]


def chat_prompts(n: int, seed: int = 0) -> list[str]:
    """Training user messages (templates × topics × styles), shuffled; held-out topics excluded."""
    out = _prompts(TOPICS[:-HELD_OUT], THINGS[:-3], GOALS[:-3])
    random.Random(seed).shuffle(out)
    return out[:n]


def held_out_chat_prompts(n: int = 8, seed: int = 12345) -> list[str]:
    """Benchmark user messages about topics no training prompt mentions."""
    out = _prompts(TOPICS[-HELD_OUT:], THINGS[-3:], GOALS[-3:])
    random.Random(seed).shuffle(out)
    return out[:n]


def _held_out_words() -> re.Pattern:
    """Word starts (6 letters at most) of the held-out topics that no training prompt contains."""
    train = " ".join(_prompts(TOPICS[:-HELD_OUT], THINGS[:-3], GOALS[:-3])).lower()
    words = " ".join(TOPICS[-HELD_OUT:] + THINGS[-3:] + GOALS[-3:]).lower().split()
    stems = {w.rstrip("s")[:6] for w in words}
    return re.compile(r"\b(" + "|".join(sorted(s for s in stems if not re.search(r"\b" + s, train))) + ")")


HELD_OUT_WORDS = _held_out_words()


def mentions_held_out(text: str) -> bool:
    """Whether a message names a held-out benchmark topic (self-written training prompts that do are dropped)."""
    return HELD_OUT_WORDS.search(text.lower()) is not None
