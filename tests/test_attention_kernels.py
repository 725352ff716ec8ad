"""The attention kernels an eager pass may use (``models/transformer.attention_kernels``):
on CUDA every backend but cuDNN's, whose per-key-length plans cost ~50 ms a decode step on
the first GPU runs; elsewhere torch's own choice. The flags are process-wide, so they must
be back as they were after the pass."""

from __future__ import annotations

import torch

from quickdraft.models.transformer import attention_kernels


def backend_flags() -> tuple[bool, bool, bool, bool]:
    b = torch.backends.cuda
    return b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(), b.cudnn_sdp_enabled()


def test_a_cuda_pass_leaves_out_cudnn_attention_and_restores_the_flags():
    before = backend_flags()
    assert before[3], "torch enables cuDNN attention by default; this test checks it is turned off"
    with attention_kernels(torch.device("cuda")):
        assert backend_flags() == (True, True, True, False)
    assert backend_flags() == before


def test_a_cpu_pass_keeps_torchs_choice():
    before = backend_flags()
    with attention_kernels(torch.device("cpu")):
        assert backend_flags() == before
