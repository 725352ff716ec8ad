"""The stages of ``quickdraft train``: tokenizer -> target -> draft.

Layout::

    OUT/qd-stdlib-target/   config.json model.safetensors generation_config.json tokenizer files
    OUT/qd-stdlib-draft/    README.md quickdraft.json loss_curve.png train_log.jsonl
    WORK/tokenizer/         the trained tokenizer (shared by both models)
    WORK/cache/             packed uint16 token streams
    WORK/target/, WORK/draft/   checkpoints/ and train_log.jsonl
    WORK/results.json       everything the model cards report
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch

from ..machine import machine_info
from ..pair import load_tokenizer
from . import card
from .corpus import load_corpus
from .data import cached_streams
from .distill import DistillTask, TokenData
from .distill import train as distill_train
from .presets import DRAFT_NAME, TARGET_NAME, Preset
from .tokenizer import save_tokenizer, token_byte_lengths, train_tokenizer
from .trainer import (
    build_model,
    count_params,
    evaluate,
    load_model_fp32,
    make_distill_loss,
    measure_decode,
    save_model_bf16,
    thread_tuner,
    train_loop,
)

STAGES = ("tokenizer", "target", "draft")
DOC_DATA_PREFIX = "pydoc_data/"


def _busy() -> bool:
    """Whether other processes are keeping a core busy (1-minute load average)."""
    try:
        return os.getloadavg()[0] > 1.5
    except OSError:
        return False




class Pipeline:
    def __init__(self, out: Path, work: Path, preset: Preset, seed: int = 0,
                 corpus_root: Path | None = None, max_files: int | None = None,
                 include_tests: bool = False, resume: bool = False, command: str = "",
                 progress: bool = True, log=print, threads: int | str = 2,
                 init_target: Path | None = None):
        self.out, self.work = Path(out), Path(work)
        self.preset, self.seed = preset, seed
        self.corpus_root, self.max_files, self.include_tests = corpus_root, max_files, include_tests
        self.resume, self.command, self.progress, self.log = resume, command, progress, log
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self._corpus = None
        self.threads = threads
        # Continue training this target (its tokenizer too) instead of starting from scratch.
        self.init_target = Path(init_target) if init_target else None

    def tuner(self):
        """A ThreadTuner for ``threads == "auto"`` (fixed count otherwise)."""
        return thread_tuner(self.threads)

    def eval_threads(self):
        if self.threads == "auto":
            # evaluation: 1 thread is never pathological on a shared machine
            torch.set_num_threads(1 if _busy() else min(2, os.cpu_count() or 1))

    # ------------------------------------------------------------------ shared state
    @property
    def results_path(self) -> Path:
        return self.work / "results.json"

    def results(self) -> dict:
        return json.loads(self.results_path.read_text()) if self.results_path.exists() else {}

    def update_results(self, **kw) -> dict:
        r = self.results()
        r.update(kw)
        r.update(preset=self.preset.to_json(), seed=self.seed, hardware=machine_info())
        if getattr(self, "record_command", True) or "command" not in r:
            r["command"] = self.command
        self.results_path.write_text(json.dumps(r, indent=1))
        return r

    def corpus(self):
        if self._corpus is None:
            self._corpus = load_corpus(self.corpus_root, include_tests=self.include_tests,
                                       max_files=self.max_files)
        return self._corpus

    @property
    def tok_dir(self) -> Path:
        return self.work / "tokenizer"

    def streams(self):
        tok = load_tokenizer(self.tok_dir)
        train, val = cached_streams(tok, self.tok_dir, self.corpus(), self.work / "cache")
        self.update_results(stream={"train_tokens": int(train.size), "val_tokens": int(val.size)})
        return tok, train, val

    def model_dir(self, name: str) -> Path:
        return self.out / name

    def _fresh_model_dir(self, name: str) -> Path:
        d = self.model_dir(name)
        if d.exists() and ((d / "config.json").exists() or (d / "quickdraft.json").exists()):
            shutil.rmtree(d)
        d.mkdir(parents=True, exist_ok=True)
        return d

    # ------------------------------------------------------------------ stages
    def run(self, stages=STAGES) -> dict:
        # the card's "exact command" is the one that trained the models
        self.record_command = any(s in STAGES for s in stages) or "command" not in self.results()
        for s in stages:
            t0 = time.time()
            getattr(self, f"stage_{s}")()
            wall = time.time() - t0
            self.log(f"[train] stage {s} done in {wall:.1f}s")
            if s != "cards":
                r = self.results()
                self.update_results(stage_wall_s={**r.get("stage_wall_s", {}), s: round(wall, 1)})
        if "cards" not in stages:
            self.write_cards()
        return self.results()

    def stage_cards(self) -> None:
        """Rewrite README.md and quickdraft.json of both models from WORK/results.json."""
        r = self.results()
        for role, name in (("target", TARGET_NAME), ("draft", DRAFT_NAME)):
            d = self.model_dir(name)
            if role in r and (d / "config.json").exists():
                card.write_meta(d, role, r[role]["params"], card.DESCRIPTIONS[role])
                card.record_eval(d, r[role]["val"], self.preset.seq_len)
                card.plot_loss(d, d / "loss_curve.png", f"{name} training")
        self.write_cards()

    def stage_tokenizer(self) -> None:
        c = self.corpus()
        m = c.manifest()
        self.log(f"[train] corpus: {m['files']} files, {m['bytes']:,} bytes "
                 f"(train {m['split']['train_files']}, val {m['split']['val_files']}, "
                 f"skipped {m['skipped_undecodable']})")
        if self.init_target is not None:
            # a continued model keeps the vocabulary its weights were trained with
            tok = load_tokenizer(self.init_target)
            self.log(f"[train] tokenizer: reused from {self.init_target}")
        else:
            tok = train_tokenizer(c.train_texts, self.preset.vocab_size)
        if self.tok_dir.exists():
            shutil.rmtree(self.tok_dir)
        save_tokenizer(tok, self.tok_dir)
        self.update_results(corpus=m)
        self.streams()

    def _finish_model(self, name: str, role: str, model, stage_summary: dict, val: dict,
                      train_eval: dict, log_path: Path) -> None:
        d = self._fresh_model_dir(name)
        save_model_bf16(model, d)
        tok = load_tokenizer(self.tok_dir)
        tok.model_max_length = model.config.max_position_embeddings  # what the model takes
        save_tokenizer(tok, d)
        card.log_eval(log_path.parent, stage_summary["steps"],
                      {"loss": val["loss"], "bpb": val["bpb"], "train_loss": train_eval["loss"]})
        card.copy_run_log(log_path.parent, d)
        card.plot_loss(d, d / "loss_curve.png", f"{name} training")
        st = self.preset.target_stage if role == "target" else self.preset.draft_stage
        entry = {**stage_summary, "params": count_params(model), "val": val,
                 "train_eval": train_eval, "batch_size": st.batch_size, "lr": st.lr,
                 "warmup": st.warmup, "weight_decay": st.weight_decay,
                 "grad_clip": st.grad_clip, "command": self.command}
        self.update_results(**{role: entry})
        card.write_meta(d, role, entry["params"], card.DESCRIPTIONS[role])
        card.record_eval(d, val, self.preset.seq_len)
        self.write_cards()

    def write_cards(self) -> None:
        r = self.results()
        for role, name in (("target", TARGET_NAME), ("draft", DRAFT_NAME)):
            d = self.model_dir(name)
            if role in r and (d / "config.json").exists():
                card.write_card(d, role, r)

    def _train_eval(self, model, train, byte_lengths, teacher=None) -> dict:
        import numpy as np

        # a fixed, seeded contiguous slice of the train stream for the "train loss" figure
        n = self.preset.train_eval_tokens
        rng = np.random.default_rng([self.seed, 999])
        start = int(rng.integers(0, max(1, train.size - n - 1)))
        return evaluate(model, train[start : start + n + 1], byte_lengths, self.preset.seq_len,
                        teacher=teacher)

    def stage_target(self) -> None:
        tok, train, val = self.streams()
        p = self.preset
        if self.init_target is not None:
            model = load_model_fp32(self.init_target).float()
            model.config.max_position_embeddings = max(
                model.config.max_position_embeddings, p.seq_len)
            # the "before" of the card: the init model scored on the same windows (once)
            if not (self.resume and "target_init_val" in self.results()):
                self.eval_threads()
                before = evaluate(model, val, token_byte_lengths(tok), p.seq_len,
                                  p.eval_max_tokens)
                self.update_results(target_init=str(self.init_target), target_init_val=before)
        else:
            model = build_model(p.target, p, self.seed)
        self.log(f"[train] target: {count_params(model):,} params, {p.target_stage.steps} steps "
                 f"on {train.size:,} train tokens"
                 + (f", continued from {self.init_target}" if self.init_target else ""))
        wd = self.work / "target"
        summary = train_loop(model, train, p.target_stage, p.seq_len, self.seed, wd,
                             wd / "train_log.jsonl", resume=self.resume, desc="target",
                             progress=self.progress, tuner=self.tuner())
        _stop_if_interrupted(summary)
        self.eval_threads()
        bl = token_byte_lengths(tok)
        v = evaluate(model, val, bl, p.seq_len, p.eval_max_tokens)
        te = self._train_eval(model, train, bl)
        self.log(f"[train] target val loss {v['loss']:.4f} bpb {v['bpb']:.4f}")
        self._finish_model(TARGET_NAME, "target", model, summary, v, te, wd / "train_log.jsonl")

    def stage_draft(self) -> None:
        tok, train, val = self.streams()
        p = self.preset
        target_dir = self.model_dir(TARGET_NAME)
        if not (target_dir / "config.json").exists():
            raise SystemExit(f"draft stage needs a trained target in {target_dir}")
        # The teacher is the shipped (bf16) target, upcast to fp32: the draft learns the
        # distribution users will actually verify against.
        teacher = load_model_fp32(target_dir)
        model = build_model(p.draft, p, self.seed + 1)
        self.log(f"[train] draft: {count_params(model):,} params, {p.draft_stage.steps} steps "
                 "(distillation)")
        # The same distillation as `quickdraft train draft` (one code path): a DistillTask
        # trained by distill.train; only the data (the family's cached streams) and the
        # card (the family's) differ.
        wd = self.work / "draft"
        task = DistillTask("draft", teacher, model,
                           make_distill_loss(teacher, p.kl_weight, p.ce_weight), save=lambda d: None)
        summary = distill_train(task, TokenData(train, val, {}), p.draft_stage, p.seq_len,
                                self.seed + 1, wd, resume=self.resume, progress=self.progress,
                                threads=self.threads)
        _stop_if_interrupted(summary)
        self.eval_threads()
        bl = token_byte_lengths(tok)
        v = evaluate(model, val, bl, p.seq_len, p.eval_max_tokens, teacher=teacher)
        te = self._train_eval(model, train, bl)
        self.log(f"[train] draft val loss {v['loss']:.4f} bpb {v['bpb']:.4f} "
                 f"agreement {v['greedy_agreement']:.3f}")
        # decode cost: the shipped (bf16 -> fp32) weights of both models, interleaved
        self._finish_model(DRAFT_NAME, "draft", model, summary, v, te, wd / "train_log.jsonl")
        self.stage_timing()
        self.stage_breakdown()

    def stage_breakdown(self) -> None:
        """Validation loss/bpb of the shipped (bf16) weights on the code-only part of the split.

        The stdlib's validation split happens to contain ``pydoc_data/topics.py`` (generated
        English documentation in one string literal), which is most of its bytes; this
        reports the rest separately so the card shows how the models do on actual code.
        """
        from .data import encode_docs

        p = self.preset
        tok = load_tokenizer(self.tok_dir)
        docs = [t for rel, t in self.corpus().val if not rel.startswith(DOC_DATA_PREFIX)]
        excluded = [rel for rel, _ in self.corpus().val if rel.startswith(DOC_DATA_PREFIX)]
        if not docs:
            return
        stream = encode_docs(tok, docs)
        bl = token_byte_lengths(tok)
        self.eval_threads()
        target = load_model_fp32(self.model_dir(TARGET_NAME))
        out = {"excluded": excluded, "files": len(docs),
               "bytes": sum(len(t.encode("utf-8")) for t in docs),
               "target": evaluate(target, stream, bl, p.seq_len, p.eval_max_tokens)}
        if (self.model_dir(DRAFT_NAME) / "config.json").exists():
            draft = load_model_fp32(self.model_dir(DRAFT_NAME))
            out["draft"] = evaluate(draft, stream, bl, p.seq_len, p.eval_max_tokens,
                                    teacher=target)
        self.log(f"[train] code-only validation ({len(docs)} files): target bpb "
                 f"{out['target']['bpb']:.4f}" + (f", draft bpb {out['draft']['bpb']:.4f}, "
                 f"agreement {out['draft']['greedy_agreement']:.3f}" if "draft" in out else ""))
        self.update_results(val_code_only=out)
        self.write_cards()

    def stage_timing(self) -> None:
        """Measure per-token decode cost of both shipped models and refresh the cards."""
        p = self.preset
        if self.threads == "auto":
            torch.set_num_threads(min(2, os.cpu_count() or 1))
        models = {"target": load_model_fp32(self.model_dir(TARGET_NAME)),
                  "draft": load_model_fp32(self.model_dir(DRAFT_NAME))}
        repeats = 5
        ms = measure_decode(models, steps=p.decode_steps, prompt_len=32, repeats=repeats)
        ms.update(steps=p.decode_steps, prompt_len=32, repeats=repeats,
                  threads=torch.get_num_threads(), ratio=ms["draft"] / ms["target"])
        self.log(f"[train] decode ms/token: target {ms['target']:.3f}, draft {ms['draft']:.3f} "
                 f"(ratio {ms['ratio']:.3f})")
        self.update_results(decode_ms=ms)
        self.write_cards()


def _stop_if_interrupted(summary: dict) -> None:
    """Ctrl-C during a stage: its checkpoint is saved; end the run (``--resume`` continues)."""
    if summary["interrupted"]:
        raise KeyboardInterrupt
