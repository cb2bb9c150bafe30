"""The unclean paths of the engine, each a reproduction made into a test: a pipeline's step
results that were never released, a closed stream or an interrupted call that threw away other
requests' tokens, a Ctrl-C inside a step that put the ranks out of step, requests held by an
export that stopped admission, store keys that grew with every call, a request whose step could
not be finished; and a fault-injection harness (hypothesis) that raises, interrupts or kills a
random rank at a random step, or closes a stream, under tp, pp and sp in both launch modes.

After each fault: no hang past the timeout; a correct result or a clear error; no leaked
blocks, pending sends or store keys; every other request either unaffected or failed with a
clear error."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

pytest.importorskip("transformers")

from ringkv.engine import LLM, SamplingParams  # noqa: E402
from ringkv.parallel import EngineError  # noqa: E402
from tests.dist import RankError, World, settled_keys  # noqa: E402
from tests.models import tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
TIMEOUT = 10  # the engines' timeout here: a fault must end in an error well within it
MESHES = [dict(tp=2), dict(pp=2), dict(sp=2, sp_prefill_min_tokens=8)]
SPEC = ("tiny", "llama", 0, dict(num_hidden_layers=4))


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", 0, num_hidden_layers=4)


def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 19, 11, 26)]


_refs = {}


def fault_free_tokens(model, ps=None, params=GREEDY):
    """One process, no faults: the tokens every surviving request must get."""
    ps = ps or prompts()
    key = (id(model), repr(ps), repr(params))
    if key not in _refs:
        _refs[key] = [
            o.token_ids
            for o in LLM(model, block_size=4, num_blocks=64).generate(ps, params, use_tqdm=False)
        ]
    return _refs[key]


@pytest.fixture(autouse=True)
def _ctrl_c_raises():
    """A Ctrl-C raises ``KeyboardInterrupt`` here, as in a terminal: Python leaves SIGINT ignored
    when it starts ignored (pytest run as a shell's background job), and these tests send it."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@contextlib.contextmanager
def fault(rank=None, step=None, kind=None):
    """``RINGKV_FAULT`` for the engines built inside (spawned workers inherit it)."""
    if kind is not None:
        os.environ["RINGKV_FAULT"] = json.dumps(dict(rank=rank, step=step, kind=kind))
    try:
        yield
    finally:
        os.environ.pop("RINGKV_FAULT", None)


def engine(model, **kw):
    return LLM(model, block_size=4, num_blocks=48, max_num_batched_tokens=16, timeout=TIMEOUT, **kw)


def drive(llm, until=None) -> dict:
    """Step until nothing is left (or ``until`` is finished); every output by request id."""
    outs = {}
    while llm.has_unfinished_requests() and (until is None or until not in outs):
        for o in llm.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


# keys of the last exchange (a value per rank and its counter) a slower rank has yet to delete
KEY_SLACK = 3


def clean(llm) -> None:
    """Nothing leaked: every block free and consistent, every rank's pending sends bounded."""
    assert not llm.has_unfinished_requests()
    llm.core.blocks.check()
    assert llm.core.blocks.num_free == llm.num_blocks
    assert all(r["pending_sends"] <= 2 * llm.core.shape.pp for r in llm.rank_stats())


# -- the reproductions -----------------------------------------------------------------------


@pytest.mark.slow
def test_pipeline_memory_stays_flat_over_sampled_decode(tmp_path):
    """pp=2, vocabulary 49152, 8 sampled requests: the last stage kept every step's logits
    (4 rows x 49152 x 4 bytes a step) in its send list; 200 steps grew its memory by ~80 MiB."""
    out = tmp_path / "memory.json"
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/engine_memory.py",
            "--pp",
            "2",
            "--steps",
            "200",
            "--every",
            "100",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    growth = json.loads(out.read_text())["growth"]
    assert set(growth) == {"0", "1"}
    for rank, g in growth.items():
        assert g["rss_growth_mib"] < 20 and g["max_pending_sends"] <= 4, (rank, g)


def test_closing_a_stream_keeps_the_other_streams_tokens(model):
    """pp=2: closing one of two interleaved streams threw away the steps in flight, the other
    stream's tokens included; it then failed with 'scheduler made no progress'."""
    ps = prompts()
    want = fault_free_tokens(model)
    with engine(model, pp=2) as llm:
        a, b = llm.stream(ps[0], GREEDY), llm.stream(ps[1], GREEDY)
        got = [next(b).token_id]
        next(a)
        got.append(next(b).token_id)
        next(a)
        next(a)  # this one advanced the engine while b's next step was in flight
        a.close()
        got += [d.token_id for d in b]
        assert got == want[1]
        clean(llm)


def test_an_interrupted_generate_leaves_step_api_requests_running(model):
    """An interrupt inside ``generate`` aborts that call's requests only: a request of the
    step API keeps every token, and ``step()`` reports the tokens ``generate`` advanced."""
    ps = prompts()
    want = fault_free_tokens(model)
    with fault(0, 5, "sigint"), engine(model, pp=2) as llm:
        rid = llm.add_request(ps[0], GREEDY)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(ps[1:3], GREEDY, use_tqdm=False)
        assert (
            llm.core.cluster.broken is None
        )  # the interrupt waited for the step's end on every rank
        assert drive(llm)[rid].token_ids == want[0]
        assert [o.token_ids for o in llm.generate(ps[1:3], GREEDY, use_tqdm=False)] == want[1:3]
        clean(llm)


def test_ctrl_c_mid_step_resynchronises_and_an_interrupt_inside_breaks_at_once(model):
    """tp=2: a Ctrl-C in step 4 left rank 0 out of step with its worker: the next call died on
    a gloo size mismatch or hung for the whole timeout. Now a real SIGINT takes effect at the
    step's end (the engine stays usable and exact); an interrupt raised inside a step breaks the
    engine at once with a clear error, and its workers are stopped."""
    ps = prompts()[:2]
    want = fault_free_tokens(model)[:2]
    with fault(0, 4, "sigint"), engine(model, tp=2) as llm:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(ps, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)] == want
        clean(llm)
    with fault(0, 4, "interrupt"), engine(model, tp=2) as llm:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(ps, GREEDY, use_tqdm=False)
        t = time.monotonic()
        with pytest.raises(EngineError, match="KeyboardInterrupt inside a step"):
            llm.generate(ps, GREEDY, use_tqdm=False)
        assert time.monotonic() - t < 2
        assert not any(p.is_alive() for p in llm.core.cluster.procs)


