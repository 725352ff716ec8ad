"""Model sizes and step budgets of the training presets.

``default`` is the shipped family (measured on a 2-core CPU: see the model cards);
``tiny`` is for tests and smoke runs (seconds).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

TARGET_NAME = "qd-stdlib-target"
DRAFT_NAME = "qd-stdlib-draft"


@dataclass(frozen=True)
class Arch:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    num_key_value_heads: int | None = None


@dataclass(frozen=True)
class Stage:
    steps: int
    batch_size: int
    lr: float
    warmup: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    ckpt_every: int = 100
    log_every: int = 10
    probe_every: int = 0  # steps between acceptance probes (0: none); see train/probe.py


@dataclass(frozen=True)
class Preset:
    name: str
    vocab_size: int
    seq_len: int
    target: Arch
    draft: Arch
    target_stage: Stage
    draft_stage: Stage
    kl_weight: float = 1.0
    ce_weight: float = 0.1
    eval_max_tokens: int | None = None  # validation tokens scored at the end (None = all)
    train_eval_tokens: int = 32768  # train tokens scored at the end (for the card)
    decode_steps: int = 64

    def to_json(self) -> dict:
        return asdict(self)


# The embedded family's sizes (v1 and v2 share them; v2 continues v1's weights).
FAMILY_TARGET = Arch(hidden_size=448, num_hidden_layers=8, num_attention_heads=7,
                     intermediate_size=1216)
FAMILY_DRAFT = Arch(hidden_size=256, num_hidden_layers=1, num_attention_heads=4,
                    intermediate_size=704)

PRESETS: dict[str, Preset] = {
    "default": Preset(
        name="default",
        vocab_size=8192,
        seq_len=256,
        target=FAMILY_TARGET,
        draft=FAMILY_DRAFT,
        target_stage=Stage(steps=450, batch_size=12, lr=1.5e-3, warmup=25, ckpt_every=25),
        draft_stage=Stage(steps=1200, batch_size=12, lr=3e-3, warmup=20, ckpt_every=100),
        eval_max_tokens=None,
    ),
    # Family v2: the v1 target continued at 2048-token windows (the whole context), so
    # positions past v1's 256-token training window are learned; the draft is distilled
    # at the same length by ``quickdraft train draft``.
    "v2": Preset(
        name="v2",
        vocab_size=8192,
        seq_len=2048,
        target=FAMILY_TARGET,
        draft=FAMILY_DRAFT,
        target_stage=Stage(steps=300, batch_size=2, lr=6e-4, warmup=20, ckpt_every=20,
                           log_every=5),
        # what `quickdraft train draft --steps 200 --batch-size 2 ...` ran for the v2 draft
        draft_stage=Stage(steps=200, batch_size=2, lr=2e-3, warmup=20, ckpt_every=50,
                          log_every=10),
        eval_max_tokens=None,
    ),
    "tiny": Preset(
        name="tiny",
        vocab_size=512,
        seq_len=64,
        target=Arch(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=128),
        draft=Arch(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                   intermediate_size=64),
        target_stage=Stage(steps=6, batch_size=4, lr=3e-3, warmup=2, ckpt_every=3, log_every=1),
        draft_stage=Stage(steps=4, batch_size=4, lr=3e-3, warmup=1, ckpt_every=2, log_every=1),
        eval_max_tokens=2048,
        train_eval_tokens=1024,
        decode_steps=8,
    ),
}


def get_preset(name: str, **overrides) -> Preset:
    """A preset by name; ``target_steps``/``draft_steps`` override the stage step counts."""
    p = PRESETS[name]
    if overrides.get("target_steps") is not None:
        p = replace(p, target_stage=replace(p.target_stage, steps=overrides["target_steps"]))
    if overrides.get("draft_steps") is not None:
        p = replace(p, draft_stage=replace(p.draft_stage, steps=overrides["draft_steps"]))
    return p
