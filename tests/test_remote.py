"""Moving a running request between two processes over a ``Link`` (a pairwise gloo group made by
a TCP rendezvous on loopback; the other process is ``tests/remote_peer.py``): full and
incremental moves, greedy and seeded, fp32 and int8 caches finish with the unmigrated token
ids and free the source's blocks; a target killed mid-import leaves the request running on the
source (a fast error, not the timeout); a source killed after the final ack leaves it to the
target; a damaged transfer is refused by its checksum and the link serves on; a silent peer
is a timeout on either side. In one process (two threads): tensors of every cache dtype cross
bit for bit in chunks, the receiver allocates each tensor once and the sender copies nothing;
a listener on all interfaces pairs up; a closed end fails its peer at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch

pytest.importorskip("transformers")

from ringkv.engine import LLM, KVSnapshot, SamplingParams  # noqa: E402
from ringkv.engine.remote import (
    MigrationError,
    receive_request,
    recv_snapshot,
    send_request,
    send_snapshot,
)  # noqa: E402
from ringkv.parallel.transfer import Link, LinkError, LinkTimeout  # noqa: E402
from tests.models import tiny_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GREEDY = dict(temperature=0, max_tokens=12)
SEEDED = dict(temperature=0.9, top_p=0.95, max_tokens=12, seed=5)
TIMEOUT = timedelta(seconds=60)
SOURCE = dict(block_size=4, num_blocks=128, max_num_batched_tokens=16)
TARGET = dict(block_size=8, num_blocks=64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    tiny_model("llama", 0, num_hidden_layers=3).save_pretrained(d, safe_serialization=True)
    return str(d)


def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 23, 40, 70)]


_refs = {}


def unmoved_tokens(model_dir, params, **kw):
    """Token ids of ``prompts()`` with ``params`` (one dict per prompt) on one engine, unmoved."""
    key = (json.dumps(params), json.dumps(kw))
    if key not in _refs:
        outs = LLM(model_dir, **SOURCE, **kw).generate(
            prompts(), [SamplingParams(**p) for p in params], use_tqdm=False
        )
        _refs[key] = [o.token_ids for o in outs]
    return _refs[key]


def finish(llm):
    outs = {}
    while llm.has_unfinished_requests():
        for o in llm.step():
            outs[o.request_id] = o.token_ids
    return outs


def all_free(llm) -> bool:
    return (
        llm.core.blocks.num_free == llm.core.blocks.num_blocks
        and not llm.core.pipeline.staged
        and not llm.core.pipeline.paused
    )


class Peer:
    """``tests/remote_peer.py ROLE`` in its own process (killed on exit; its output shown on
    failure)."""

    def __init__(self, role, model_dir, port, **cfg):
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                os.path.join(ROOT, "tests", "remote_peer.py"),
                role,
                model_dir,
                str(port),
                json.dumps(cfg),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
        )

    def __enter__(self):
        return self

    def __exit__(self, kind, *exc):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if kind is not None:
            print(f"--- peer output ---\n{self.output()}")

    def wait(self, timeout=60) -> int:
        return self.proc.wait(timeout)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]


# -- two processes ----------------------------------------------------------------------------
@pytest.mark.parametrize("kv", [{}, dict(kv_cache_dtype="int8")], ids=["fp32", "int8"])
def test_requests_move_to_another_process_and_finish_as_if_never_moved(model_dir, kv):
    params = [GREEDY, SEEDED, GREEDY, SEEDED]
    link = Link.listen(timeout=TIMEOUT)
    with Peer("target", model_dir, link.port, engine=dict(TARGET, **kv), requests=4) as peer:
        src = LLM(model_dir, **SOURCE, **kv)
        rids = [
            src.add_request(p, SamplingParams(**q), request_id=f"r{i}")
            for i, (p, q) in enumerate(zip(prompts(), params))
        ]
        for _ in range(3):  # chunked prefill under way
            src.step()
        stats = [
            send_request(src, rid, link, incremental=i >= 2) for i, rid in enumerate(rids)
        ]  # full, then pre-copy
        res = link.recv_json()
        assert peer.wait() == 0
    link.close()
    assert [res["outputs"][rid] for rid in rids] == unmoved_tokens(model_dir, params, **kv)
    assert (
        res["all_free"]
        and not res["errors"]
        and all_free(src)
        and not src.has_unfinished_requests()
    )
    for s in stats:
        assert 0 < s["downtime_s"] <= s["seconds"] and 0 < s["final_bytes"] <= s["bytes"]
    assert all(s["final_bytes"] == s["bytes"] for s in stats[:2]) and all(
        s["final_bytes"] < s["bytes"] for s in stats[2:]
    )


@pytest.mark.slow
def test_requests_move_between_multi_rank_engines_in_two_processes(model_dir):
    """A spawned tp=2 engine here, a spawned pp=2 x sp=2 engine (block size 2) in the peer
    process: the K/V are gathered from two ranks and scattered to four, over the link."""
    params = [SEEDED, GREEDY, SEEDED, GREEDY]
    link = Link.listen(timeout=TIMEOUT)
    with Peer(
        "target",
        model_dir,
        link.port,
        engine=dict(pp=2, sp=2, block_size=2, num_blocks=256),
        requests=4,
    ) as peer:
        with LLM(model_dir, tp=2, **SOURCE) as src:
            rids = [
                src.add_request(p, SamplingParams(**q), request_id=f"r{i}")
                for i, (p, q) in enumerate(zip(prompts(), params))
            ]
            for _ in range(3):
                src.step()
            link.accept(timedelta(seconds=120))  # the peer spawns its ranks first
            for i, rid in enumerate(rids):
                send_request(src, rid, link, incremental=i % 2 == 0)
            res = link.recv_json()
            assert all_free(src) and not src.has_unfinished_requests()
        assert peer.wait() == 0
    link.close()
    assert [res["outputs"][rid] for rid in rids] == unmoved_tokens(model_dir, params)
    assert res["all_free"] and not res["errors"]


def test_a_target_killed_mid_import_leaves_the_request_running_on_the_source(model_dir):
    link = Link.listen(timeout=TIMEOUT)
    with Peer(
        "target", model_dir, link.port, engine=TARGET, requests=1, die="after-precopy-ack"
    ) as peer:
        src = LLM(model_dir, **SOURCE)
        rid = src.add_request(prompts()[2], SamplingParams(**SEEDED))
        for _ in range(3):
            src.step()
        link.accept()
        t0 = time.monotonic()
        with pytest.raises(MigrationError, match="did not move .it runs here again."):
            send_request(src, rid, link)
        assert time.monotonic() - t0 < 10  # the closed connection, not the 60 s timeout
        assert peer.wait() == -signal.SIGKILL and link.broken
    assert finish(src)[rid] == unmoved_tokens(model_dir, [SEEDED] * 4)[2] and all_free(src)


def test_a_damaged_transfer_is_refused_and_a_source_killed_after_the_final_ack_leaves_it_to_target(
    model_dir,
):
    link = Link.listen(timeout=TIMEOUT)
    with Peer(
        "source",
        model_dir,
        link.port,
        engine=SOURCE,
        prompts=[prompts()[2]],
        params=GREEDY,
        steps=3,
        damage_first=True,
        die="after-final-ack",
    ) as peer:
        dst = LLM(model_dir, **TARGET)
        link.accept()
        with pytest.raises(
            MigrationError, match="checksum"
        ):  # one bit flipped in the K/V on the way
            receive_request(dst, link)
        assert all_free(dst) and not dst.has_unfinished_requests()
        rid = receive_request(
            dst, link
        )  # the source resumed it and sends it again (pre-copy, final)
        assert peer.wait() == -signal.SIGKILL  # it died right after the final ack
    assert "first move failed" in peer.output() and "checksum" in peer.output()
    assert finish(dst)[rid] == unmoved_tokens(model_dir, [GREEDY] * 4)[2] and all_free(dst)


def test_a_silent_peer_is_a_timeout_on_either_side(model_dir):
    short = timedelta(
        seconds=1.5
    )  # each side only waits this out (it was 3 s: 3 s more of waiting)
    a, b = Link.listen(timeout=short), Link.listen(timeout=short)  # one process, two links
    with Peer("silent", model_dir, a.port, ports=[b.port]):
        a.accept(TIMEOUT)  # the peer's start-up may take longer than a message
        b.accept(TIMEOUT)
        llm = LLM(model_dir, **SOURCE)
        rid = llm.add_request(prompts()[1], SamplingParams(**GREEDY))
        llm.step()
        t0 = time.monotonic()
        with pytest.raises(MigrationError, match=r"no answer within 1\.5s") as err:
            send_request(llm, rid, a)  # the pre-copy goes out; its ack never comes
        assert isinstance(err.value.__cause__, LinkTimeout) and 1.5 <= time.monotonic() - t0 < 6.5
        t0 = time.monotonic()
        with pytest.raises(MigrationError, match=r"no answer within 1\.5s"):
            receive_request(llm, b)
        assert 1.5 <= time.monotonic() - t0 < 6.5
    assert finish(llm)[rid] == unmoved_tokens(model_dir, [GREEDY] * 4)[1] and all_free(llm)


# -- the wire, in one process ---------------------------------------------------------------
def pair(**kw):
    """Two ends of a link in this process."""
    a = Link.listen(**kw)
    with ThreadPoolExecutor(1) as ex:
        b = ex.submit(Link.connect, "127.0.0.1", a.port, **kw)
        a.accept()
        return a, b.result()


def recorded(link):
    """Log the chunks each of ``link``'s streams posts (a list per stream)."""
    calls, stream = [], link._stream

    def logged(op, chunks, what, done=None):
        calls.append([])

        def each(chunks):
            for c in chunks:
                calls[-1].append(c)
                yield c

        return stream(op, each(chunks), what, done)

    link._stream = logged
    return calls