def test_workers_ignore_a_terminal_ctrl_c(model):
    """A terminal's Ctrl-C reaches the spawned workers too; it is the driver's to handle."""
    ps = prompts()[:2]
    with engine(model, tp=2) as llm:
        os.kill(llm.core.cluster.procs[0].pid, signal.SIGINT)
        time.sleep(0.5)
        assert [o.token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)] == fault_free_tokens(
            model
        )[:2]


def test_blocks_held_by_exports_and_imports_do_not_stop_admission(model):
    """Requests exported with ``stop=True`` and staged imports keep their blocks; a request that
    needed more than were left made the scheduler return nothing ('no progress ... a bug').
    Held blocks are now taken back (the held requests recompute later): nothing is lost."""
    ps = prompts()
    long = ps[3] + ps[1]  # 45 tokens + 8: 14 of the 16 blocks
    want = fault_free_tokens(model, [ps[0], ps[2], long])
    with (
        LLM(model, block_size=4, num_blocks=16) as src,
        LLM(model, block_size=4, num_blocks=16) as dst,
    ):
        a = src.add_request(ps[0], GREEDY)
        b = src.add_request(ps[2], GREEDY)
        for _ in range(3):
            src.step()
        src.export_request(a)  # paused: its blocks kept on src
        staged = src.export_request(b, stop=False)
        dst.import_request(staged)  # staged on dst: blocks held there too
        final = src.export_request(b, since=staged)  # and b paused on src
        for e in (src, dst):
            e.add_request(long, GREEDY, request_id="long")
            assert drive(e)["long"].token_ids == want[2]
        src.resume_request(a)
        assert drive(src)[a].token_ids == want[0]
        dst.import_request(final)
        src.abort_request(b)
        assert drive(dst)[b].token_ids == want[1]
        for e in (src, dst):
            clean(e)


