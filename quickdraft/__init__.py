"""quickdraft: lossless speculative decoding for transformer language models.

The common entry points::

    from quickdraft import DraftOptions, SamplingParams, SpeculativeGenerator
    gen = SpeculativeGenerator.from_pretrained()      # embedded target + paired draft
    tree = SpeculativeGenerator.from_pretrained(method="tree", options=DraftOptions(tree="2,2,1"))
    out = gen.generate("def median(values):", max_new_tokens=64, temperature=0.7, seed=0)
    stream = gen.stream("import os\n")             # chunks as they come; stream.stats at the end
"""

from .decoding.batch_engine import BatchEngine, BatchFullError, RowUpdate
from .decoding.engine import Step, decode
from .decoding.sampling import SamplingParams
from .decoding.stats import GenerationStats
from .decoding.step import ContextOverflowError
from .decoding.stopping import StopConditions
from .decoding.verify import AcceptanceRule, GreedyAcceptance, SpeculativeSampling, Verdict
from .drafters import Drafter, DraftModelDrafter, DraftOptions, NoDrafter, Proposal
from .generator import SpeculativeGenerator
from .models.lm import CausalLM, load_model
from .models.loading import CheckpointError
from .pair import load_tokenizer
from .text import Generation, TextChunk, TextStream

__version__ = "0.1.0"

__all__ = [
    "AcceptanceRule",
    "BatchEngine",
    "BatchFullError",
    "CausalLM",
    "CheckpointError",
    "ContextOverflowError",
    "DraftModelDrafter",
    "DraftOptions",
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