def snapshot_like_export(dtype, layers=3, tokens=50, hkv=2, d=8):
    """K/V as export makes them: ``(layers, 2, T, Hkv, D)[:, i]`` (not contiguous), int8 scales."""
    data = (torch.randn(layers, 2, tokens, hkv, d) * 50).to(dtype)
    scale = torch.rand(layers, 2, tokens, hkv).half() if dtype == torch.int8 else None
    return KVSnapshot(
        model="m",
        kv_cache_dtype=str(dtype),
        request_id="r",
        snapshot_id="s",
        base_id=None,
        final=True,
        prompt=[1, 2],
        prompt_token_ids=[1, 2],
        token_ids=[1, 2, 3],
        tokens_from=0,
        params=dict(GREEDY),
        cache_salt=None,
        start=0,
        end=tokens,
        k=data[:, 0],
        v=data[:, 1],
        generator_state=torch.Generator().manual_seed(1).get_state(),
        k_scale=None if scale is None else scale[:, 0],
        v_scale=None if scale is None else scale[:, 1],
    )


def as_bytes(t):
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn], ids=str
)
def test_tensors_cross_bit_for_bit_allocated_once_and_sent_without_a_copy(dtype):
    a, b = pair(timeout=TIMEOUT, chunk_bytes=300)  # several chunks per layer
    sent, received = recorded(a), recorded(b)
    snap = snapshot_like_export(dtype)
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(recv_snapshot, b)
        send_snapshot(a, snap)
        got = fut.result()
    names = [
        n
        for n in ("k", "v", "k_scale", "v_scale", "generator_state")
        if getattr(snap, n) is not None
    ]
    for n in names:
        x, y = getattr(snap, n), getattr(got, n)
        assert (
            y.dtype == x.dtype and y.shape == x.shape and torch.equal(as_bytes(y), as_bytes(x))
        ), n
        assert (
            y.untyped_storage().nbytes() == y.numel() * y.element_size()
        )  # its own buffer, just its size
    assert (
        got.k_scale is None
        or got.k_scale.untyped_storage().data_ptr() != got.v_scale.untyped_storage().data_ptr()
    )
    assert (got.request_id, got.token_ids, got.params, got.v_scale is None) == (
        "r",
        [1, 2, 3],
        GREEDY,
        dtype != torch.int8,
    )
    # the sender's chunks are views of the snapshot's own tensors (length, header, ..., checksum)
    theirs = {getattr(snap, n).untyped_storage().data_ptr() for n in names}
    assert len(sent[0]) > 12 and all(
        c.untyped_storage().data_ptr() in theirs for c in sent[0][2:-1]
    )
    # the receiver's chunks are slices of the tensors it returns (streams: length, header, bytes,
    # checksum)
    ours = {getattr(got, n).untyped_storage().data_ptr() for n in names}
    assert {c.untyped_storage().data_ptr() for c in received[2]} == ours and len(
        received[2]
    ) == len(sent[0]) - 3
    empty = snapshot_like_export(
        dtype, tokens=0
    )  # a preempted request's: no K/V; the link serves on
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(recv_snapshot, b)
        send_snapshot(a, empty)
        assert fut.result().k.shape == (3, 0, 2, 8) and fut.result().k.dtype == dtype
    a.close()
    b.close()


def test_a_link_on_all_interfaces_pairs_up_and_a_closed_end_fails_its_peer_at_once():
    a = Link.listen("0.0.0.0", timeout=TIMEOUT)
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(Link.connect, "127.0.0.1", a.port, TIMEOUT)
        a.accept()
        b = fut.result()
        fut = ex.submit(b.recv_json)
        a.send_json({"ok": True, "n": [1, 2]})
        assert fut.result() == {"ok": True, "n": [1, 2]}
        fut = ex.submit(b.recv_json)
        time.sleep(0.2)
        a.close()
        t0 = time.monotonic()
        with pytest.raises(LinkError, match="closed the link") as err:
            fut.result()
        assert time.monotonic() - t0 < 5 and not isinstance(err.value, LinkTimeout)
    with pytest.raises(LinkError, match="unusable"):
        b.send_json({})