def test_store_keys_stay_flat_over_calls(worlds):
    """Torchrun mode: every call's agreement (``call{n}``) and every ``rank_stats`` (``report{n}``)
    left its keys in the store: 13 keys grew to 114 after 50 calls."""
    res = worlds(2).check("tests.test_faults:store_keys", 2, SPEC, timeout=300)
    for before, after in res:
        assert abs(after - before) <= KEY_SLACK, (before, after)  # was +100


def store_keys(ctx, spec):
    import torch.distributed as dist

    from tests.engine_cases import model_from

    store = dist.distributed_c10d._get_default_store()
    with LLM(model_from(spec), tp=2, block_size=4, num_blocks=32) as llm:
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        llm.rank_stats()
        before = settled_keys(store)
        for _ in range(25):
            llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
            llm.rank_stats()
        return before, settled_keys(store)


def test_spawned_store_keys_stay_flat(model):
    with engine(model, pp=2) as llm:
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
        llm.rank_stats()
        before = settled_keys(llm.core.cluster.store)
        for _ in range(10):
            llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
            llm.rank_stats()
        assert abs(settled_keys(llm.core.cluster.store) - before) <= KEY_SLACK  # was +20


class BrokenDecode:
    """A tokenizer whose decode fails on one token id (finishing that request's step raises)."""

    eos_token_id = None

    def __init__(self, bad: int):
        self.bad = bad

    def decode(self, ids, skip_special_tokens=False):
        if self.bad in ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return " ".join(map(str, ids))


def test_a_request_whose_step_cannot_be_finished_fails_alone(model):
    """An exception while a step's tokens were applied left its requests stuck for good (every
    token marked computed, never scheduled again), holding their blocks."""
    ps = prompts()
    want = fault_free_tokens(model)
    bad = want[1][3]  # the 4th token of request 1
    assert bad not in want[0][:8] and bad not in want[2]
    llm = LLM(
        model, block_size=4, num_blocks=48, max_num_batched_tokens=16, tokenizer=BrokenDecode(bad)
    )
    rids = [llm.add_request(p, GREEDY) for p in ps[:3]]
    outs = drive(llm)
    assert outs[rids[1]].finish_reason == "error" and "UnicodeDecodeError" in outs[rids[1]].error
    assert outs[rids[0]].token_ids == want[0] and outs[rids[2]].token_ids == want[2]
    clean(llm)
    with pytest.raises(RuntimeError, match="UnicodeDecodeError"):  # a stream says why it ended
        list(llm.stream(ps[1], GREEDY))
    clean(llm)


# -- the harness -----------------------------------------------------------------------------


def check_outcome(kind: str, rank: int, errors: list, broken) -> None:
    """What a fault must end in: ``sigint`` on rank 0 interrupts the call it hit and leaves the
    engine usable, on a worker it is ignored; ``close`` harms nothing; the others end in a
    clear error and a broken engine."""
    if kind == "close" or (kind == "sigint" and rank > 0):
        assert not errors and not broken, errors
    elif kind == "sigint":
        assert len(errors) == 1 and "KeyboardInterrupt" in errors[0] and not broken, errors
    else:
        assert errors and broken, (errors, broken)
        assert all(("EngineError" in e or "KeyboardInterrupt" in e) for e in errors), errors


HARNESS = dict(
    deadline=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)  # an example takes seconds: no shrinking


