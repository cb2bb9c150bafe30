"""Test-session settings: hypothesis without deadlines (CPU timing is noisy), one gloo world."""

import os

import torch

if not torch.cuda.is_available():  # Triton kernels run in the interpreter on CPU-only machines
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import settings

settings.register_profile("ringkv", deadline=None, print_blob=True)
settings.register_profile("ci", deadline=None, print_blob=True, derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ringkv"))
torch.set_num_threads(1)  # small test matmuls run fastest on one thread, above all on a shared CPU


@pytest.fixture(scope="session")
def world():
    """A gloo world of 4 CPU ranks for the whole session; cases pick subgroups of 1-4 ranks."""
    from tests.dist import World

    w = World(4)
    yield w
    w.close()
