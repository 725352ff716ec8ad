"""Offline instructions for self-distillation: what a user might ask an instruct model.

Built from topics crossed with task phrasings (written for quickdraft, no external data
set), plus the seed request that asks the target to write an instruction itself. The
list is deterministic, so a job index always names the same instruction.
"""

from __future__ import annotations

TOPICS = (
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "compound interest",
    "machine learning", "the immune system", "climate change", "the Roman Empire", "volcanoes",
    "healthy sleep habits", "the stock market", "renewable energy", "the human heart", "gravity",
    "the internet", "vaccines", "plate tectonics", "the Renaissance", "inflation", "coral reefs",
    "electric cars", "the printing press", "DNA", "the moon landing", "recycling", "earthquakes",
    "time management", "public speaking", "learning a new language", "cooking pasta",
    "training for a marathon", "saving money", "writing a resume", "job interviews",
    "meditation", "gardening", "adopting a dog", "traveling on a budget", "baking bread",
    "Python lists", "recursion", "sorting algorithms", "binary search", "hash tables",
    "SQL joins", "git branches", "unit testing", "regular expressions", "HTTP requests",
    "object-oriented programming", "JSON", "the command line", "big-O notation",
    "linked lists", "APIs", "databases", "encryption", "operating systems", "cloud computing",
    "prime numbers", "fractions", "the Pythagorean theorem", "probability", "statistics",
    "the solar system", "dinosaurs", "the ocean", "rainforests", "bees", "the Great Wall of China",
    "ancient Egypt", "the Olympic Games", "jazz music", "Shakespeare", "impressionist painting",
    "chess", "friendship", "happiness", "teamwork", "leadership", "stress", "nutrition",
    "the electoral process", "supply and demand", "World War II", "the industrial revolution",
    "artificial intelligence", "smartphones", "social media", "electricity", "magnets",
    "the speed of light", "evolution", "the periodic table", "weather forecasts", "tea",
)

TASKS = (
    "Explain {t} in simple terms.",
    "What is {t}?",
    "Give me three interesting facts about {t}.",
    "Write a short paragraph about {t}.",
    "Explain {t} to a ten-year-old.",
    "What are the main advantages and disadvantages of {t}?",
    "Write a short poem about {t}.",
    "Summarize the key ideas of {t} in a few bullet points.",
    "Why is {t} important?",
    "What is a common misconception about {t}?",
    "Write a short story that involves {t}.",
    "How would you teach a beginner about {t}?",
    "Give me a quick quiz with three questions about {t}.",
    "Write a tweet about {t}.",
    "Compare {t} with something from everyday life.",
    "What should everyone know about {t}?",
)

CODE_TASKS = (
    "Write a Python function that reverses a string.",
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that counts the words in a sentence.",
    "Write a Python function that removes duplicates from a list while keeping the order.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that merges two sorted lists.",
    "Write a Python function that computes the factorial of a number.",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "Write a Python function that reads a CSV file and returns its rows as dictionaries.",
    "Write a Python function that finds the largest element in a list.",
    "Write a Python function that converts Celsius to Fahrenheit.",
    "Write a Python function that flattens a nested list.",
    "Write a Python function that counts how often each character appears in a string.",
    "Write a JavaScript function that capitalizes the first letter of each word.",
    "Write a SQL query that selects the ten most expensive products from a products table.",
    "Write a Python function that performs binary search on a sorted list.",
    "Write a Python function that validates an email address with a regular expression.",
    "Write a bash command that counts the lines of every .txt file in a folder.",
    "Explain what this Python code does: [x * x for x in range(10) if x % 2 == 0]",
)

#: The seed request: the target writes an instruction itself (then answers it).
SELF_INSTRUCT = ("Write one question that a curious person might ask an AI assistant about {t}. "
                 "Reply with the question only.")


def instruction(index: int) -> str:
    """The ``index``-th built-in instruction (cycling through topics x tasks, then the code
    tasks interleaved every seventh)."""
    if index % 7 == 6:
        return CODE_TASKS[(index // 7) % len(CODE_TASKS)]
    i = index - index // 7  # the plain instructions' own counter
    topic = TOPICS[i % len(TOPICS)]
    task = TASKS[(i // len(TOPICS) + i) % len(TASKS)]
    return task.format(t=topic)


def self_instruct_seed(index: int) -> str:
    """The request that makes the target write its own ``index``-th instruction."""
    return SELF_INSTRUCT.format(t=TOPICS[(index * 37) % len(TOPICS)])