@settings(max_examples=6, **HARNESS)
@given(
    mesh=st.sampled_from(MESHES),
    kind=st.sampled_from(["raise", "interrupt", "sigint", "kill", "close"]),
    rank=st.integers(0, 1),
    step=st.integers(0, 8),
)
def test_fault_injection_spawned(model, mesh, kind, rank, step):
    """Spawn mode (this process is rank 0 and cannot be killed here: kill hits rank 1). A step-API
    request runs beside a stream and a ``generate``; whatever the fault, the call it hits ends
    within the timeout, and whatever survives is exact and leaks nothing."""
    if kind == "kill":
        rank = 1
    ps = prompts()
    want = fault_free_tokens(model)
    errors = []
    with fault(rank, step, None if kind == "close" else kind), engine(model, **mesh) as llm:
        t0 = time.monotonic()  # the calls, not the start (a loaded machine spawns slowly)
        keys = settled_keys(llm.core.cluster.store)
        rid = llm.add_request(ps[3], GREEDY)
        try:
            it, got = llm.stream(ps[0], GREEDY), []
            for d in it:
                got.append(d.token_id)
                if kind == "close" and len(got) == step % 7 + 1:
                    it.close()
                    break
            if kind != "close":
                assert got == want[0]
            assert [o.token_ids for o in llm.generate(ps[1:3], GREEDY, use_tqdm=False)] == want[1:3]
        except (EngineError, KeyboardInterrupt) as e:
            errors.append(f"{type(e).__name__}: {e}")
        assert time.monotonic() - t0 < TIMEOUT + 20
        check_outcome(kind, rank, errors, llm.core.cluster.broken)
        if llm.core.cluster.broken:
            t = time.monotonic()
            with pytest.raises(EngineError, match="broken"):
                llm.step()
            assert time.monotonic() - t < 2
            return
        assert drive(llm)[rid].token_ids == want[3]  # the step-API request never lost a token
        assert [o.token_ids for o in llm.generate(ps[1:3], GREEDY, use_tqdm=False)] == want[1:3]
        clean(llm)
        assert abs(settled_keys(llm.core.cluster.store) - keys) <= KEY_SLACK


# Torchrun mode: a rank that fails leaves its peers waiting the engine's timeout (up to twice per
# example), so these engines get a shorter one than TIMEOUT; the calls that do not fail take
# well under a second.
TORCHRUN_TIMEOUT = 5


@pytest.fixture(scope="module")
def fresh_world(fork_context):
    """``fresh_world()``: a new 2-rank gloo world (a fault leaves its world unusable), its ranks
    forked from the session's server that imported torch and the engine once (``fork_context``,
    ``tests/conftest.py``): a fraction of a second each, not the ~7 s of two spawned interpreters
    importing them."""
    return lambda: World(2, context=fork_context)


def torchrun_fault_run(world, mesh: dict, fault, close_after):
    """``engine_cases.fault_run`` on both ranks of ``world`` (then killed): each rank's outcome."""
    try:
        return world.run(
            "tests.engine_cases:fault_run",
            2,
            SPEC,
            dict(
                mesh,
                block_size=4,
                num_blocks=48,
                max_num_batched_tokens=16,
                timeout=TORCHRUN_TIMEOUT,
            ),
            fault,
            close_after,
            prompts()[:3],
            GREEDY,
            timeout=3 * TORCHRUN_TIMEOUT + 60,
        )
    finally:
        world.kill()


def test_torchrun_engine_broken_by_a_dead_rank_fails_the_next_calls_at_once(fresh_world):
    """Torchrun pp=2, rank 1 killed in step 5: rank 0's call fails within the timeout and breaks
    the engine. Its next calls waited the whole timeout again each (the call handshake with the
    dead rank ran before the broken check): now they fail at once, saying the engine is broken."""
    res = torchrun_fault_run(fresh_world(), dict(pp=2), dict(rank=1, step=5, kind="kill"), None)
    assert isinstance(res[1], RankError) and res[1].type == "died", res[1]
    out = res[0]
    assert out["broken"] and len(out["errors"]) == 3, out
    assert out["stream_s"] < TORCHRUN_TIMEOUT + 10, out  # the failing call: within the timeout
    for call in ("generate", "again"):
        assert out[f"{call}_s"] < 1, out  # at once, not another timeout
    assert all("EngineError" in e and "broken" in e for e in out["errors"][1:]), out


