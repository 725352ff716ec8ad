"""How far a quantized target's next-token predictions move from the float32 model's,
teacher-forced on fixed text (docs/quantization.md):

    python docs/bench/quant_fidelity.py [--model smollm2-135m] [--modes none,auto] [--windows 8]

Loads the model once per ``--quantize`` mode, feeds the same windows of text (code: the
Python standard library's own sources; chat: the target's self-distilled answers in
``data/selfdistill/smollm2-135m``), and prints per mode and kind of text the mean
cross-entropy of the next token (nats) and how often its argmax equals the first mode's.
Deterministic: no timing.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

import torch

from quickdraft.generator import SpeculativeGenerator

ROOT = Path(__file__).resolve().parents[2]
CODE_FILES = ("json/decoder.py", "textwrap.py", "shlex.py", "fractions.py", "heapq.py", "bisect.py",
              "glob.py", "fnmatch.py")


def texts(windows: int) -> dict[str, list[str]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = [(stdlib / name).read_text()[:6000] for name in CODE_FILES[:windows]]
    rows = [json.loads(line) for line in open(ROOT / "data/selfdistill/smollm2-135m/shard-00003.jsonl")]
    answers = [r["text"] for r in rows if len(r["text"]) > 600]
    return {"code": code, "chat": answers[:windows]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--modes", default="none,auto")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256, help="tokens a window")
    args = parser.parse_args()
    torch.manual_seed(0)
    modes = args.modes.split(",")
    first: dict[str, list[torch.Tensor]] = {}
    for mode in modes:
        gen = SpeculativeGenerator.from_pretrained(args.model, method="ar", quantize=mode)
        lm, tokenizer = gen.target, gen.tokenizer
        for kind, docs in texts(args.windows).items():
            nll, agree, count, tops = 0.0, 0, 0, []
            for doc in docs:
                ids = torch.tensor(tokenizer(doc).input_ids[: args.tokens])
                lm.reset(len(ids))
                with torch.inference_mode():
                    logits = lm.extend(ids, logits="all").float()
                nll += torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum").item()
                top = logits[:-1].argmax(-1)
                tops.append(top)
                count += len(ids) - 1
            if mode == modes[0]:
                first[kind] = tops
            agree = sum(int((a == b).sum()) for a, b in zip(tops, first[kind]))
            print(f"{mode:>5} {kind:>4}: cross-entropy {nll / count:.4f} nats, argmax = {modes[0]}'s "
                  f"{100 * agree / count:.2f}% of {count} tokens", flush=True)


if __name__ == "__main__":
    main()
