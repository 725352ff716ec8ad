"""Training loops: the target (next-token cross-entropy) and the draft (distillation).

fp32 on CPU with ``transformers``' ``LlamaForCausalLM``, AdamW, linear warmup then cosine
decay, gradient clipping.  Batches depend only on ``(seed, step)`` and checkpoints hold the
model, the AdamW state (both safetensors) and a JSON state, so ``resume`` continues a run
exactly where the latest checkpoint left it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..models.hf_cache import forward_with_cache
from .data import batch_parts, eval_windows, masked_mean, sample_batch
from .presets import Arch, Preset, Stage

# ---------------------------------------------------------------------------- models


def llama_config(arch: Arch, vocab_size: int, max_positions: int, bos_id=0, eos_id=0,
                 pad_id=0):
    """A tied-embedding ``LlamaConfig`` of the given size."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=arch.hidden_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads or arch.num_attention_heads,
        intermediate_size=arch.intermediate_size,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )


def build_llama(config, seed: int):
    """A freshly initialised fp32 ``LlamaForCausalLM`` (init depends only on ``seed``)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def build_model(arch: Arch, preset: Preset, seed: int):
    """A model of the embedded family (its tokenizer's ``<|endoftext|>`` is id 0)."""
    return build_llama(llama_config(arch, preset.vocab_size, max(512, preset.seq_len)), seed)


def count_params(model) -> int:
    """All parameters, embeddings included (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def save_model_bf16(model, out_dir: Path, omit: tuple[str, ...] = ()) -> None:
    """``save_pretrained`` as bf16 safetensors (config.json + model.safetensors), less the
    tensors named in ``omit`` (a draft's shared embeddings: :mod:`..models.shared_embed`)."""
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    import copy

    m = copy.deepcopy(model).to(torch.bfloat16)
    m.config.dtype = torch.bfloat16
    eot = m.config.eos_token_id
    m.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)
    m.save_pretrained(str(out_dir), safe_serialization=True)
    if omit:
        from safetensors.torch import load_file, save_file

        file = out_dir / "model.safetensors"
        state = {k: v for k, v in load_file(str(file)).items() if k not in omit}
        save_file(state, str(file), metadata={"format": "pt"})
    for f in out_dir.iterdir():  # save_pretrained may create 0600 files; ship them readable
        f.chmod(0o644)


def load_model_fp32(model_dir: Path, shared: dict[str, torch.Tensor] | None = None):
    """A checkpoint as an fp32 ``transformers`` model in eval mode, through the runtime's
    loader (safetensors only, never remote code); ``shared``: tensors from its target."""
    from ..models.lm import load_hf_model

    return load_hf_model(Path(model_dir), torch.float32, shared).eval()


# ---------------------------------------------------------------------------- schedule


def lr_at(step: int, stage: Stage) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``lr * min_lr_ratio``."""
    if step < stage.warmup:
        return stage.lr * (step + 1) / stage.warmup
    span = max(1, stage.steps - stage.warmup)
    progress = min(1.0, (step - stage.warmup) / span)
    floor = stage.lr * stage.min_lr_ratio
    return floor + 0.5 * (stage.lr - floor) * (1 + math.cos(math.pi * progress))


def make_optimizer(model, stage: Stage):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:  # frozen (a draft's shared embeddings): never updated nor decayed
            continue
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": stage.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=stage.lr, betas=(0.9, 0.95), eps=1e-8,
    )


# ---------------------------------------------------------------------------- checkpoints


def _optimizer_tensors(opt) -> tuple[dict[str, torch.Tensor], list]:
    sd = opt.state_dict()
    tensors = {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            t = v if torch.is_tensor(v) else torch.tensor(v)
            tensors[f"{idx}/{k}"] = t.detach().contiguous().clone()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
              for g in sd["param_groups"]]
    return tensors, groups


def save_checkpoint(ckpt_root: Path, model, opt, state: dict, keep: int = 2) -> Path:
    """``ckpt_root/step-NNNNNN/{model,optimizer}.safetensors`` + ``state.json`` (written last)."""
    from safetensors.torch import save_file, save_model

    d = Path(ckpt_root) / f"step-{state['step']:06d}"
    d.mkdir(parents=True, exist_ok=True)
    save_model(model, str(d / "model.safetensors"))
    tensors, groups = _optimizer_tensors(opt)
    save_file(tensors, str(d / "optimizer.safetensors"))
    (d / "optimizer_groups.json").write_text(json.dumps(groups))
    tmp = d / "state.json.tmp"
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(d / "state.json")
    done = sorted(p for p in Path(ckpt_root).glob("step-*") if (p / "state.json").exists())
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return d


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    done = sorted(p for p in Path(ckpt_root).glob("step-*") if (p / "state.json").exists())
    return done[-1] if done else None


def load_checkpoint(d: Path, model, opt) -> dict:
    from safetensors.torch import load_file, load_model

    load_model(model, str(d / "model.safetensors"))
    tensors = load_file(str(d / "optimizer.safetensors"))
    groups = json.loads((d / "optimizer_groups.json").read_text())
    state: dict = {}
    for key, t in tensors.items():
        idx, k = key.split("/", 1)
        state.setdefault(int(idx), {})[k] = t
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    opt.load_state_dict({"state": state, "param_groups": groups})
    return json.loads((d / "state.json").read_text())


# ---------------------------------------------------------------------------- losses


def ce_loss(model, batch: torch.Tensor) -> tuple[torch.Tensor, dict]:
    logits = model(input_ids=batch[:, :-1]).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
    return loss, {}


def make_label_loss(rows: torch.Tensor | None = None) -> Callable:
    """Hard-label cross-entropy on the data's own next tokens: no teacher pass, so on data
    the target generated (``quickdraft train data``) it is distillation at the cost of
    plain training. With ``rows`` (a draft vocabulary, :mod:`..models.draft_vocab`) the
    head scores only those tokens and next tokens outside them are skipped: drafting never
    proposes them, and the head costs a fraction of the full vocabulary's. Given
    :class:`~.data.Windows`, next tokens that are not answers are skipped too."""
    remap = None
    if rows is not None:
        rows = rows.long()

    def loss_fn(model, batch):
        nonlocal remap
        windows, answers = batch_parts(batch)
        inp, labels = windows[:, :-1], windows[:, 1:]
        if answers is not None:
            labels = labels.masked_fill(~answers[:, 1:], -100)
        if rows is None:
            return mean_ce(model(input_ids=inp).logits, labels), {}
        head = model.get_output_embeddings().weight
        if remap is None:
            remap = torch.full((head.shape[0],), -100, dtype=torch.long)
            remap[rows] = torch.arange(rows.numel())
        hidden = model.base_model(input_ids=inp).last_hidden_state
        logits = F.linear(hidden, head[rows.to(head.device)])
        y = remap.to(labels.device)[labels.clamp(min=0)].masked_fill(labels < 0, -100)
        return mean_ce(logits, y), {"in_vocab": ((y >= 0).sum() / (labels >= 0).sum().clamp(min=1)).item()}

    return loss_fn


def mean_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``logits`` ``[..., V]`` over the ``labels`` that are not -100; 0 (no
    gradient, where PyTorch's mean gives NaN) when every one is: a window of prompts alone."""
    total = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100,
                            reduction="sum")
    return total / (labels >= 0).sum().clamp(min=1)