@pytest.mark.parametrize("move", ["export", "import"])
def test_a_kv_move_whose_sides_disagree_on_a_size_is_an_error_on_every_rank(fresh_world, move):
    """Torchrun sp=2 with rank 1's K/V slots computed one token short: moving a request's K/V
    (export: rank 1 sends its box; import: it receives one) was a gloo receive of the wrong size,
    which aborted the process (SIGABRT). Both sides now agree on each box's size first: each rank
    raises an ``EngineError`` naming both sizes, at once (well within the timeout)."""
    world = fresh_world()
    try:
        res = world.run(
            "tests.engine_cases:kv_size_mismatch",
            2,
            SPEC,
            prompts()[1],
            move,
            TORCHRUN_TIMEOUT,
            timeout=3 * TORCHRUN_TIMEOUT + 60,
        )
    finally:
        world.kill()
    for r, out in enumerate(res):
        assert not isinstance(out, RankError), (r, out)  # no rank died
        assert (
            out["error"]
            and "model rank 1 stores" in out["error"]
            and "the driver expects" in out["error"]
        ), (r, out)
        assert out["s"] < TORCHRUN_TIMEOUT, (r, out)
    import re

    start, end, got, want = map(
        int,
        re.search(
            r"tokens \[(\d+), (\d+)\): model rank 1 stores (\d+) of them "
            r"\(\d+ bytes\), the driver expects (\d+) ",
            res[0]["error"],
        ).groups(),
    )
    assert want == len(range(start + (1 - start) % 2, end, 2)) > 0 and got == want - 1, res[
        0
    ]  # rank 1: odd tokens


@settings(max_examples=4, **HARNESS)
@given(
    mesh=st.sampled_from(MESHES),
    kind=st.sampled_from(["raise", "interrupt", "sigint", "kill", "close"]),
    rank=st.integers(0, 1),
    step=st.integers(0, 8),
)
def test_fault_injection_torchrun(model, fresh_world, mesh, kind, rank, step):
    """Torchrun mode: every rank runs the same calls (a stream, a ``generate``, another one) in a
    fresh 2-rank gloo world, and any rank may be the one that fails or is killed."""
    want = fault_free_tokens(model)
    close_after = step % 7 + 1 if kind == "close" else None
    t0 = time.monotonic()
    res = torchrun_fault_run(
        fresh_world(),
        mesh,
        None if kind == "close" else dict(rank=rank, step=step, kind=kind),
        close_after,
    )
    assert time.monotonic() - t0 < 3 * TORCHRUN_TIMEOUT + 60
    for r, out in enumerate(res):
        if isinstance(out, RankError):  # only the killed rank may not answer
            assert kind == "kill" and r == rank and out.type == "died", out
            continue
        if (
            out["broken"] is None
        ):  # every call that returned is exact (an interrupted one returned nothing)
            assert out.get("generate", want[1:3]) == want[1:3] and out["again"] == want[1:3], out
            assert abs(out["key_growth"]) <= KEY_SLACK, out
            if r == 0:
                assert out["free"] == out["num_blocks"], out
            if "stream" in out:
                assert out["stream"] == want[0][: close_after or len(want[0])], out
        if kind in ("close",):
            assert not out["errors"], out
        elif kind == "sigint":  # the interrupted rank raises; rank 0 ends the call for everyone
            assert len(out["errors"]) <= 1 and out["broken"] is None, out
            assert bool(out["errors"]) == (r == rank or rank == 0), out
        else:
            assert out["errors"] and all(
                ("Error" in e or "KeyboardInterrupt" in e) for e in out["errors"]
            ), out
