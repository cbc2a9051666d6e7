"""Our own instruction templates: prompts for the teacher to answer (topics, passages to summarise or modernise) and
conversations whose answers are exact by construction (arithmetic, ordering, lists, repetition, small talk)."""

from __future__ import annotations

import random
import re
from typing import Any

TOPICS = re.split(
    r",\s*",
    """the sun, the moon, the ocean, rain, snow, a forest, a river, mountains, a desert, the wind, autumn, spring,
summer, winter, a garden, a city, a village, a library, a school, a hospital, a farm, a bakery, a market, a museum,
a train station, an airport, a bridge, a lighthouse, a castle, a ship, a bicycle, a car, a bus, a plane, a computer,
the internet, a phone, a book, a letter, a newspaper, music, a piano, a guitar, painting, a poem, a song, a story,
friendship, kindness, courage, honesty, patience, hope, fear, happiness, sleep, dreams, breakfast, bread, apples,
coffee, tea, water, fire, electricity, the stars, planets, the weather, a storm, a rainbow, clouds, birds, dogs, cats,
horses, bees, fish, whales, elephants, lions, trees, flowers, grass, seeds, a mountain lake, the night sky, a holiday,
a birthday, a wedding, a journey, a map, a clock, time, money, work, a teacher, a doctor, a farmer, a baker,
a scientist, an artist, a king, a queen, a knight, a sailor, a child, a grandmother, a neighbour, exercise, walking,
running, swimming, cooking, reading, writing, learning, mathematics, history, science, language, games, football,
chess, a puzzle, a mystery, a festival, a candle, a window, a door, a key, a chair, shoes, a coat, an umbrella,
a mirror, the sea shore, islands, volcanoes, earthquakes, recycling, saving energy, good manners, a quiet morning,
a busy street, the first day of school, a lost dog, an old house, a new friend, a rainy afternoon, a long walk""",
)

CATEGORIES = {
    "fruits": ["apple", "banana", "cherry", "grape", "orange", "pear", "plum", "peach", "mango", "lemon"],
    "colours": ["red", "blue", "green", "yellow", "orange", "purple", "black", "white", "brown", "pink"],
    "animals": ["dog", "cat", "horse", "cow", "sheep", "lion", "tiger", "elephant", "rabbit", "fox"],
    "vegetables": ["carrot", "potato", "onion", "pea", "bean", "cabbage", "lettuce", "tomato", "pepper", "leek"],
    "birds": ["robin", "sparrow", "eagle", "owl", "swan", "duck", "crow", "pigeon", "parrot", "hawk"],
    "musical instruments": ["piano", "guitar", "violin", "flute", "drum", "trumpet", "harp", "cello", "clarinet"],
    "countries": ["France", "Spain", "Italy", "Japan", "Brazil", "Canada", "Egypt", "India", "Kenya", "Mexico"],
    "things in a kitchen": ["a kettle", "a pan", "a knife", "a spoon", "a plate", "a cup", "an oven", "a sink"],
    "days of the week": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
    "planets": ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"],
    "sports": ["football", "tennis", "swimming", "running", "cycling", "basketball", "cricket", "rowing"],
    "jobs": ["teacher", "doctor", "nurse", "farmer", "baker", "builder", "pilot", "driver", "cook", "painter"],
}

OPPOSITES = [("hot", "cold"), ("big", "small"), ("fast", "slow"), ("happy", "sad"), ("light", "dark"),
             ("old", "young"), ("up", "down"), ("open", "closed"), ("early", "late"), ("full", "empty"),
             ("strong", "weak"), ("tall", "short"), ("wet", "dry"), ("loud", "quiet"), ("rich", "poor"),
             ("hard", "soft"), ("near", "far"), ("first", "last"), ("true", "false"), ("day", "night")]  # fmt: skip

MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]  # fmt: skip
DAYS = CATEGORIES["days of the week"]

SMALL_TALK = [
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi there.", "Hi! What would you like to talk about?"),
    ("Good morning!", "Good morning! I hope your day is off to a good start. How can I help?"),
    ("Thank you.", "You're welcome! Let me know if there is anything else I can do."),
    ("Thanks a lot!", "Happy to help!"),
    ("Who are you?", "I am a small language model. I can answer simple questions and follow short instructions."),
    ("What can you do?", "I can write short texts, answer simple questions, do small sums and follow instructions."),
    ("Goodbye.", "Goodbye! Have a nice day."),
    ("How are you?", "I'm doing well, thank you for asking. How can I help you?"),
]

TEACHER_TEMPLATES = [
    "Write a sentence about {topic}.",
    "Write two sentences about {topic}.",
    "Write a short paragraph about {topic}.",
    "Explain what {topic} is in simple words.",
    "Give me three facts about {topic}.",
    "Why is {topic} important?",
    "Write a short poem about {topic}.",
    "Describe {topic} to a child.",
    "Write a short story about {topic}.",
    "What do people like about {topic}?",
    "Give one tip about {topic}.",
    "Write a title for an essay about {topic}.",
    "Write a question a student might ask about {topic}, and answer it.",
    "Compare {topic} and {other} in two sentences.",
    "What is the difference between {topic} and {other}?",
    "Write a friendly note to a friend about {topic}.",
]