def make_distill_loss(teacher, kl_weight: float, ce_weight: float) -> Callable:
    """loss = kl_weight * KL(teacher || draft) + ce_weight * CE, temperature 1; given
    :class:`~.data.Windows`, at the places whose next token is an answer."""
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    def loss_fn(model, batch):
        windows, answers = batch_parts(batch)
        inp, labels = windows[:, :-1], windows[:, 1:]
        with torch.no_grad():
            t_logits = teacher(input_ids=inp).logits
        return distill_objective(t_logits, model(input_ids=inp).logits, labels, kl_weight, ce_weight,
                                 None if answers is None else answers[:, 1:])

    return loss_fn


def distill_objective(t_logits: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                      kl_weight: float, ce_weight: float, mask: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, dict]:
    """kl_weight * KL(teacher || student) + ce_weight * CE of logits ``[B, T, V]``, at the
    places ``mask`` ``[B, T]`` sets (None: all)."""
    t_logp = F.log_softmax(t_logits.float(), dim=-1)
    logp = F.log_softmax(logits, dim=-1)
    V = logits.size(-1)
    if mask is None:
        kl = (t_logp.exp() * (t_logp - logp)).sum(-1).mean()
        ce = F.nll_loss(logp.reshape(-1, V), labels.reshape(-1))
    else:
        kl = masked_mean((t_logp.exp() * (t_logp - logp)).sum(-1), mask)
        ce = masked_mean(F.nll_loss(logp.reshape(-1, V), labels.reshape(-1), reduction="none").view(labels.shape),
                         mask)
    return kl_weight * kl + ce_weight * ce, {"kl": kl.item(), "ce": ce.item()}


