"""What ``quickdraft serve`` decodes with, in one process: the batched engine of each method
as the server builds it (k: the one the server settles, ``SpeculativeGenerator.resolve_k``,
so the cost model's for eagle), at several batch sizes, on the bench's chat and code prompts.

    python docs/bench/serve_engines_ab.py [--model smollm2-135m] [--sizes 1,4,8] [ar eagle hybrid-eagle eagle@fixed]

A head method's engine decodes plainly with several rows where its steps measure that
faster, as the server's does without -k (``PlainWhenFaster``); ``METHOD@fixed`` is the
same engine drafting its k at every step (the server with -k).

Per category and batch size B, every method decodes the same requests (the category's
prompts, cycled to at least B of them, or to ``--requests``; chats through the model's template, ending at its
end-of-turn token) with at most B rows at a time, the methods' order turning from repeat
to repeat; greedy outputs must be identical. Prints tokens/s (new tokens of all requests
over the wall time, prefill passes left out), each method's ratio over the first one
measured beside it, and the mean k of its steps. Take the CPU lock first (``flock /tmp/quickdraft-cpu.lock``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's quickdraft
from quickdraft import SpeculativeGenerator  # noqa: E402
from quickdraft.batch_generate import make_batch_engine  # noqa: E402
from quickdraft.bench.prompt_sets import build_code, category_file  # noqa: E402
from quickdraft.bench.prompts import load_prompts  # noqa: E402
from quickdraft.chat import chat_prompt_ids, end_of_turn_ids  # noqa: E402
from quickdraft.decoding.batch_engine import MAX_BATCH_K  # noqa: E402
from quickdraft.decoding.sampling import SamplingParams  # noqa: E402
from quickdraft.decoding.stopping import StopConditions  # noqa: E402


def decode_all(engine, requests: list[torch.Tensor], max_new_tokens: int, eos: list[int]):
    """Every request through ``engine``: (tokens per request, seconds outside prefill, the
    mean k of its steps)."""
    waiting, rows = list(range(len(requests))), {}
    out: list[list[int]] = [[] for _ in requests]
    ks: list[int] = []
    prefill, started = engine.prefill_seconds, time.perf_counter()
    while waiting or engine.active:
        while waiting and engine.free_slots:
            i = waiting.pop(0)
            rows[engine.add(requests[i], SamplingParams(), StopConditions(max_new_tokens, eos))] = i
        updates = engine.step()
        ks.append(engine.last_k or 0)
        for row, update in updates.items():
            out[rows[row]].extend(update.tokens)
    return out, time.perf_counter() - started - (engine.prefill_seconds - prefill), sum(ks) / max(1, len(ks))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("methods", nargs="*", default=["ar", "eagle", "hybrid-eagle"])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--sizes", default="1,4,8")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=0,
                        help="requests per category and run (default: its prompts, at least B): more keep "
                             "the batch full, as a loaded server's is")
    args = parser.parse_args()
    torch.set_num_threads(2)
    loaded: dict[str, SpeculativeGenerator] = {}
    for m in args.methods:
        method = m.removesuffix("@fixed")
        if method not in loaded:
            loaded[method] = SpeculativeGenerator.from_pretrained(args.model, method=method)
    gens = {m: loaded[m.removesuffix("@fixed")] for m in args.methods}
    ks = {m: gen.resolve_k()[0] if m != "ar" else 0 for m, gen in gens.items()}
    tok = next(iter(gens.values())).tokenizer
    eos = list(dict.fromkeys([*next(iter(gens.values())).eos_token_ids, *end_of_turn_ids(tok)]))
    categories = {
        "chat": [torch.tensor(chat_prompt_ids(tok, p.messages)) for p in load_prompts(category_file("chat"))],
        "code": [torch.tensor(tok(p.prompt)["input_ids"]) for p in build_code()],
    }
    longest = max(ids.numel() for ids in sum(categories.values(), [])) + args.max_new_tokens + MAX_BATCH_K + 2
    print(f"k: {', '.join(f'{m} {k}' for m, k in ks.items())}")
    for b in (int(s) for s in args.sizes.split(",")):
        engines = {m: make_batch_engine(gen.target, m.removesuffix("@fixed"), gen.draft, max_batch_size=b,
                                        max_len=longest, num_speculative_tokens=ks[m], options=gen.plan.options,
                                        plain_when_faster=not m.endswith("@fixed"))
                   for m, gen in gens.items()}
        for category, prompts in categories.items():
            requests = [prompts[i % len(prompts)] for i in range(args.requests or max(b, len(prompts)))]
            seconds, tokens, mean_k = dict.fromkeys(engines, 0.0), dict.fromkeys(engines, 0), {}
            for repeat in range(args.repeats):
                order = list(engines)[repeat % len(engines):] + list(engines)[: repeat % len(engines)]
                expected = None
                for m in order:
                    out, spent, mean_k[m] = decode_all(engines[m], requests, args.max_new_tokens, eos)
                    if expected is not None and out != expected:
                        raise SystemExit(f"{m} changed the output at batch {b} ({category})")
                    expected = out
                    seconds[m] += spent
                    tokens[m] += sum(map(len, out))
            rates = {m: tokens[m] / seconds[m] for m in engines}
            base = rates[args.methods[0]]
            print(f"{category:5} B={b}: " + "  ".join(f"{m} {r:6.1f} tok/s ({r / base:.2f}x, k {mean_k[m]:.1f})"
                                                   for m, r in rates.items()), flush=True)


if __name__ == "__main__":
    main()
