"""Offline two-turn chat prompts in MT-Bench's eight categories, built from task templates and seed topics.

MT-Bench ships 80 questions, and its held-out part must stay unseen, which leaves about 60 chat prompts to train
on. This source writes more of the same kind: each record is one first-turn template of a category (writing,
roleplay, reasoning, math, coding, extraction, STEM, humanities) filled with a seed topic or with numbers drawn
from the record's hash, and one follow-up turn that asks to rework the answer, as MT-Bench's second turns do.
The templates and topics below were written for this project; nothing is copied from MT-Bench. The set is
fixed and sorted by a hash of the record id, so a `limit` takes an even spread of templates and topics.
"""

from __future__ import annotations

import hashlib

TOPICS = (
    "a small coffee shop",
    "remote work",
    "urban gardening",
    "electric cars",
    "a trip to Japan",
    "learning a new language",
    "public libraries",
    "the history of the printing press",
    "climate change",
    "healthy breakfast habits",
    "a local music festival",
    "online privacy",
    "volunteering",
    "a new smartphone",
    "recycling at home",
    "the first day at a new job",
    "space exploration",
    "a family reunion",
    "saving money on groceries",
    "a rainy weekend",
    "the benefits of walking",
    "social media and teenagers",
    "a neighborhood bakery",
    "time management for students",
    "an art museum visit",
    "the ocean",
    "a board game night",
    "public transport",
    "renewable energy",
    "a job interview",
    "a birthday surprise",
    "the importance of sleep",
    "a mountain hike",
    "starting a podcast",
    "a science fair project",
    "open-source software",
    "a lost dog",
    "a city marathon",
    "home cooking",
    "artificial intelligence in schools",
    "a vintage bicycle",
    "the Roman Empire",
    "a camping trip",
    "a customer complaint",
    "a team project at work",
    "a winter holiday",
    "bees and pollination",
    "the invention of the telephone",
    "a small business website",
    "mindfulness",
    "a chess tournament",
    "a road trip across Canada",
    "water conservation",
    "a new gym membership",
    "an old lighthouse",
    "the solar system",
    "a school garden",
    "a charity bake sale",
    "working night shifts",
    "a train journey",
    "the Renaissance",
    "online shopping",
    "a photography class",
    "a rooftop party",
    "street food in Mexico City",
    "a library book club",
    "electric scooters",
    "a wedding speech",
    "the water cycle",
    "a robot vacuum cleaner",
    "ancient Egypt",
    "a first apartment",
    "learning to swim",
    "the stock market",
    "a flower shop",
    "a video game launch",
    "the importance of vaccines",
    "a power outage",
    "a farmers market",
    "a cooking competition",
    "a museum of natural history",
    "a startup pitch",
    "the Industrial Revolution",
    "a desert road trip",
    "a tiny house",
    "a high school reunion",
    "digital note-taking",
    "a theater premiere",
    "a snowstorm",
    "a pet adoption center",
    "the human heart",
    "a summer internship",
    "an island vacation",
    "the moon landing",
    "a local election",
    "a violin lesson",
    "a company picnic",
    "a broken laptop",
    "a new restaurant menu",
    "a yoga retreat",
    "the French Revolution",
    "a community cleanup",
    "a meteor shower",
    "a used car purchase",
)

