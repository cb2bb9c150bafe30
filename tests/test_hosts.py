"""torchrun --nnodes 2 across two real hosts (network namespaces, tests/hosts.py): the ring and
the engine over a shaped link, both rendezvous forms, the socket interface chosen by ringkv,
and its error when it cannot choose one. Each host's /etc/hosts maps the hostname to
127.0.1.1 and no GLOO_SOCKET_IFNAME is set: gloo alone would advertise loopback."""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import pytest

from tests.hosts import Hosts, missing, wait_all

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(missing() is not None, reason=str(missing())),
]

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hosts_worker.py")
RUN = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"]
ENV = {"OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def hosts():
    h = Hosts(2, rate="1gbit")
    try:
        yield h.up()
    finally:
        h.down()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Llama (4 heads, 2 KV heads, 4 layers) saved as safetensors."""
    from tests.models import tiny_model

    d = tmp_path_factory.mktemp("hosts_model")
    m = tiny_model("llama", 3, num_hidden_layers=4, hidden_size=64)
    m.save_pretrained(d, safe_serialization=True)
    return str(d)


@pytest.fixture(scope="module")
def want(model):
    """The single-process engine's greedy tokens of the worker's prompts."""
    from ringkv.engine import LLM, SamplingParams
    from tests.hosts_worker import MAX_TOKENS, PROMPTS

    with LLM(model, block_size=4, num_blocks=48) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        tokens = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert all(len(t) == MAX_TOKENS for t in tokens)
    return tokens


def launch(hosts, out, rdzv, checks, model="", timeout=120):
    """torchrun on both hosts; ``rdzv(i)``: host i's rendezvous flags. Returns the exit codes,
    each host's output and the ranks' reports."""
    os.makedirs(out, exist_ok=True)
    procs = []
    for i in range(2):
        log = open(os.path.join(out, f"host{i}.log"), "w")
        cmd = [*RUN, *rdzv(i), WORKER, str(out), checks, model]
        procs.append(hosts.run(i, cmd, env=ENV, stdout=log, stderr=log))
        log.close()
    codes = wait_all(procs, timeout)
    logs = [open(os.path.join(out, f"host{i}.log")).read() for i in range(2)]
    reports = {}
    for name in os.listdir(out):
        if name.startswith("rank"):
            with open(os.path.join(out, name)) as f:
                r = json.load(f)
            reports[r["rank"]] = r
    return codes, logs, reports


def check_world(hosts, codes, logs, reports):
    assert codes == [0, 0], logs
    assert sorted(reports) == [0, 1, 2, 3]
    for r in reports.values():
        assert r["world"] == 4
        # every rank chose its own host's veth, not loopback, and told NCCL the same
        assert r["gloo"] in (hosts.ifname(0), hosts.ifname(1)) and r["nccl"] == r["gloo"]
    assert {r["gloo"] for r in reports.values()} == {hosts.ifname(0), hosts.ifname(1)}


def test_master_addr_engine_tp_inside_pp_across_and_the_ring(hosts, model, want, tmp_path):
    """--master-addr with --node-rank: LLM(tp=2, pp=2) (tp inside a host, pp across) gives the
    single-process greedy tokens; the ring at world 4 is exact against one process; a tiny HF
    Llama patched over the 4 ranks (patch_model) trains exactly: loss and every gradient."""
    port = 29611

    def rdzv(i):
        return ["--node-rank", str(i), "--master-addr", hosts.addr(0), "--master-port", str(port)]

    codes, logs, reports = launch(hosts, tmp_path, rdzv, "pp,ring,train", model)
    check_world(hosts, codes, logs, reports)
    for r in reports.values():
        assert r["tokens"] == want
        assert r["ring"] == []
        assert r["train"]["bad"] == [] and r["train"]["params"] > 0, r["train"]
    # tp is inside a host: ranks 0, 1 (stage 0) on one host, ranks 2, 3 (stage 1) on the other
    assert reports[0]["gloo"] == reports[1]["gloo"] != reports[2]["gloo"] == reports[3]["gloo"]


def test_c10d_rendezvous_engine_tp_inside_sp_across(hosts, model, want, tmp_path):
    """--rdzv-backend c10d --rdzv-endpoint HOST0:PORT: the endpoint is not the hostname's address,
    so node 0 says is_host=1; --local-addr makes the workers' MASTER_ADDR routable.
    LLM(tp=2, sp=2) (prompts of 16 tokens or more ring across the hosts) gives the
    single-process greedy tokens; the ring is exact."""
    port = 29612

    def rdzv(i):
        flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.addr(0)}:{port}"]
        flags += ["--rdzv-id", "hosts-c10d", "--local-addr", hosts.addr(i)]
        return flags + (["--rdzv-conf", "is_host=1"] if i == 0 else [])

    codes, logs, reports = launch(hosts, tmp_path, rdzv, "sp,ring", model)
    check_world(hosts, codes, logs, reports)
    for r in reports.values():
        assert r["tokens"] == want
        assert r["ring"] == []
        assert r["master"] in (hosts.addr(0), hosts.addr(1))
    # tp inside a host (ranks 0, 1 and 2, 3), sp across
    assert reports[0]["gloo"] == reports[1]["gloo"] != reports[2]["gloo"] == reports[3]["gloo"]


def test_a_loopback_master_fails_at_once_naming_the_variables(hosts, tmp_path):
    """c10d without --local-addr: the workers' MASTER_ADDR is node 0's hostname, loopback on
    every host. ringkv says so before any group is made, in seconds, not gloo's
    'Connection refused, remote=[127.0.0.1]' after its timeout."""
    port = 29613

    def rdzv(i):
        flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.addr(0)}:{port}"]
        return flags + ["--rdzv-id", "hosts-bad"] + (["--rdzv-conf", "is_host=1"] if i == 0 else [])

    t = time.monotonic()
    codes, logs, reports = launch(hosts, tmp_path, rdzv, "ring", timeout=60)
    took = time.monotonic() - t
    assert codes[0] != 0 and codes[1] != 0 and reports == {}
    for log in logs:
        assert "InterfaceError" in log and "GLOO_SOCKET_IFNAME" in log, log
        assert f"the master address {socket.gethostname()!r} is 127.0.1.1" in log, log
        assert "Connection refused" not in log
    assert took < 45, took
