"""Offline instructions for self-distillation: what a user might ask an instruct model.

Built from topics crossed with task phrasings (written for quickdraft, no external data
set), plus the seed request that asks the target to write an instruction itself. The
lists are deterministic, so a job index always names the same instruction.

Two plans read them: :func:`instruction` (the first one, kept so that older shard
directories stay reproducible) cycles through topics x tasks and the code tasks by job
index; :func:`catalogue` is every distinct instruction, with the programming questions,
writing tasks and comparisons added since, in a fixed order that mixes the kinds.
None of them is one of the bench's chat prompts (``tests/test_selfdistill.py`` checks).
"""

from __future__ import annotations

import hashlib
from functools import cache

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

#: Things a programmer asks how to do ("How do I ... in Python?").
PYTHON_HOWTOS = (
    "sort a dictionary by its values", "read a JSON file", "write a list of dictionaries to a JSON file",
    "remove whitespace from the ends of a string", "split a string on commas", "join a list of strings",
    "find the index of an item in a list", "count the items in a list that match a condition",
    "copy a list without changing the original", "merge two dictionaries", "get the current date and time",
    "format a number with two decimal places", "convert a string to an integer safely",
    "check whether a file exists", "list all files in a folder", "read a text file line by line",
    "append a line to a text file", "make an HTTP GET request", "parse command-line arguments",
    "measure how long a piece of code takes", "generate a random number between 1 and 100",
    "shuffle a list", "remove an item from a dictionary", "iterate over a dictionary's keys and values",
    "find the most common element in a list", "convert a list to a set", "handle a division by zero error",
    "write a unit test for a function", "create a virtual environment", "install a package with pip",
    "use a list comprehension to square numbers", "sort a list of tuples by the second element",
    "find duplicates in a list", "check whether a string contains a substring", "replace text in a string",
    "convert a string to lowercase", "get the last element of a list", "create a class with a constructor",
    "use a lambda function with map", "read an environment variable", "download a file from a URL",
    "pause a program for two seconds", "round a number to the nearest integer", "transpose a matrix",
    "flatten a list of lists", "zip two lists together", "find the length of a string",
    "check the type of a variable", "use a try and except block", "write to a CSV file",
)
HOWTO_PHRASINGS = ("How do I {a} in Python?", "How can I {a} in Python?", "What is the easiest way to {a} in Python?")

#: More small functions to write.
FUNCTION_TASKS = (
    "returns the sum of the even numbers in a list", "checks whether two strings are anagrams",
    "returns the second largest number in a list", "converts a list of words to title case",
    "computes the average of a list of numbers", "returns the greatest common divisor of two numbers",
    "checks whether a year is a leap year", "counts the vowels in a string", "returns the n-th triangular number",
    "finds the longest word in a sentence", "rotates a list by k positions", "returns the prime factors of a number",
    "checks whether a list is sorted", "returns the intersection of two lists", "converts binary to decimal",
    "converts a number to Roman numerals", "returns the digits of a number as a list",
    "capitalizes every other letter of a string", "groups a list of words by their first letter",
    "computes the power of a number without using the ** operator", "removes the vowels from a string",
    "returns the median of a list", "checks whether brackets in a string are balanced",
    "returns a dictionary of word counts for a text", "computes compound interest",
    "generates a random password", "returns the squares of the numbers from 1 to n",
    "finds the missing number in a list from 1 to n", "checks whether a number is a perfect square",
    "splits a list into chunks of size n",
)
FUNCTION_PHRASINGS = ("Write a Python function that {f}.", "Can you write a Python function that {f}?")

