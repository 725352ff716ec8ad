"""Generation A/B in one process: bfloat16-valued weights stored as float32 (before session
25) vs as bfloat16 (the same results bit for bit), for plain decoding, the draft model at
k=8 and an EAGLE chain of 8, alternating, on the bench's quick prompts, 3 rounds:

    python docs/bench/weights_ab.py

Prints, per category, each storage's plain tokens/s and the two methods' speedups over
plain decoding with the same storage, then plain decoding's bf16 / f32 speed.
"""

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))
from step_ab import weight_ways  # noqa: E402

from quickdraft.generator import DraftOptions, SpeculativeGenerator  # noqa: E402

gens = {'ar': SpeculativeGenerator.from_pretrained(method='ar'),
        'draft': SpeculativeGenerator.from_pretrained(method='draft'),
        'eagle': SpeculativeGenerator.from_pretrained(method='eagle', options=DraftOptions(tree='1,1,1,1,1,1,1,1'))}
# each generator's target (and draft model): its switches to float32 and to 16-bit (bfloat16) weights
ways = {m: [weight_ways(lm.model) for lm in (g.target, g.draft) if lm is not None] for m, g in gens.items()}


def use(m, which):
    for switches in ways[m]:
        dict(switches)[which]()


prompts = [json.loads(line) for c in ('short', 'long', 'out-of-domain')
           for line in open(ROOT / 'quickdraft' / 'assets' / 'bench' / f'{c}.jsonl')]
ids = {'short': ['function-body-1','repetitive-1'], 'long': ['long-function-body-1','long-repetitive-1'], 'out-of-domain': ['ood-short-function-body-1','ood-long-function-body-1']}
byid = {p['id']: p['prompt'] for p in prompts}
res = {}
for rep in range(3):
    for cat, pids in ids.items():
        for pid in pids:
            for which in (('float32','16-bit') if rep % 2 == 0 else ('16-bit','float32')):
                for m, g in gens.items():
                    use(m, which)
                    out = g.generate(byid[pid], max_new_tokens=128, num_speculative_tokens=8)
                    res.setdefault((cat, which, m), []).append(out.stats.new_tokens / out.stats.decode_seconds)
for cat in ids:
    line = [cat]
    for which in ('float32', '16-bit'):
        ar = statistics.median(res[(cat, which, 'ar')])
        line.append(f"{which}: ar {ar:.0f} tok/s, draft {statistics.median(res[(cat, which, 'draft')]) / ar:.2f}x, eagle {statistics.median(res[(cat, which, 'eagle')]) / ar:.2f}x")
    line.append(f"ar bf16/f32 {statistics.median(res[(cat,'16-bit','ar')]) / statistics.median(res[(cat,'float32','ar')]):.2f}x")
    print(' | '.join(line), flush=True)
