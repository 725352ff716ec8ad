"""Layer skip (Draft & Verify, Zhang et al. 2023): the draft is the target itself with some
attention and MLP sub-layers skipped (identity on the residual stream).

:class:`LayerSkipLM` is a draft-model view of the target's own :class:`Transformer`, so the
ordinary :class:`DraftModelDrafter` drafts with it (chains, trees, draft-stop policies).

**Which KV cache.** The view reads and writes the *target's* cache. Below the target's
length every entry is the target's own, exact: the draft attends to the exact context
(better drafts than attending to its own skip-perturbed past), and it needs no cache, no
prefill and no catch-up of its own. Its drafting passes write perturbed keys/values (and,
for skipped attention, none) only in slots at or past the target's length; the very next
verify pass writes all layers of every slot from the target's length on before reading
them (the engine feeds what the target lacks plus the proposal, contiguously), so
verification never reads a perturbed entry; slots past the verified ones are never
attended to and are overwritten later. After verification the view's length is the
target's again.

**Never skip during prefill.** :meth:`LayerSkipLM.extend` with ``logits="none"`` (what a
drafter's ``join`` does with the prompt) runs the full target, unskipped. Those entries are
exactly what the target's own prefill writes, so the target keeps them (its length
advances) and the engine's first pass then feeds only the last prompt token plus the
first proposal: the prompt is prefilled once, by whichever runs first. That is cheaper
than a second non-skipping prefill into a draft cache (a whole extra prefill) and than
copying the target's cache after its prefill (the first proposal would have to wait a
step).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..models.gguf import is_gguf
from ..models.lm import NativeLM

PROFILE_VERSION = 1
PROFILES_DIR = Path(__file__).resolve().parent.parent / "assets" / "profiles"


class SkipProfileError(ValueError):
    """A skip profile that does not fit the model (another model, wrong shape, unreadable)."""


def model_fingerprint(model_dir: Path) -> str:
    """What identifies a checkpoint for a skip profile, wherever it is installed: a hash of
    its config and of the size, first and last MiB of each weight file (cheap; retraining
    changes them)."""
    digest = hashlib.sha256()
    model_dir = Path(model_dir)
    if is_gguf(model_dir):  # one file: its header holds the configuration
        files = [model_dir]
    else:
        digest.update((model_dir / "config.json").read_bytes())
        files = sorted(model_dir.glob("*.safetensors"))
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read(1 << 20))
    return digest.hexdigest()[:16]


@dataclass
class SkipProfile:
    """Which sub-layers the layer-skip draft skips, for one model (JSON on disk)."""

    model: str
    fingerprint: str
    n_layers: int
    skip_attn: list[int]
    skip_mlp: list[int]
    k: int = 4
    predicted_speedup: float | None = None
    info: dict = field(default_factory=dict)  # how it was found: study, trials, measurements

    def __post_init__(self) -> None:
        self.skip_attn, self.skip_mlp = sorted(set(self.skip_attn)), sorted(set(self.skip_mlp))

    @property
    def skipped(self) -> int:
        return len(self.skip_attn) + len(self.skip_mlp)

    def describe(self) -> str:
        return f"attn {self.skip_attn or '-'} mlp {self.skip_mlp or '-'} of {self.n_layers} layers"

    def check(self, model_dir: Path | None, n_layers: int, source: str = "the skip profile") -> None:
        """One-line :class:`SkipProfileError` unless this profile fits the model."""
        if self.n_layers != n_layers:
            raise SkipProfileError(f"{source} is for a {self.n_layers}-layer model ({self.model}), this one has "
                                   f"{n_layers} layers; tune one with `quickdraft tune layer-skip --model ...`")
        bad = [i for i in self.skip_attn + self.skip_mlp if not 0 <= i < n_layers]
        if bad:
            raise SkipProfileError(f"{source} skips layer {bad[0]}, outside 0..{n_layers - 1}")
        if model_dir is not None and self.fingerprint and self.fingerprint != model_fingerprint(model_dir):
            raise SkipProfileError(f"{source} was tuned for another model ({self.model}, fingerprint {self.fingerprint}),"
                                   f" not {model_dir}; tune one with `quickdraft tune layer-skip --model {model_dir}`")

    def to_json(self) -> dict:
        return {"version": PROFILE_VERSION, **asdict(self)}

    def save(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> SkipProfile:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
            return cls(model=str(data["model"]), fingerprint=str(data.get("fingerprint", "")),
                       n_layers=int(data["n_layers"]), skip_attn=[int(i) for i in data["skip_attn"]],
                       skip_mlp=[int(i) for i in data["skip_mlp"]], k=int(data.get("k", 4)),
                       predicted_speedup=data.get("predicted_speedup"), info=dict(data.get("info", {})))
        except FileNotFoundError:
            raise SkipProfileError(f"skip profile {path} does not exist") from None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise SkipProfileError(f"{path} is not a skip profile (JSON with n_layers, skip_attn, skip_mlp); "
                                   "make one with `quickdraft tune layer-skip`") from None


def default_profile_path(model_dir: Path | None) -> Path | None:
    """The profile shipped for an embedded model (``quickdraft/assets/profiles/<name>.json``)."""
    if model_dir is None:
        return None
    path = PROFILES_DIR / f"{Path(model_dir).name}.json"
    return path if path.is_file() else None


def load_profile(target, path: str | Path | None = None) -> SkipProfile:
    """``path``'s profile, or the one shipped for ``target``; checked against ``target``."""
    model_dir = getattr(target, "model_dir", None)
    source = path or default_profile_path(model_dir)
    if source is None:
        raise SkipProfileError(f"no skip profile for {model_dir}: tune one with `quickdraft tune layer-skip "
                               f"--model {model_dir}` and pass it with --skip-profile FILE")
    profile = SkipProfile.load(source)
    profile.check(model_dir, target.config.n_layers, f"skip profile {source}")
    return profile


