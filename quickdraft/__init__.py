"""quickdraft: lossless speculative decoding for transformer language models.

The common entry points::

    from quickdraft import SpeculativeGenerator, SamplingParams
    gen = SpeculativeGenerator.from_pretrained()      # embedded target + paired draft
    out = gen.generate("def median(values):", max_new_tokens=64, temperature=0.7, seed=0)
    stream = gen.stream("import os\n")             # chunks as they come; stream.stats at the end
"""

from .batch_engine import BatchEngine, BatchFullError, RowUpdate
from .drafters import Drafter, DraftModelDrafter, NoDrafter, Proposal
from .engine import ContextOverflowError, Step, decode
from .generator import Generation, SpeculativeGenerator, TextChunk, TextStream, load_tokenizer
from .models.lm import CausalLM, load_model
from .models.loading import CheckpointError
from .sampling import SamplingParams
from .stats import GenerationStats
from .stopping import StopConditions
from .verify import AcceptanceRule, GreedyAcceptance, SpeculativeSampling, Verdict

__version__ = "0.1.0"

__all__ = [
    "AcceptanceRule",
    "BatchEngine",
    "BatchFullError",
    "CausalLM",
    "CheckpointError",
    "ContextOverflowError",
    "DraftModelDrafter",
    "Drafter",
    "Generation",
    "GenerationStats",
    "GreedyAcceptance",
    "NoDrafter",
    "Proposal",
    "RowUpdate",
    "SamplingParams",
    "SpeculativeGenerator",
    "SpeculativeSampling",
    "Step",
    "StopConditions",
    "TextChunk",
    "TextStream",
    "Verdict",
    "decode",
    "load_model",
    "load_tokenizer",
]
