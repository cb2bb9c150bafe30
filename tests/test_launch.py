"""The spawn launch mode: a plain process asks for several ranks and ringkv starts, drives and
stops the worker processes itself; a dead worker is an error on the driver within the
timeout; bad configurations fail before anything starts."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

pytest.importorskip("transformers")

from ringkv.engine import LLM, SamplingParams  # noqa: E402
from ringkv.parallel import EngineError  # noqa: E402
from tests.models import hf_greedy, tiny_model  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", 0, num_hidden_layers=3)


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in (4, 19, 37)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_spawned_ranks_equal_transformers_and_stop_on_close(model):
    want = hf_greedy(model, prompts(), 6)
    with LLM(model, tp=2, pp=2, block_size=4, num_blocks=64) as llm:
        pids = [p.pid for p in llm.core.cluster.procs]
        assert len(pids) == 4 and all(
            alive(p) for p in pids
        )  # every model rank is a worker; this process drives
        assert [o.token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)] == want
        assert [
            o.token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)
        ] == want  # and again
        stats = llm.rank_stats()
        assert [s["rank"] for s in stats] == [0, 1, 2, 3] and all(s["steps"] > 0 for s in stats)
    assert llm.core.cluster.mode == "closed"  # a spawn driver after close() (ClusterMode.CLOSED)
    deadline = time.time() + 10
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)
    with LLM(
        model, sp=2, block_size=4, num_blocks=64, sp_prefill_min_tokens=16
    ) as llm:  # a second engine
        assert [o.token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)] == want


def test_closed_with_steps_in_flight_every_rank_exits_by_itself(model):
    """Closed while requests run (a pp=2 pipeline keeps steps in flight): the driver takes those
    steps' results first, so the sampler rank's result sends complete and every worker exits on
    its own. Before, the close waited out its 10 s join and then killed them (exit code -9)."""
    llm = LLM(model, pp=2, block_size=4, num_blocks=64)
    for i in range(4):
        llm.add_request(
            [1, 2, 3 + i], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        )
    for _ in range(6):
        llm.step()
    assert llm.core.peak_in_flight == 2 and llm.core.has_unfinished_requests()
    procs = list(llm.core.cluster.procs)
    llm.close()
    assert [p.exitcode for p in procs] == [0, 0]


def test_killed_worker_is_an_error_within_the_timeout(model):
    llm = LLM(model, pp=2, block_size=4, num_blocks=64, timeout=5)
    try:
        llm.generate(prompts()[:1], GREEDY, use_tqdm=False)
        os.kill(
            llm.core.cluster.procs[1].pid, signal.SIGKILL
        )  # model rank 1 (procs[r] is model rank r)
        t = time.time()
        with pytest.raises(EngineError, match="rank 1"):
            llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert time.time() - t < 15
        with pytest.raises(EngineError, match="broken"):
            llm.generate(prompts(), GREEDY, use_tqdm=False)
    finally:
        llm.close()


def test_bad_configurations_fail_before_any_process_starts(model):
    before = multiprocessing.active_children()
    for kw, word in [
        (dict(tp=3), "use tp in"),
        (dict(tp=2, kv_cache_memory=10), "holds no block"),
        (dict(pp=4), "exceeds the model's 3 layers"),
        (dict(sp=0), "sp must be"),
        (dict(tp=2, num_blocks=1, max_model_len=100), "max_model_len"),
        (dict(pp=2, pp_layers=[1, 1]), "pp_layers"),
        (dict(tp=2, gpu_memory_utilization=2), "(0, 1]"),
    ]:
        with pytest.raises(ValueError, match=word.replace("(", r"\(").replace("]", r"\]")):
            LLM(model, **kw)
    assert multiprocessing.active_children() == before


def test_program_exit_stops_its_workers(tmp_path):
    """A script that never calls close(): its workers stop when it exits, and it needs no
    ``if __name__ == "__main__"`` guard (workers do not re-run the script)."""
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.getcwd()!r})
        from ringkv.engine import LLM, SamplingParams
        from tests.models import tiny_model
        llm = LLM(tiny_model("llama", 0, num_hidden_layers=2), tp=2, block_size=4, num_blocks=32)
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        pids = [p.pid for p in llm.core.cluster.procs]
        print("PIDS", *pids, "TOKENS", *out[0].token_ids, flush=True)
    """)
    )
    res = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert res.returncode == 0, res.stderr
    line = next(out_line for out_line in res.stdout.splitlines() if out_line.startswith("PIDS"))
    pids = [int(x) for x in line.split()[1 : line.split().index("TOKENS")]]
    assert len(pids) == 2  # both model ranks are workers; the script drives
    deadline = time.time() + 10
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)
