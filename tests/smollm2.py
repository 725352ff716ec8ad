"""The real SmolLM2-135M-Instruct, for the tests that need it: `make real-model` installs it,
CI never does, so those tests skip (saying how to install it) where it is missing."""

import pytest

from quickdraft.models.registry import find_packaged, packaged_file

MODEL = find_packaged("smollm2-135m")
FILE = packaged_file(MODEL)

NEEDS_SMOLLM2 = [
    pytest.mark.skipif(FILE is None, reason=f"smollm2-135m is not installed (`{MODEL.install_command}` "
                       "or `make real-model`)"),
    pytest.mark.slow,
]