# ---------------------------------------------------------------------------- threads


class ThreadTuner:
    """Adaptive torch thread count for shared CPUs (``--threads auto``).

    With 2 threads on a 2-core machine where another process keeps one core busy, every
    parallel op waits for the descheduled thread and a step gets ~5x slower, while 1 thread
    just runs at half speed.  The tuner keeps a moving average of the step time for each
    candidate count, uses the faster one and re-probes the other every ``probe_every`` steps.
    Thread count changes only summation order (results stay seeded, not bitwise identical).
    """

    def __init__(self, max_threads: int = 2, probe_every: int = 20):
        self.candidates = list(range(max_threads, 0, -1)) if max_threads > 1 else [1]
        self.avg: dict[int, float] = {}
        self.probe_every = probe_every
        self.current = self.candidates[0]

    def choose(self, step: int) -> int:
        untried = [c for c in self.candidates if c not in self.avg]
        if untried:
            n = untried[0]
        else:
            best = min(self.avg, key=self.avg.get)
            n = best
            if step % self.probe_every == 0 and len(self.candidates) > 1:
                n = next(c for c in self.candidates if c != best)
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
        self.current = n
        return n

    def record(self, seconds: float) -> None:
        old = self.avg.get(self.current)
        self.avg[self.current] = seconds if old is None else 0.6 * old + 0.4 * seconds


def thread_tuner(threads: int | str) -> ThreadTuner | None:
    """A ThreadTuner for ``threads == "auto"``; otherwise fix the thread count, no tuner."""
    if threads == "auto":
        return ThreadTuner(max_threads=min(2, os.cpu_count() or 1))
    torch.set_num_threads(int(threads))
    return None


# ---------------------------------------------------------------------------- Ctrl-C