PASSAGE_TEMPLATES = [
    "Summarise in one sentence:\n\n{passage}",
    "Translate to plain modern English:\n\n{passage}",
    "Explain what this passage means:\n\n{passage}",
    "What is the main idea of this text?\n\n{passage}",
]


def _short_passages(texts: list[str], rng: random.Random, count: int) -> list[str]:
    """`count` passages of 2-6 consecutive non-empty lines (about 100-500 characters) from the given texts."""
    passages = []
    for _ in range(count * 3):
        lines = [line.strip() for line in rng.choice(texts).splitlines() if len(line.strip()) > 20]
        if len(lines) < 2:
            continue
        start = rng.randrange(len(lines))
        passage = " ".join(lines[start : start + rng.randint(2, 6)])
        passage = re.sub(r"\s+", " ", passage)
        if 100 <= len(passage) <= 600:
            passages.append(passage)
        if len(passages) == count:
            break
    return passages


def teacher_prompts(rng: random.Random, texts: list[str], num_passage_prompts: int = 12000) -> list[str]:
    """Every topic template for every topic (other topics drawn at random), plus passage tasks over `texts`."""
    prompts = []
    for template in TEACHER_TEMPLATES:
        for topic in TOPICS:
            prompts.append(template.format(topic=topic, other=rng.choice([t for t in TOPICS if t != topic])))
    for name in CATEGORIES:
        prompts.append(f"Name some {name} and say one thing about each.")
    for passage in _short_passages(texts, rng, num_passage_prompts):
        prompts.append(rng.choice(PASSAGE_TEMPLATES).format(passage=passage))
    rng.shuffle(prompts)
    return prompts


def _chat(user: str, assistant: str) -> dict[str, Any]:
    return {"source": "template", "messages": [{"role": "user", "content": user},
                                               {"role": "assistant", "content": assistant}]}  # fmt: skip


def exact_conversations(rng: random.Random, count: int = 12000) -> list[dict[str, Any]]:
    """Conversations whose answers follow from the question: sums, comparisons, orderings, lists, repeats."""

    def arithmetic() -> tuple[str, str]:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice(["+", "-", "*"])
        if op == "*":
            a, b = rng.randint(0, 12), rng.randint(0, 12)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        word = {"+": "plus", "-": "minus", "*": "times"}[op]
        question = rng.choice([f"What is {a} {op} {b}?", f"What is {a} {word} {b}?", f"Calculate {a} {op} {b}."])
        return question, f"{a} {op} {b} = {value}."

    def larger() -> tuple[str, str]:
        a, b = rng.sample(range(1000), 2)
        return f"Which is larger, {a} or {b}?", f"{max(a, b)} is larger than {min(a, b)}."

    def sort_numbers() -> tuple[str, str]:
        numbers = rng.sample(range(100), rng.randint(3, 6))
        ordered = ", ".join(map(str, sorted(numbers)))
        return f"Sort these numbers from smallest to largest: {', '.join(map(str, numbers))}.", ordered + "."

    def count_up() -> tuple[str, str]:
        a = rng.randint(1, 50)
        b = a + rng.randint(2, 9)
        return f"Count from {a} to {b}.", ", ".join(str(i) for i in range(a, b + 1)) + "."

    def list_items() -> tuple[str, str]:
        name, items = rng.choice(list(CATEGORIES.items()))
        n = rng.randint(2, min(5, len(items)))
        chosen = rng.sample(items, n)
        number = ["two", "three", "four", "five"][n - 2]
        answer = "\n".join(f"{i + 1}. {item[0].upper() + item[1:]}" for i, item in enumerate(chosen))
        return f"List {number} {name}.", f"Here are {number} {name}:\n{answer}"

    def opposite() -> tuple[str, str]:
        a, b = rng.choice(OPPOSITES)
        a, b = (a, b) if rng.random() < 0.5 else (b, a)
        return f'What is the opposite of "{a}"?', f'The opposite of "{a}" is "{b}".'

    def next_in_sequence() -> tuple[str, str]:
        names, kind = (MONTHS, "month") if rng.random() < 0.5 else (DAYS, "day")
        i = rng.randrange(len(names))
        return f"Which {kind} comes after {names[i]}?", f"{names[(i + 1) % len(names)]} comes after {names[i]}."

    def repeat() -> tuple[str, str]:
        topic = rng.choice(TOPICS)
        sentence = f"I would like to learn more about {topic}."
        return f"Repeat this sentence exactly: {sentence}", sentence

    def uppercase() -> tuple[str, str]:
        words = " ".join(rng.sample([w for items in CATEGORIES.values() for w in items], 3))
        return f"Write this in capital letters: {words}", words.upper()

    def small_talk() -> tuple[str, str]:
        return rng.choice(SMALL_TALK)

    families = [arithmetic, larger, sort_numbers, count_up, list_items, opposite, next_in_sequence, repeat,
                uppercase, small_talk]  # fmt: skip
    return [_chat(*rng.choice(families)()) for _ in range(count)]