FIRST_TURNS = {
    "writing": (
        "Compose an engaging blog post about {topic}, highlighting personal experiences and practical tips.",
        "Draft a professional email to your manager about {topic}. Keep it concise and polite.",
        "Write a short story of about 200 words that begins with {topic}.",
        "Write a persuasive paragraph for a newsletter that convinces readers to care about {topic}.",
        "Write a product description or announcement related to {topic} for a company website.",
    ),
    "roleplay": (
        "Pretend you are a tour guide. Introduce a group of visitors to {topic} in a lively way.",
        "Act as a friendly customer support agent. A customer writes to you about {topic}. Reply to them.",
        "Imagine you are a famous scientist giving a short interview about {topic}. Answer the first question: "
        "why does it matter?",
        "You are a teacher explaining {topic} to a class of ten-year-olds. What do you say?",
    ),
    "reasoning": (
        "Give three arguments for and three arguments against {topic}, then weigh them and reach a conclusion.",
        "A friend claims that {topic} is always a waste of time. Analyze the claim step by step and point out any "
        "flaws in the reasoning.",
        "If everyone in a town suddenly started caring about {topic}, what would change over the next year? "
        "Reason about the likely effects.",
    ),
    "math": (
        "Solve for x: {a}x + {b} = {c}. Show each step.",
        "A shop sells notebooks for ${a} each and pens for ${b} each. Sam buys {c} notebooks and twice as many pens. "
        "How much does Sam pay? Explain your reasoning.",
        "Given f(x) = {a}x^2 - {b}x + {c}, find f(2) and f(-1).",
        "A train travels {a}0 km in {b} hours. At the same speed, how far does it travel in {c} hours?",
        "What is the probability of rolling a sum of {s} with two fair six-sided dice? Explain.",
    ),
    "coding": (
        "Write a Python program that keeps a simple record of {topic}: add entries, list them and search them.",
        "Write a function in Python that returns the {a} largest numbers of a list without sorting the whole list. "
        "Explain its time complexity.",
        "Implement a Python class that models {topic} with at least three methods, and show how to use it.",
        "Write a Python function that counts how often each word occurs in a text and returns the {a} most common.",
    ),
    "extraction": (
        "Extract the names, dates and places from the following note and return them as JSON: "
        '"On {b} May, Ana and Luis met in Lisbon to plan {topic}; they will meet again in Porto on {c} June."',
        'Summarize the following review in one sentence and rate its sentiment from 1 to 5: "I tried {topic} '
        'last week. Some parts were great, others disappointing, and I am not sure I would do it again."',
        'Read this message and list every task it asks for: "Please book a room for {topic}, invite the team, '
        'order lunch for {a} people and send the agenda by Friday."',
    ),
    "stem": (
        "Explain the science behind {topic} in simple terms, with an everyday example.",
        "What are the main technical challenges related to {topic}, and how might engineers address them?",
        "Describe how you would design a small experiment to learn something about {topic}.",
    ),
    "humanities": (
        "Discuss the cultural and historical significance of {topic}.",
        "How has {topic} changed the way people live, work or think? Give concrete examples.",
        "Write a short essay comparing two different perspectives on {topic}.",
    ),
}

FOLLOWUPS = (
    "Rewrite your previous response in exactly three sentences.",
    "Now summarize your answer as a bulleted list of key points.",
    "Rephrase your previous answer so that a child could understand it.",
    "Make your previous response more formal, as if for a business report.",
    "Add a concrete example to your previous answer.",
    "Now explain the weakest part of your answer and how to improve it.",
    "Rewrite your previous response as a short poem.",
    "Give your previous answer a title and shorten it to under 100 words.",
    "What would someone who disagrees with you say? Respond to them.",
    "Translate the main idea of your answer into a tweet of at most 280 characters.",
)


def _pick(key: str, n: int) -> int:
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % n


def seed_prompts() -> list[tuple[str, str, str]]:
    """(record id, first turn, follow-up turn), every template x topic, in a fixed hash order."""
    out = []
    for category, templates in FIRST_TURNS.items():
        for t, template in enumerate(templates):
            for topic in TOPICS:
                key = f"{category}/{t}/{topic}"
                a, b, c = 2 + _pick(key + "a", 9), 1 + _pick(key + "b", 20), 10 + _pick(key + "c", 40)
                text = template.format(topic=topic, a=a, b=b, c=c, s=2 + _pick(key + "s", 11))
                out.append((key, text, FOLLOWUPS[_pick(key + "f", len(FOLLOWUPS))]))
    # math prompts do not use the topic; keep one per distinct text
    seen, unique = set(), []
    for record in out:
        if record[1] not in seen:
            seen.add(record[1])
            unique.append(record)
    return sorted(unique, key=lambda r: hashlib.sha256(r[0].encode()).hexdigest())
