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


def _prompts(topics, things, goals, templates=TEMPLATES) -> list[str]:
    fill = {"topic": topics, "thing": things, "goal": goals}
    return [t.format(**{k: v}) + s for t in templates for k in fill if "{" + k + "}" in t
            for v in fill[k] for s in STYLES]


# More training material: subjects, things and goals no benchmark prompt is about, and more ways of asking
TRAIN_TOPICS = tuple(t.strip() for t in """
the heart of an atom, nuclear fission, nuclear fusion, the speed of light, sound waves, friction, momentum,
the periodic table, acids and bases, chemical bonds, evaporation, erosion, glaciers, hurricanes, tornadoes,
lightning, the ozone layer, the carbon cycle, the nitrogen cycle, ecosystems, food chains, evolution, natural selection,
fossils, dinosaurs, mammals, reptiles, insects, ants, whales, dolphins, octopuses, sharks, penguins, wolves,
elephants, migration of birds, hibernation, the human brain, the lungs, the kidneys, the liver, blood types, bones,
muscles, the skin, the eye, hearing, taste, memory, emotions, stress, nutrition, vitamins, protein, sugar, fiber,
hydration, antibiotics, viruses, bacteria, allergies, the common cold, first aid, meditation, yoga, posture,
the Industrial Revolution, ancient Egypt, ancient Greece, the Renaissance, the Middle Ages, the Silk Road,
the Vikings, the Cold War, World War I, the American Revolution, the invention of writing, the wheel, the compass,
the telephone, the light bulb, the steam engine, the radio, television, photography, cinema, the bicycle,
cars, electric cars, rockets, satellites, the space station, Mars, Jupiter, Saturn's rings, comets, asteroids,
the Big Bang, galaxies, telescopes, microscopes, computers, programming, algorithms, databases, encryption,
passwords, cybersecurity, open source software, spreadsheets, email, search engines, social media, smartphones,
robots, artificial intelligence, virtual reality, 3D printing, solar power, wind power, hydroelectric power,
nuclear power, fossil fuels, energy efficiency, insulation, plumbing, bread baking, fermentation, cheese,
chocolate, tea, spices, rice, wheat, farming, irrigation, composting, soil, trees, forests, rivers, lakes,
wetlands, mountains, islands, caves, rainforests, grasslands, the Arctic, Antarctica, maps, time zones,
calendars, clocks, money, banks, taxes, budgets, loans, credit scores, supply and demand, trade, globalization,
unemployment, taxes on goods, insurance, elections, the rule of law, human rights, the United Nations, voting,
newspapers, libraries, museums, poetry, novels, theater, painting, sculpture, architecture, dance, opera, jazz,
the piano, the guitar, languages, grammar, punctuation, translation, sign language, mathematics, fractions,
percentages, probability, statistics, geometry, algebra, prime numbers, the number zero, infinity, logic,
philosophy, ethics, happiness, curiosity, creativity, teamwork, leadership, negotiation, kindness, honesty,
habits, motivation, procrastination, time management, critical thinking, the scientific method, peer review""".split(","))
TRAIN_THINGS = ("a thunderstorm", "the wind at dawn", "a quiet morning", "a busy kitchen", "an old clock",
                "a forest path", "a fishing boat", "a summer festival", "a winter evening", "the first day of school",
                "a grandmother's recipe", "a lost key", "a red bicycle", "a childhood home", "a crowded bus",
                "the full moon", "a field of sunflowers", "a letter from the past", "a waterfall", "a candle",
                "a bookstore", "a robot who wants to paint", "a dragon who is afraid of fire", "a quiet village",
                "the sea at night", "a hot air balloon", "a tiny island", "an abandoned castle", "a spring morning",
                "a family dinner", "a broken umbrella", "a hummingbird", "a violin", "the last leaf on a tree",
                "an astronaut far from home", "a lighthouse keeper's dog", "a secret garden door", "a long road",
                "a cup of tea", "the first flight of a bird", "a wise old owl", "a city park", "a chess game",
                "a birthday surprise", "a kite", "the northern lights", "a fox in the moonlight", "a paper boat")
TRAIN_GOALS = ("getting up early", "drinking more water", "reading more books", "learning to code", "eating healthier",
               "learning to swim", "planning a trip", "organizing a closet", "learning to draw", "writing a resume",
               "preparing for a job interview", "managing stress", "building a habit", "learning the piano",
               "growing vegetables", "taking better photos", "keeping a journal", "cooking rice", "baking bread",
               "walking more each day", "reducing screen time", "learning to cook", "writing a cover letter",
               "teaching a child to read", "caring for a dog", "moving to a new home", "paying off debt",
               "learning to meditate", "improving handwriting", "giving feedback", "leading a team meeting",
               "writing clear emails", "learning chess", "running a book club", "decluttering a home",
               "planning a wedding", "camping for the first time", "learning to ride a bike", "painting a room",
               "becoming more patient", "remembering names", "fixing a flat tire", "hosting a dinner party")
TRAIN_TEMPLATES = ("Write a paragraph about {topic}.", "List five facts about {topic}.",
                   "How would you teach {topic} to a beginner?", "What do people often get wrong about {topic}?",
                   "Write a haiku about {thing}.", "Write a letter to a friend about {thing}.",
                   "How do I get started with {goal}?", "Make a simple weekly plan for {goal}.")


def chat_prompts(n: int, seed: int = 0) -> list[str]:
    """Training user messages (templates × topics × styles), shuffled; held-out topics excluded."""
    topics, things, goals = TOPICS[:-HELD_OUT] + TRAIN_TOPICS, THINGS[:-3] + TRAIN_THINGS, GOALS[:-3] + TRAIN_GOALS
    out = _prompts(topics, things, goals) + _prompts(topics, things, goals, TRAIN_TEMPLATES)
    random.Random(seed).shuffle(out)
    return out[:n]


def held_out_chat_prompts(n: int = 8, seed: int = 12345) -> list[str]:
    """Benchmark user messages about topics no training prompt mentions."""
    out = _prompts(TOPICS[-HELD_OUT:], THINGS[-3:], GOALS[-3:])
    random.Random(seed).shuffle(out)
    return out[:n]


def _held_out_words() -> re.Pattern:
    """Word starts (6 letters at most) of the held-out topics that no training prompt contains."""
    train = " ".join(_prompts(TOPICS[:-HELD_OUT], THINGS[:-3], GOALS[:-3])).lower()   # the original lists only
    words = " ".join(TOPICS[-HELD_OUT:] + THINGS[-3:] + GOALS[-3:]).lower().split()
    stems = {w.rstrip("s")[:6] for w in words}
    return re.compile(r"\b(" + "|".join(sorted(s for s in stems if not re.search(r"\b" + s, train))) + ")")


HELD_OUT_WORDS = _held_out_words()


def mentions_held_out(text: str) -> bool:
    """Whether a message names a held-out benchmark topic (self-written training prompts that do are dropped)."""
    return HELD_OUT_WORDS.search(text.lower()) is not None
