"""Test-session settings: hypothesis without deadlines (CPU timing is noisy), gloo worlds started
once."""

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
# ringkv's C kernels on wherever they build, here and in the processes tests start: without a
# switch each kernel times itself against its torch path on first use and keeps the faster
# (ringkv/kernels/native.py), and no test may depend on such a timing verdict. Tests of the
# self-check itself unset these (tests/test_kernel_isa.py); RINGKV_NATIVE_*=0 from outside still
# wins.
for _switch in (
    "RINGKV_NATIVE_LINEAR",
    "RINGKV_NATIVE_FLASH",
    "RINGKV_NATIVE_PAGED",
    "RINGKV_NATIVE_POINTWISE",
):
    os.environ.setdefault(_switch, "1")
# compile_decode="auto" (the engine's default) runs eager in the suite, here and in the processes
# tests start: no engine test pays a compile or a timing check, none depends on a timing verdict.
# Tests of "auto" itself unset it (tests/test_autocompile.py); compile_decode=True still compiles.
os.environ.setdefault("RINGKV_COMPILE_DECODE", "0")


# The modules that took longest, longest first (longest-processing-time-first: the short modules
# fill in at the end, where a long one would leave the other worker idle). `make test`'s workers
# (pytest-xdist, --dist loadfile) take modules in the order below, two queued each; the other
# modules follow by their number of tests (most first). Seconds: the sum of each module's tests of
# 8 s or more in a whole-suite run on 2 workers (docs/testing.md; test_compiled_decode: cold).
# xdist's own order (most tests first, ``--loadscope-reorder``, on by default) put the modules of
# a few long tests LAST (test_hosts_faults 172 s, test_bench_cluster 76 s, test_train_memory_bench
# 75 s, test_hosts 105 s were among the last ten), where one worker ran them alone.
LONG_MODULES = (
    "test_compiled_decode.py",  # ~190 s cold (its compile: docs/testing.md)
    "test_smollm2.py",  # 213
    "test_hosts_faults.py",  # 172
    "test_migrate_mesh.py",  # 108
    "test_hosts.py",  # 105
    "test_hf_hybrid.py",  # 97-120 (hybrid models, issue #56)
    "test_kernels.py",  # 85
    "test_tiers_mesh.py",  # 84
    "test_faults.py",  # 84
    "test_hosts_serve.py",  # 83
    "test_bench_cluster.py",  # 76
    "test_train_memory_bench.py",  # 75 (before its benchmark's gc.freeze: -19 s cold alone)
    "test_bench_engine.py",  # 72
    "test_triton.py",  # 72
    "test_hf.py",  # 68
    "test_hf_families.py",  # 62
    "test_cluster.py",  # 208, not at the start: its `serve --replicas 2` beside the heaviest
    # starts (compiled decode, SmolLM2) did not come up within 300 s in one warm run
    "test_loader.py",  # 50 (before its duplicate SmolLM2 CLI run was dropped: -9 s cold alone)
    "test_train_example.py",  # 46
    "test_sp_recurrent_heads.py",  # 17-45
    "test_sp_delta.py",  # 31-37
    "test_sp_recurrent.py",  # 19-42
    "test_long_ctx_bench.py",  # 45
    "test_serve_echo.py",  # 42
    "test_launch.py",  # 41
    "test_trainer.py",  # 40
    "test_migrate.py",  # 39
    "test_remote.py",  # 34
    "test_bench_hosts_plan.py",  # 22
    "test_hf_dp.py",  # 14 (its compile cases: up to 105 s each on a loaded cold machine)
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # xdist: the order of the collection, below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """``LONG_MODULES`` first, then the other modules by their number of tests (most first, the
    order xdist chose by itself); each module's tests stay together and in their order. The same
    order in every worker."""
    rank = {name: i for i, name in enumerate(LONG_MODULES)}
    count = {}
    for item in items:
        count[item.path] = count.get(item.path, 0) + 1
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -count[item.path]))


@pytest.fixture(scope="session", autouse=True)
def native_kernels():
    """ringkv's C kernels (every ``csrc/*.c``, for the default ISA) built into the suite's kernel
    cache once, before any test: on a cold machine (no ``~/.cache/ringkv/kernels``) every process
    that needs a kernel builds it when it is missing (ranks, spawned engines, servers, benchmark
    runs started side by side): 11 builds of the 3 kernels ran at once in ``test_bench_engine.py``
    alone. One worker builds them (3 compilers at once, a few seconds) under a lock, the other
    waits and finds them; every later process loads them."""
    import fcntl
    from concurrent.futures import ThreadPoolExecutor

    from ringkv.kernels import native

    root = native.cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".tests-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with ThreadPoolExecutor(3) as pool:  # each build waits on its compiler process
            list(pool.map(native.build, sorted(p.stem for p in native.CSRC.glob("*.c"))))
    yield


@pytest.fixture(scope="session")
def fork_context():
    """The multiprocessing context the tests' gloo worlds (``tests.dist.World``) start their ranks
    from: a forkserver that imported torch, transformers' Llama, the engine and the test cases
    once, so a rank is forked in a fraction of a second instead of spawned as an interpreter that
    imports them again (~7 s for a 2-rank world on 2 cores). The ranks are real processes with
    their own gloo groups, as before. One server for the session (the forkserver is a singleton:
    stopping it would leave every rank forked from it reported dead), stopped at the end."""
    import multiprocessing.forkserver

    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        [
            "torch",
            "torch.distributed",
            "transformers.models.llama.modeling_llama",
            "tests.engine_cases",
            "tests.ring_cases",
            "tests.ring_auto_cases",
            "tests.hf_cases",
            "tests.variant_cases",
            "tests.varlen_cases",
        ]
    )
    # the preloaded ringkv reads RINGKV_TIMEOUT_S once, at import: the 60 s a rank sets for itself
    # (tests/dist.py) must be in the server's environment, and only there
    before = os.environ.get("RINGKV_TIMEOUT_S")
    os.environ["RINGKV_TIMEOUT_S"] = before or "60"
    # and a Ctrl-C must raise KeyboardInterrupt in the ranks, as in a terminal, however pytest was
    # started: Python leaves SIGINT ignored when it starts ignored (pytest run as a shell's
    # background job), the server and its ranks would inherit that, and test_faults sends SIGINT
    # (spawned ranks got the handler from test_faults' own _ctrl_c_raises, which runs too late here)
    import signal

    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, old)
        if before is None:
            del os.environ["RINGKV_TIMEOUT_S"]
    yield ctx
    stop = getattr(
        multiprocessing.forkserver._forkserver, "_stop", None
    )  # the server's memory back
    if stop is not None:
        stop()


@pytest.fixture(scope="session")
def worlds(fork_context):
    """``worlds(n)``: a gloo world of exactly ``n`` CPU ranks, started on first use and kept for
    the session (engines need a world of exactly ``tp * pp * sp`` ranks); its ranks are forked
    from ``fork_context``."""
    from tests.dist import World

    started = {}

    def get(n: int) -> World:
        if n not in started:
            started[n] = World(n, context=fork_context)
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
    from pathlib import Path

    from tests.models import HAVE_SMOLLM2

    cache = tmp_path_factory.mktemp("ringkv-cache")
    home = Path(os.environ.get("RINGKV_CACHE") or Path.home() / ".cache" / "ringkv")
    (home / "kernels").mkdir(parents=True, exist_ok=True)
    (cache / "kernels").symlink_to(home / "kernels", target_is_directory=True)
    if HAVE_SMOLLM2:
        from ringkv.model.smollm2 import NAME, smollm2_path

        (cache / NAME).symlink_to(smollm2_path(), target_is_directory=True)
    return str(cache)


@pytest.fixture(scope="session")
def smol_server():
    """``ringkv serve --model <SmolLM2> --served-model-name smol`` (a real process on a loopback
    port, ``tests.test_cluster.Proc``), started once for the modules that serve SmolLM2 with
    the default options (``test_serve.py``, ``test_serve_echo.py``): each start takes ~7 s.
    Their tests leave it as they found it (every request finished or aborted, no blocks held:
    ``test_serve.py`` asserts so)."""
    from tests.models import smollm2_path
    from tests.test_cluster import Proc

    s = Proc("serve", "--model", smollm2_path(), "--served-model-name", "smol")
    yield s
    s.close()