#: Pairs people ask to be told apart.
COMPARISONS = (
    ("a for loop", "a while loop"), ("a function", "a method"), ("a class", "an object"),
    ("a dictionary", "a set"), ("is", "== in Python"), ("a compiler", "an interpreter"),
    ("RAM", "storage"), ("HTTP", "HTTPS"), ("a process", "a thread"), ("SQL", "NoSQL databases"),
    ("weather", "climate"), ("a virus", "a bacterium"), ("speed", "velocity"), ("mass", "weight"),
    ("a stack", "a queue"), ("git merge", "git rebase"), ("frontend", "backend development"),
    ("an array", "a linked list"), ("machine learning", "deep learning"), ("a latte", "a cappuccino"),
    ("stocks", "bonds"), ("a simile", "a metaphor"), ("affect", "effect"), ("renting", "buying a home"),
    ("TCP", "UDP"), ("static", "dynamic typing"), ("a library", "a framework"), ("AC", "DC electricity"),
)
COMPARISON_PHRASINGS = ("What is the difference between {a} and {b}?", "Explain the difference between {a} and {b}.")

#: Things people want advice on.
TIP_SUBJECTS = (
    "getting better sleep", "writing clean code", "learning to program", "preparing for an exam",
    "keeping a houseplant alive", "running a good meeting", "reading more books", "eating healthier",
    "staying productive when working from home", "making friends in a new city", "debugging a program",
    "giving a presentation", "saving money on groceries", "starting a small business", "learning to cook",
    "staying motivated at the gym", "writing a good essay", "managing stress at work", "packing for a trip",
    "taking better photos with a phone", "keeping a tidy desk", "learning to play the guitar",
    "drinking more water", "writing good commit messages", "naming variables in code",
)
TIP_PHRASINGS = ("Give me three tips for {s}.", "What are some good tips for {s}?")

#: Short writing tasks.
WRITING_TASKS = (
    "Write a short thank-you note to a friend who helped me move.",
    "Write a polite email asking my manager for a day off next week.",
    "Write a short birthday message for my sister.",
    "Write a friendly reminder to my team about tomorrow's deadline.",
    "Write a short welcome message for a new colleague.",
    "Write an email to a customer apologizing for a late delivery.",
    "Write a short product description for a reusable water bottle.",
    "Write a short cover letter for a junior developer position.",
    "Write a message congratulating a friend on their new job.",
    "Write a short speech for a friend's wedding toast.",
    "Write a short review of a coffee shop.",
    "Write a text message rescheduling a dinner with a friend.",
    "Write an email asking a professor for a recommendation letter.",
    "Write a short announcement that the office will be closed on Monday.",
    "Write a short note to my neighbor about a package I received for them.",
    "Write a short motivational message for someone starting a new course.",
    "Write a polite message declining an invitation to a party.",
    "Write a short introduction of myself for an online class.",
    "Write a short story about a robot that learns to paint.",
    "Write a haiku about the morning.",
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


def _mixed(texts: list[str]) -> tuple[str, ...]:
    """A fixed order that mixes the kinds (by a hash of the text, not Python's salted ``hash``)."""
    return tuple(sorted(set(texts), key=lambda t: hashlib.sha256(t.encode()).hexdigest()))


@cache
def catalogue() -> tuple[str, ...]:
    """Every distinct built-in instruction, in a fixed mixed order (the ``catalogue`` plan:
    the n-th chat job of a directory asks the n-th). Frozen: directories made with it
    (data/selfdistill/smollm2-135m-greedy2) resume by position, so more instructions need
    a plan of their own, recorded in ``selfdistill.json`` beside ``catalogue``."""
    texts = [task.format(t=topic) for topic in TOPICS for task in TASKS]
    texts += CODE_TASKS
    texts += [p.format(a=a) for a in PYTHON_HOWTOS for p in HOWTO_PHRASINGS]
    texts += [p.format(f=f) for f in FUNCTION_TASKS for p in FUNCTION_PHRASINGS]
    texts += [p.format(a=a, b=b) for a, b in COMPARISONS for p in COMPARISON_PHRASINGS]
    texts += [p.format(s=s) for s in TIP_SUBJECTS for p in TIP_PHRASINGS]
    texts += WRITING_TASKS
    return _mixed(texts)