class StopRequest:
    """Turns the first SIGINT (Ctrl-C) into a request to stop after the current step.

    The loop checks ``requested`` between steps, so the checkpoint it then writes holds a
    whole number of optimizer steps; a second Ctrl-C interrupts at once as usual.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, self._previous)  # the next Ctrl-C is a hard interrupt

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None and signal.getsignal(signal.SIGINT) == self._handle:
            signal.signal(signal.SIGINT, self._previous)


# ---------------------------------------------------------------------------- loop


def train_loop(
    model,
    stream: np.ndarray,
    stage: Stage,
    seq_len: int,
    seed: int,
    work_dir: Path,
    log_path: Path,
    loss_fn: Callable = ce_loss,
    resume: bool = False,
    desc: str = "train",
    progress: bool = True,
    tuner: ThreadTuner | None = None,
    probe: Callable[[torch.nn.Module], dict[str, float]] | None = None,
    answers: np.ndarray | None = None,
) -> dict:
    """Train ``model`` for ``stage.steps`` steps; returns a summary dict.

    Curves go to ``log_path`` (JSON lines) and to TensorBoard event files in
    ``work_dir/tensorboard`` (:mod:`.tracker`). ``probe(model)``, run every
    ``stage.probe_every`` steps and at the end (the model in eval mode), returns figures
    such as the drafter's acceptance, logged as ``probe/<name>``.
    Ctrl-C stops after the current step with a checkpoint (``interrupted`` in the summary);
    ``resume`` continues from the latest checkpoint exactly as if never stopped.
    ``answers`` (a flag per token of ``stream``): ``loss_fn`` gets :class:`~.data.Windows`
    of tokens and flags instead of token windows.
    """
    from tqdm import tqdm

    from .tracker import TB_DIR, Tracker

    ckpt_root = Path(work_dir) / "checkpoints"
    device = next(model.parameters()).device  # batches go where the student is
    opt = make_optimizer(model, stage)
    start, elapsed, tokens = 0, 0.0, 0
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    ck = latest_checkpoint(ckpt_root) if resume else None
    if ck is not None:
        st = load_checkpoint(ck, model, opt)
        start, elapsed, tokens = st["step"], st["elapsed_s"], st["tokens"]
        # drop log lines from after the checkpoint (a crashed run's tail)
        if log_path.exists():
            keep = [ln for ln in log_path.read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("step", 0) <= start
                    and json.loads(ln).get("event", "train") in ("train", "probe")]
            log_path.write_text("".join(k + "\n" for k in keep))
    else:
        if log_path.exists():
            log_path.unlink()
        if ckpt_root.exists():
            shutil.rmtree(ckpt_root)
    model.train()
    tok_per_step = stage.batch_size * seq_len
    bar = tqdm(total=stage.steps, initial=start, desc=desc, disable=not progress,
               dynamic_ncols=True, mininterval=2.0)
    ema_tps = None
    # A resumed run that has no steps left reports the checkpoint's last loss.
    last_loss = float(st.get("loss", float("nan"))) if ck is not None else float("nan")
    interrupted, done = False, start
    tracker = Tracker(Path(work_dir) / TB_DIR, resume_step=start if ck is not None else None)
    with log_path.open("a") as log, StopRequest() as stop, tracker:

        def run_probe(step: int) -> None:
            model.eval()
            figures = probe(model)
            model.train()
            log.write(json.dumps({"event": "probe", "step": step, **{k: round(v, 5) for k, v in figures.items()}})
                      + "\n")
            tracker.scalars(step, "probe", figures)

        if probe is not None and stage.probe_every and start == 0:
            run_probe(0)  # where the curve starts: the untrained drafter
        for step in range(start, stage.steps):
            if tuner is not None:
                tuner.choose(step)
            t0 = time.perf_counter()
            lr = lr_at(step, stage)
            for g in opt.param_groups:
                g["lr"] = lr
            batch = sample_batch(stream, stage.batch_size, seq_len, seed, step, answers).to(device)
            opt.zero_grad(set_to_none=True)
            loss, extra = loss_fn(model, batch)
            if loss.requires_grad:  # (a detached loss: the loss_fn ran its own backward)
                loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), stage.grad_clip).item()
            opt.step()
            dt = time.perf_counter() - t0
            if tuner is not None:
                tuner.record(dt)
            elapsed += dt
            tokens += tok_per_step
            last_loss = loss.item()
            tps = tok_per_step / dt
            ema_tps = tps if ema_tps is None else 0.9 * ema_tps + 0.1 * tps
            bar.update(1)
            bar.set_postfix(loss=f"{last_loss:.3f}", tok_s=f"{ema_tps:.0f}",
                            thr=torch.get_num_threads())
            done = step + 1
            if done % stage.log_every == 0 or done == stage.steps:
                rec = {"event": "train", "step": done, "loss": round(last_loss, 5),
                       "lr": lr, "grad_norm": round(gnorm, 4), "tokens": tokens,
                       "tokens_per_s": round(ema_tps, 1), "elapsed_s": round(elapsed, 2),
                       "threads": torch.get_num_threads(),
                       **{k: round(v, 5) for k, v in extra.items()}}
                log.write(json.dumps(rec) + "\n")
                log.flush()
                tracker.scalars(done, "train", {k: v for k, v in rec.items() if k not in ("event", "step")})
            if probe is not None and stage.probe_every and (done % stage.probe_every == 0 or done == stage.steps):
                run_probe(done)
            interrupted = stop.requested and done < stage.steps
            if done % stage.ckpt_every == 0 or done == stage.steps or interrupted:
                save_checkpoint(ckpt_root, model, opt, {
                    "step": done, "elapsed_s": elapsed, "tokens": tokens, "seed": seed,
                    "loss": last_loss})
            if interrupted:
                bar.write(f"[train] stopped at step {done}/{stage.steps}: checkpoint saved; "
                          "continue with --resume", file=sys.stderr)
                break
    bar.close()
    model.eval()
    return {"steps": stage.steps, "steps_done": done,
            "interrupted": interrupted, "tokens": tokens, "train_time_s": round(elapsed, 1),
            "final_train_loss": last_loss, "resumed_from": ck.name if ck else None}


# ---------------------------------------------------------------------------- evaluation


POSITION_BUCKETS = (0, 256, 512, 1024, 2048, 4096)


@torch.no_grad()
def evaluate(model, stream: np.ndarray, byte_lengths: list[int] | None, seq_len: int,
             max_tokens: int | None = None, teacher=None, head_vocab: torch.Tensor | None = None) -> dict:
    """Mean loss (nats/token) and bits per byte over ``stream``.

    Without ``byte_lengths`` (a tokenizer whose token bytes are not known) ``bpb`` is None.

    bpb = total nats / (ln 2 * UTF-8 bytes of the predicted tokens); over a whole split that
    byte count is exactly the split's UTF-8 size (the separator token has 0 bytes).
    With ``teacher``: also KL(teacher || model) and greedy (argmax) agreement, and with
    ``head_vocab`` (a draft vocabulary) the agreement of the argmax over those tokens only.
    """
    model.eval()
    blen = None if byte_lengths is None else torch.tensor(byte_lengths, dtype=torch.float64)
    edges = [e for e in POSITION_BUCKETS if e < seq_len] + [seq_len]
    bucket_nats = [0.0] * (len(edges) - 1)
    bucket_tok = [0] * (len(edges) - 1)
    nats = 0.0
    nbytes = 0.0
    ntok = 0
    kl_sum = 0.0
    agree = agree_vocab = 0
    for w in eval_windows(stream, seq_len, max_tokens):
        inp, labels = w[:, :-1], w[:, 1:]
        logits = model(input_ids=inp).logits.float().cpu()  # a GPU-trained head is scored on CPU tensors
        logp = F.log_softmax(logits, dim=-1)
        tok_nats = F.nll_loss(logp[0], labels[0], reduction="none")
        nats += tok_nats.sum().item()
        for b in range(len(edges) - 1):  # loss by position in the context window
            part = tok_nats[edges[b] : edges[b + 1]]
            bucket_nats[b] += part.sum().item()
            bucket_tok[b] += part.numel()
        if blen is not None:
            nbytes += blen[labels[0]].sum().item()
        ntok += labels.numel()
        if teacher is not None:
            t_logp = F.log_softmax(teacher(input_ids=inp).logits.float().cpu(), dim=-1)
            kl_sum += (t_logp.exp() * (t_logp - logp)).sum().item()
            agree += (t_logp.argmax(-1) == logp.argmax(-1)).sum().item()
            if head_vocab is not None:
                best = head_vocab[logp[..., head_vocab].argmax(-1)]
                agree_vocab += (t_logp.argmax(-1) == best).sum().item()
    known = blen is not None
    out = {"tokens": ntok, "bytes": int(nbytes) if known else None, "loss": nats / max(ntok, 1),
           "bpb": nats / (math.log(2) * max(nbytes, 1)) if known else None,
           "bytes_per_token": nbytes / max(ntok, 1) if known else None,
           "position_buckets": [
               {"start": edges[b], "end": edges[b + 1], "tokens": bucket_tok[b],
                "loss": bucket_nats[b] / bucket_tok[b] if bucket_tok[b] else None}
               for b in range(len(edges) - 1)]}
    if teacher is not None:
        out["kl_from_target"] = kl_sum / max(ntok, 1)
        out["greedy_agreement"] = agree / max(ntok, 1)
        if head_vocab is not None:
            out["greedy_agreement_draft_vocab"] = agree_vocab / max(ntok, 1)
    return out


# ---------------------------------------------------------------------------- timing


@torch.no_grad()
def _decode_ms(model, steps: int, prompt_len: int, vocab: int, seed: int = 0) -> float:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, prompt_len), generator=g)
    logits, cache = forward_with_cache(model, ids)
    nxt = logits[:, -1:].argmax(-1)
    for i in range(steps + 4):  # 4 warm-up steps, then the timed ones
        if i == 4:
            t0 = time.perf_counter()
        logits, cache = forward_with_cache(model, nxt, cache)
        nxt = logits[:, -1:].argmax(-1)
    return (time.perf_counter() - t0) / steps * 1000.0


def measure_decode(models: dict, steps: int = 64, prompt_len: int = 32, repeats: int = 5,
                   threads: int | None = None) -> dict:
    """ms per cached decode step (batch 1, fp32, KV cache) for each model, interleaved.

    Runs ``repeats`` rounds; in each round every model decodes ``steps`` tokens after a
    ``prompt_len`` prefill.  Reports the median per model, so background load affects all
    models alike.
    """
    if threads is not None:
        torch.set_num_threads(threads)
    res: dict[str, list[float]] = {k: [] for k in models}
    for m in models.values():
        m.eval()
    for r in range(repeats):
        for name, m in models.items():
            res[name].append(_decode_ms(m, steps, prompt_len, m.config.vocab_size, seed=r))
    return {k: float(np.median(v)) for k, v in res.items()}