class LayerSkipLM:
    """The target with the profile's sub-layers skipped, as a draft model sharing the
    target's weights and KV cache (see the module docstring for why that is exact)."""

    backend = "native"

    def __init__(self, target: NativeLM, profile: SkipProfile) -> None:
        if not isinstance(target, NativeLM):
            raise ValueError("layer skip needs the native runtime (--backend native); the transformers "
                             "backend cannot skip sub-layers")
        profile.check(None, target.config.n_layers)
        self.target, self.profile = target, profile
        self.model_dir = target.model_dir
        self.vocab_size = target.vocab_size
        self.context_length = target.context_length
        self.eos_token_ids = target.eos_token_ids
        self.length = 0
        self._skip = dict(skip_attn=frozenset(profile.skip_attn), skip_mlp=frozenset(profile.skip_mlp))

    def reset(self, max_len: int | None = None) -> None:
        self.length = 0  # the target's cache is the target's to reset

    def prepare(self, step_tokens: int) -> int:
        return 0

    def extend(self, tokens: torch.Tensor, logits: str | int = "all", positions: torch.Tensor | None = None,
               mask: torch.Tensor | None = None) -> torch.Tensor | None:
        target, start = self.target, self.length
        end = start + tokens.shape[-1]
        if logits == "none":  # a prefill: never skipped; the target already holds its own part
            if end > target.length:
                if start != target.length:
                    raise ValueError("a layer-skip prefill must continue the target's cache")
                target.extend(tokens, logits="none", positions=positions, mask=mask)
            self.length = end
            return None
        if start < target.length:
            raise ValueError("layer-skip drafting writes only past the target's verified tokens")
        device = target.cache.k.device
        positions = start if positions is None else positions.to(device).view(1, -1)
        with torch.inference_mode():
            out = target.model(tokens.to(device).view(1, -1), positions, target.cache, slots=start,
                               mask=None if mask is None else mask.to(device)[None], logits=logits, **self._skip)
        self.length = end
        return out.logits[0]

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def compact(self, length: int, keep: list[int]) -> None:
        # The engine has compacted the target first: its cache now holds every accepted token
        # exactly, and the draft continues from there (its own entries were scratch).
        self.length = self.target.length
