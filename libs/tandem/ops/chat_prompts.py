"""The built-in synthetic chat set for `tandem bench serve --dataset chat`: short and long
questions, a few with a system message or an earlier turn, so a run mixes prompt lengths the way
a chat product's traffic does. Written for Tandem; each entry is a list of chat messages."""

from __future__ import annotations

_SHORT = (
    "What is the capital of Portugal?",
    "Give me three names for a grey cat.",
    "How many minutes are there in a day?",
    "Translate 'good morning' into Spanish and German.",
    "What does HTTP stand for?",
    "Is a tomato a fruit or a vegetable?",
    "Suggest a title for a blog post about sourdough bread.",
    "What is 17 times 23?",
    "Name the planets of the solar system in order.",
    "Which is heavier, a kilogram of feathers or a kilogram of iron?",
    "Write a haiku about the sea in winter.",
    "What year did the first person walk on the Moon?",
)

_MEDIUM = (
    "I am planning a three-day walking trip in the hills in late autumn. What should I pack, and "
    "what should I leave at home to keep my bag light?",
    "Explain the difference between a list and a tuple in Python, and say when I would choose one "
    "over the other. Keep it short and give one example of each.",
    "My tomato plants have yellow leaves at the bottom but the top looks healthy. What are the likely causes, and what can I check first?",
    "Write a polite email to my landlord asking when the broken heating in the flat will be repaired. "
    "It has been two weeks since I first reported it.",
    "Compare taking the train and flying between two cities that are 600 km apart: time door to door, cost, comfort and emissions.",
    "What is a hash table, how does it handle two keys that land in the same slot, and why is lookup usually constant time?",
    "Summarise the main causes of inflation for someone who has never studied economics, in a single paragraph.",
    "I want to start running. Give me a four-week plan for a complete beginner, three sessions a week.",
    "Explain what a SQL join is and the difference between an inner join and a left join, with a tiny example of two tables.",
    "Give me a recipe for a vegetarian dinner for four people that takes less than forty minutes.",
)

_LONG = (
    "I run a small bakery with two ovens and four staff. On weekdays we sell about 300 loaves and on "
    "Saturdays nearly 700, but we often run out of the popular rye by noon while white loaves are left "
    "over at closing. Flour prices went up by a fifth this year. I would like to plan production "
    "better: how should I estimate demand per product and day, how much buffer should I bake, what "
    "should I do with the leftovers, and how can I tell whether a price rise would lose me customers? "
    "Please give a step by step approach I can run in a spreadsheet.",
    "Here is a function I wrote to merge two sorted lists, but it sometimes loses the last element:\n\n"
    "def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
    "            out.append(b[j]); j += 1\n    return out\n\n"
    "Explain what is wrong, fix it, and write three small tests that would have caught the bug.",
    "I am writing a short story set in a lighthouse on a remote island. The keeper has been alone for "
    "eleven months when a small boat washes up with nobody aboard, only a wet notebook in a language "
    "she does not know. Write the opening of the story, about three paragraphs, in a quiet and "
    "slightly uneasy tone, and end on a detail that makes the reader want to continue.",
    "Our team has a web service that answers in 40 ms at the median but 2 seconds at the 99th "
    "percentile. It reads from a database and calls two other internal services. Traffic is steady "
    "through the day. List the most likely reasons for such a long tail, how I would confirm each one "
    "with measurements, and the usual fixes, ordered from cheapest to most expensive to try.",
    "Explain how public key cryptography lets two people who have never met agree on a secret over a "
    "channel that anyone can read. Start with an analogy, then describe Diffie-Hellman with small "
    "numbers, and finish with what stops an attacker in the middle and what does not.",
)

_WITH_SYSTEM = (
    ("You are a concise assistant. Answer in at most two sentences.", "Why is the sky blue?"),
    ("You are a patient maths tutor for a twelve-year-old.", "Why can't we divide by zero?"),
    ("You answer as a helpful librarian.", "Recommend two novels for someone who loved a long fantasy series."),
    ("You are a careful code reviewer. Point out problems, then suggest a fix.", "for i in range(len(xs)): xs.remove(xs[i])"),
)

_FOLLOW_UPS = (
    ("What is the tallest mountain in Africa?", "The tallest is Kilimanjaro, in Tanzania.", "How long does it take to climb?"),
    ("Can you suggest a name for a pet tortoise?", "How about Sheldon, Pebble or Atlas?", "Something more unusual, please."),
    ("What is a prime number?", "A whole number above 1 whose only divisors are 1 and itself.", "Is 91 prime?"),
    ("How do I boil an egg?", "Put it in boiling water for 7 minutes, then cool it.", "And for a runny yolk?"),
)


def chat_set() -> list[list[dict[str, str]]]:
    """Every conversation of the set, in a fixed order (a seeded run samples from it)."""
    single = [[{"role": "user", "content": text}] for text in (*_SHORT, *_MEDIUM, *_LONG)]
    with_system = [[{"role": "system", "content": system}, {"role": "user", "content": text}] for system, text in _WITH_SYSTEM]
    follow_ups = [
        [{"role": "user", "content": q}, {"role": "assistant", "content": a}, {"role": "user", "content": next_q}]
        for q, a, next_q in _FOLLOW_UPS
    ]
    return single + with_system + follow_ups
