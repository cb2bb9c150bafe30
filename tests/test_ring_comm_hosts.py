"""A ring hop between two hosts (network namespaces, tests/hosts.py) at 100 Mbit/s sends both
directions at once when one rank posts late.

gloo's TCP transport sends a payload only after the receiver's "ready to receive" note, on the
one connection both directions between two ranks share. A hop that posted its send first (to a
peer already waiting) queued its own note behind its payload, so with two ranks the two
directions crossed the link one after the other: the engine's ``sp=2`` prefill across two
hosts ran 35-40% slower than the link allows (docs/plan.md). ``RingComm`` posts receives first.

Run on a host: ``python tests/test_ring_comm_hosts.py RANK OUT`` (the worker)."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import pytest

from ringkv.planner import parse_rate
from tests.hosts import Hosts, missing, tbf_burst, wait_all

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(missing() is not None, reason=str(missing())),
]

NBYTES = 512 << 10  # each way: one TP rank's K/V of a layer in the hosts_plan SP prefill
LATE_S = 0.04  # the late rank posts this long after the other
ROUNDS = 8  # the late rank alternates
RATE = "100mbit"


def test_a_late_ranks_hop_sends_both_ways_at_once(tmp_path):
    with Hosts(2, rate=RATE) as h:
        procs = []
        for i in range(2):
            env = {"OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
            env.update(RANK=str(i), WORLD_SIZE="2", LOCAL_WORLD_SIZE="1")
            env.update(MASTER_ADDR=h.addr(0), MASTER_PORT="29671")
            log = open(tmp_path / f"host{i}.log", "w")
            cmd = ["python", os.path.abspath(__file__), str(i), str(tmp_path)]
            procs.append(h.run(i, cmd, env=env, stdout=log, stderr=log))
            log.close()
        codes = wait_all(procs, 120)
    logs = [(tmp_path / f"host{i}.log").read_text()[-2000:] for i in range(2)]
    assert codes == [0, 0], logs
    times = json.loads((tmp_path / "times.json").read_text())
    # one payload's time on the link: its TCP/IP frames (1514 bytes per 1448 of payload) less
    # the bucket tbf passes at once, at the rate: ~34 ms; one direction after the other: ~68 ms
    one = (NBYTES * 1514 / 1448 - tbf_burst(RATE)) / parse_rate(RATE)
    got = statistics.median(times)
    assert 0.6 * one < got < 1.5 * one, (got, one, times)


def _worker(rank: int, out: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from ringkv.parallel import net
    from ringkv.sp.comm import RingComm

    net.pick_interface()
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    comm = RingComm(timeout=timedelta(seconds=30))
    send = torch.full((NBYTES // 4,), float(rank))
    recv = torch.empty_like(send)
    times = []
    for i in range(ROUNDS):
        late = i % 2
        dist.barrier()
        if rank == late:
            time.sleep(LATE_S)
        t = time.perf_counter()
        comm.send_recv([send], [recv]).wait()
        x = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
        dist.broadcast(x, late)  # the late rank's post to its last completion
        times.append(x.item())
        assert torch.equal(recv, torch.full_like(recv, float(1 - rank)))
    if rank == 0:
        with open(os.path.join(out, "times.json"), "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2])
