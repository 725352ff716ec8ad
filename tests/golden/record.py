"""Greedy outputs of every method on a fixed prompt set (embedded models), as JSON."""
import json
import sys

from quickdraft.generator import SpeculativeGenerator

PROMPTS = ["def median(values):", "import os\n\n\ndef walk(root):\n", "class Stack:\n    def __init__(self):\n", "x = 1\n"]
METHODS = ["ar", "draft", "ngram", "tree", "multi-draft", "hybrid", "layer-skip", "early-exit", "auto"]
out = {}
for m in METHODS:
    gen = SpeculativeGenerator.from_pretrained(method=m)
    out[m] = [gen.generate(p, max_new_tokens=40).token_ids for p in PROMPTS]
    print(m, file=sys.stderr)
json.dump({"prompts": PROMPTS, "max_new_tokens": 40, "outputs": out}, open(sys.argv[1], "w"), indent=0)
