"""Recycling A/B (lucidrains todo): train the exit loss with the last cached (final-layer)
embedding randomly summed back into the head's input, at a random offset (the crop), vs
the same head without it; same steps, data, seed. Held-out greedy agreement by offset."""

import json
import sys

import torch
from torch import nn

from quickdraft.models.exit_head import ExitHead
from quickdraft.train.data import eval_windows, sample_batch
from quickdraft.train.distill import tokenize
from quickdraft.train.exit_head import load_native_teacher
from quickdraft.train.presets import Stage
from quickdraft.train.textdata import read_text_data
from quickdraft.train.trainer import distill_objective, lr_at, make_optimizer

L, K, STEPS, B, T = 4, 4, int(sys.argv[1]), 2, 256
torch.set_num_threads(2)
target, tdir, tok = load_native_teacher("qd-stdlib-target")
data = tokenize(read_text_data(["stdlib"]), tok, T)


class RecycleHead(ExitHead):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.recycler = nn.Linear(self.block_config.hidden_size, self.block_config.hidden_size, bias=False)
        nn.init.zeros_(self.recycler.weight)

    def forward_logits(self, h, recycled, positions):
        if recycled is not None:
            h = h + self.recycler(recycled)
        return self.logits(self.transform(h, target, positions, None), target)


cache = target.new_cache(B, T)


@torch.no_grad()
def target_pass(tokens):
    bsz, n = tokens.shape
    c = cache if bsz == B and n <= T else target.new_cache(bsz, n)
    positions = torch.arange(n)[None].expand(bsz, -1)
    out = target(tokens, positions, c, output_hidden_states=[L])
    return out.logits, out.hidden_states[L], out.hidden, positions


def shifted(final, offset):
    """final[t - offset] at position t (zeros before the start)."""
    out = torch.zeros_like(final)
    out[:, offset:] = final[:, :-offset]
    return out


def run(recycle: bool, seed=0):
    torch.manual_seed(seed)
    head = RecycleHead(target.config, L).init_from(target)
    if not recycle:
        head.recycler = None
    stage = Stage(steps=STEPS, batch_size=B, lr=1e-3, warmup=10)
    opt = make_optimizer(head, stage)
    gen = torch.Generator().manual_seed(seed)
    for step in range(STEPS):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, stage)
        batch = sample_batch(data.train, B, T, seed, step)
        inp, labels = batch[:, :-1], batch[:, 1:]
        t_logits, h, final, positions = target_pass(inp)
        rec = None
        if recycle and torch.rand((), generator=gen) < 0.5:  # randomly summed back
            offsets = torch.randint(1, K + 1, (B, 1, 1), generator=gen)  # random crop per window
            rec = torch.stack([shifted(final[i : i + 1], int(offsets[i]))[0] for i in range(B)])
        loss, _ = distill_objective(t_logits, head.forward_logits(h, rec, positions), labels, 1.0, 0.1)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
    head.eval()
    agree = {o: 0 for o in ["none", 1, 2, 3, 4]}
    n = 0
    with torch.no_grad():
        for w in eval_windows(data.heldout, T, 8192):
            inp = w[:, :-1]
            t_logits, h, final, positions = target_pass(inp)
            want = t_logits.argmax(-1)
            n += want.numel()
            agree["none"] += (head.forward_logits(h, None, positions).argmax(-1) == want).sum().item()
            if recycle:
                for o in (1, 2, 3, 4):
                    got = head.forward_logits(h, shifted(final, o), positions).argmax(-1)
                    agree[o] += (got == want).sum().item()
    return {str(k): v / n for k, v in agree.items() if v or k == "none"}, n


res = {"baseline": run(False), "recycle": run(True)}
print(json.dumps({"steps": STEPS, "batch": [B, T], "exit_layer": L, **res}, indent=1))

