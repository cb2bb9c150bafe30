"""Test-session settings: hypothesis without deadlines (CPU timing is noisy), gloo worlds started once."""

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
def worlds():
    """``worlds(n)``: a gloo world of exactly ``n`` CPU ranks, started on first use and kept for
    the session (engines need a world of exactly ``tp * pp * sp`` ranks)."""
    from tests.dist import World

    started = {}

    def get(n: int) -> World:
        if n not in started:
            started[n] = World(n)
        return started[n]

    yield get
    for w in started.values():
        w.close()


@pytest.fixture(scope="session")
def world(worlds):
    """A gloo world of 4 CPU ranks for the whole session; cases pick subgroups of 1-4 ranks."""
    return worlds(4)
