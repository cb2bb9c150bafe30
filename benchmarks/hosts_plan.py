"""The planner against shaped links: 2 hosts x 2 ranks (network namespaces, ``tests/hosts.py``),
measured at several link rates, each case predicted by ``ringkv.planner`` from the link's
parameters alone.

    python benchmarks/hosts_plan.py --json results/hosts_plan.json          # as root, ~5-6 min
    python benchmarks/hosts_plan.py --small --json /tmp/hp.json             # the test's size

Cases (``torchrun --nnodes 2 --nproc-per-node 2`` on the two hosts, ``OMP_NUM_THREADS=1``):

- ``ring fwd`` / ``ring fwd+bwd``: ``ring_attention`` at world 4 (ranks 0, 1 on host 0, 2, 3 on
  host 1; the ring 0 -> 1 -> 2 -> 3 -> 0 crosses the hosts twice), zigzag layout, causal, fp32,
  ``--seq`` tokens, 8 query heads, 2 KV heads, head_dim 64; each also without communication
  (``LocalComm``): the overlap is time / no-comm time;
- ``tp2pp2 prefill`` / ``decode`` and ``tp2sp2 prefill`` / ``decode``: ``LLM(tp=2, pp=2)`` and
  ``LLM(tp=2, sp=2)`` (TP inside a host, PP or SP across) on a random Llama (8 layers, hidden
  512, 8 heads, 4 KV heads, vocabulary 4096, float32): one request of ``--prompt`` tokens
  through ``LLM.stream``, its time to the first token (prefill) and to each of the next
  ``--decode`` tokens (a decode step);
- ``migration``: the K/V of a request of ``--migrate`` tokens of that model, sent from host 1 to
  host 0 over a ``parallel.transfer.Link`` (what ``engine/remote.py`` moves requests over).

Each world runs through a schedule of rates: every shaped measurement (``--iters`` per rate)
between two unshaped ones (the links are re-shaped while the world waits). Compute comes from
the unshaped runs around each measurement (two before, two after; medians): the attention rate
of a ring step from the no-communication times, the engine's matmul rate and host seconds per
layer (``fit_engine``, per mesh) from the unshaped prefill and decode, the migration's host
bytes/s (copies and checksum, not overlapping the wire on these loaded cores) from the
unshaped time less its wire time; the unshaped link's bandwidth and latency are probed in the
same world. A shaped link is then given to the planner as its tbf rate x 1448/1514 (the TCP
payload of a 1514-byte Ethernet frame, which tbf counts), no faster than the probed unshaped
bandwidth, one per host (``Rates.shared``), with the probed latency; nothing else is fitted.
Prints one table (case, rate, predicted, measured, error: medians over a rate's measurements;
each unshaped one predicted from the unshaped ones around it) and writes JSON (every
measurement, with the load average and host 0's TCP retransmissions and timeouts).
docs/plan.md has a run and what it shows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

PAYLOAD = 1448 / 1514  # TCP payload bytes per Ethernet frame (MTU 1500, timestamps) that tbf counts
MODEL = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_hidden_layers=8,
    vocab_size=4096,
    max_position_embeddings=16384,
)
RING = dict(heads=8, kv_heads=2, head_dim=64)
KINDS = ("ring", "pp", "sp")  # the torchrun worlds: ring (+ probes, migration), the two engines


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", nargs="+", default=["100mbit", "1gbit", "10gbit"])
    p.add_argument("--seq", type=int, default=8192, help="ring attention tokens (world 4)")
    p.add_argument("--prompt", type=int, default=1024, help="engine prefill tokens")
    p.add_argument("--decode", type=int, default=8, help="decode steps timed")
    p.add_argument("--migrate", type=int, default=2048, help="tokens whose K/V migrate")
    p.add_argument("--iters", type=int, default=4, help="measurements of each shaped rate")
    p.add_argument("--cases", default="ring,pp,sp", help="worlds to run: ring, pp, sp")
    p.add_argument("--small", action="store_true", help="the test's size (one rate, ring only)")
    p.add_argument("--timeout", type=float, default=400, help="seconds a world may take")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", nargs=2, metavar=("KIND", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.small:
        a.rates, a.seq, a.prompt, a.decode, a.migrate, a.iters = ["1gbit"], 2048, 128, 2, 256, 1
        a.cases = "ring"
    a.cases = [c for c in a.cases.split(",") if c]
    bad = [c for c in a.cases if c not in KINDS]
    if bad or not a.cases:
        p.error(f"--cases: choose among {','.join(KINDS)}, got {bad or a.cases}")
    for n in ("seq", "prompt", "decode", "migrate", "iters"):
        if getattr(a, n) < 1:
            p.error(f"--{n} must be >= 1")
    if a.seq % 8:
        p.error("--seq must be a multiple of 8 (zigzag over 4 ranks)")
    return a


def schedule(rates, iters: int):
    """Each shaped rate ``iters`` times, every entry preceded by an unshaped one, one more at the
    end: each shaped measurement has an unshaped one just before and just after it."""
    return [x for rate in rates for _ in range(iters) for x in (None, rate)] + [None]


# -- the worker: one rank of a world ----------------------------------------------------------
def _retransmits() -> int:
    """TCP segments this host (network namespace) has retransmitted (/proc/net/snmp)."""
    with open("/proc/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Tcp:")]
    return int(rows[1][rows[0].index("RetransSegs")])


def _link_bytes() -> int:
    """Bytes this host (network namespace) has sent and received over its links (not loopback):
    ``ip netns exec`` mounts the namespace's own /sys."""
    total = 0
    for dev in os.listdir("/sys/class/net"):
        if dev != "lo":
            for way in ("tx_bytes", "rx_bytes"):
                with open(f"/sys/class/net/{dev}/statistics/{way}") as f:
                    total += int(f.read())
    return total


def _timeouts() -> int:
    """TCP retransmission timeouts on this host (/proc/net/netstat TCPTimeouts)."""
    with open("/proc/net/netstat") as f:
        rows = [line.split() for line in f if line.startswith("TcpExt:")]
    return int(rows[1][rows[0].index("TCPTimeouts")])


def _sync(out: str, i: int, rank: int, timeout: float = 120.0) -> None:
    """Rank 0 asks the driver for schedule entry ``i``'s shaping and waits until it is done."""
    if rank != 0:
        return
    open(os.path.join(out, f"need_{i}"), "w").close()
    end = time.monotonic() + timeout
    while not os.path.exists(os.path.join(out, f"have_{i}")):
        if time.monotonic() > end:
            raise TimeoutError(f"the driver did not shape the links for entry {i}")
        time.sleep(0.05)


def _ring_world(args, out: str, sched) -> None:
    import torch
    import torch.distributed as dist

    import ringkv
    from ringkv.parallel import net
    from ringkv.parallel.transfer import Link
    from ringkv.sp import LocalComm

    net.pick_interface()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    s, h, hkv, d = args.seq, RING["heads"], RING["kv_heads"], RING["head_dim"]
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(1, s // world, h, d, generator=g)
    k, v = (torch.randn(1, s // world, hkv, d, generator=g) for _ in range(2))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def fwd(comm=None):
        def f():
            with torch.no_grad():
                ringkv.ring_attention(q, k, v, causal=True, layout="zigzag", comm=comm)

        return f

    def fwdbwd(comm=None):
        def f():
            o = ringkv.ring_attention(qg, kg, vg, causal=True, layout="zigzag", comm=comm)
            o.backward(torch.ones_like(o))

        return f

    def timed(fn):
        """Seconds of ``fn`` on the slowest rank."""
        dist.barrier()
        t = time.perf_counter()
        fn()
        x = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return x.item()

    local = LocalComm(rank, world)
    layers, kvh_m = MODEL["num_hidden_layers"], MODEL["num_key_value_heads"]
    dm = MODEL["hidden_size"] // MODEL["num_attention_heads"]
    kv = torch.randn(layers, 2, args.migrate, kvh_m, dm) if rank == 2 else None
    link = None
    addrs = os.environ["HOSTS_PLAN_ADDRS"].split(",")
    if rank == 0:
        link = Link.listen(addrs[0], 29700, timeout=timedelta(seconds=120))
        link.accept()
    elif rank == 2:
        link = Link.connect(addrs[0], 29700, timeout=timedelta(seconds=120))
    for f in (fwd(), fwd(local), fwdbwd(), fwdbwd(local)):  # warm-up
        timed(f)
    rows = []
    for i, rate in enumerate(sched):
        _sync(out, i, rank)
        dist.barrier()
        row = dict(rate=rate, loadavg=open("/proc/loadavg").read().split()[:3])
        before, timeouts = _retransmits(), _timeouts()
        row.update(_probe(rank, dist, torch, rate))
        row["ring_fwd_s"] = timed(fwd())
        row["ring_fwd_nocomm_s"] = timed(fwd(local))
        row["ring_fwdbwd_s"] = timed(fwdbwd())
        row["ring_fwdbwd_nocomm_s"] = timed(fwdbwd(local))
        dist.barrier()
        t = time.perf_counter()
        if rank == 2:
            link.send({"kv": args.migrate}, {"kv": kv}, "the migration's K/V")
            link.recv_json("the receiver's ack")
        elif rank == 0:
            link.recv("the migration's K/V")
            link.send_json({"ok": True})
        x = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
        dist.broadcast(x, 0)  # the receiver's time (its last byte and the ack)
        row["migration_s"] = x.item()
        row["migration_bytes"] = layers * 2 * args.migrate * kvh_m * dm * 4
        row["retransmits_host0"] = _retransmits() - before
        row["rto_host0"] = _timeouts() - timeouts
        rows.append(row)
    dist.barrier()
    if link is not None:
        link.close()
    if rank == 0:  # written last: the driver takes it as the world's end
        with open(os.path.join(out, "ring.json"), "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def _probe(rank, dist, torch, rate) -> dict:
    """Latency (half a median round trip of 8 bytes) inside a host (0 <-> 1) and across (0 <->
    2), and the bandwidth across (one send 2 -> 0 of 0.2 s at the nominal rate, at most 32 MiB)."""
    from ringkv.planner import parse_rate

    out = {}
    x = torch.zeros(2, dtype=torch.float32)
    for name, peer in (("intra", 1), ("inter", 2)):
        rtts = []
        for _ in range(30):
            t = time.perf_counter()
            if rank == 0:
                dist.send(x, peer)
                dist.recv(x, peer)
            elif rank == peer:
                dist.recv(x, 0)
                dist.send(x, 0)
            rtts.append(time.perf_counter() - t)
        y = torch.tensor([statistics.median(rtts[5:]) / 2], dtype=torch.float64)
        dist.broadcast(y, 0)
        out[f"latency_{name}_s"] = y.item()
    nbytes = int(min(32 << 20, 0.2 * parse_rate(rate))) if rate else 32 << 20
    buf = torch.empty(nbytes // 4, dtype=torch.float32)
    dist.barrier()
    t = time.perf_counter()
    if rank == 2:
        dist.send(buf, 0)
    elif rank == 0:
        dist.recv(buf, 2)
    y = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
    dist.broadcast(y, 0)
    out["bandwidth_inter"] = nbytes / y.item()
    return out


def _blocks(args, entries: int) -> int:
    """KV blocks for every request of the run (one per entry and the warm-up) to stay cached:
    no request evicts another's blocks (eviction, with the host tier behind it, is work the
    model does not price)."""
    return (entries + 2) * (-(-(args.prompt + args.decode) // 16) + 1) + 64


def _engine_world(args, kind: str, out: str, sched) -> None:
    import torch

    from ringkv.engine import LLM, SamplingParams

    model = os.path.join(out, "..", "model")
    kw = dict(tp=2, block_size=16, num_blocks=_blocks(args, len(sched)))
    kw.update(max_num_batched_tokens=args.prompt, max_num_seqs=4, timeout=120)
    kw.update({kind: 2}, **({"sp_prefill_min_tokens": 64} if kind == "sp" else {}))
    rows, salt = [], [0]

    def prompt():
        salt[0] += 1
        g = torch.Generator().manual_seed(salt[0])
        return torch.randint(0, MODEL["vocab_size"], (args.prompt,), generator=g).tolist()

    def run():
        """(seconds to the first token, seconds per later token) of one request."""
        params = SamplingParams(temperature=0, max_tokens=1 + args.decode, ignore_eos=True)
        t, nbytes = [time.perf_counter()], [_link_bytes()]
        for _ in llm.stream(prompt(), params):
            t.append(time.perf_counter())
            nbytes.append(_link_bytes())
        if rows:  # (not the warm-up's)
            rows[-1]["prefill_link_bytes_host0"] = nbytes[1] - nbytes[0]
        return t[1] - t[0], (t[-1] - t[1]) / args.decode

    with LLM(model, **kw) as llm:
        rank = llm.core.cluster.rank
        run()  # warm-up
        for i, rate in enumerate(sched):
            _sync(out, i, rank)
            row = dict(rate=rate, loadavg=open("/proc/loadavg").read().split()[:3])
            rows.append(row)
            before, timeouts, nbytes = _retransmits(), _timeouts(), _link_bytes()
            row["prefill_s"], row["decode_step_s"] = run()
            row["link_bytes_host0"] = _link_bytes() - nbytes  # both ways, the whole request
            row["retransmits_host0"] = _retransmits() - before
            row["rto_host0"] = _timeouts() - timeouts
    if rank == 0:
        with open(os.path.join(out, f"{kind}.json"), "w") as f:
            json.dump(rows, f)


# -- the driver ---------------------------------------------------------------------------------
def _save_model(path: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**MODEL, tie_word_embeddings=False)
    m = transformers.LlamaForCausalLM(cfg).to(torch.float32).eval()
    m.save_pretrained(path, safe_serialization=True)


def run_worlds(args, work: str) -> dict:
    """Make the hosts, run each world over the schedule, re-shaping on the workers' requests."""
    from tests.hosts import Hosts, wait_all

    sched = schedule(args.rates, args.iters)
    if any(k in args.cases for k in ("pp", "sp")):
        _save_model(os.path.join(work, "model"))
    got = {}
    with Hosts(2, rate=None) as hosts:
        addrs = ",".join(hosts.addr(i) for i in range(2))
        for n, kind in enumerate(args.cases):
            out = os.path.join(work, kind)
            os.makedirs(out, exist_ok=True)
            hosts.shape(None)
            port = 29650 + n
            env = {"OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR", "HF_HUB_OFFLINE": "1"}
            env["HOSTS_PLAN_ADDRS"] = addrs
            procs = []
            for i in range(2):
                cmd = ["python", "-m", "torch.distributed.run", "--nnodes", "2"]
                cmd += ["--nproc-per-node", "2", "--node-rank", str(i)]
                cmd += ["--master-addr", hosts.addr(0), "--master-port", str(port)]
                cmd += [os.path.abspath(__file__), "--worker", kind, out]
                cmd += _forward_args(args)
                log = open(os.path.join(out, f"host{i}.log"), "w")
                procs.append(hosts.run(i, cmd, env=env, stdout=log, stderr=log))
                log.close()
            end, i, result = time.monotonic() + args.timeout, 0, os.path.join(out, f"{kind}.json")
            done = None  # when rank 0 wrote the results: the world then has 30 s to exit
            while any(p.poll() is None for p in procs) and time.monotonic() < end:
                if i < len(sched) and os.path.exists(os.path.join(out, f"need_{i}")):
                    hosts.shape(sched[i])
                    open(os.path.join(out, f"have_{i}"), "w").close()
                    i += 1
                if done is None and os.path.exists(result):
                    done = time.monotonic()
                    end = min(end, done + 30)
                time.sleep(0.05)
            codes = wait_all(procs, 1.0)
            if not os.path.exists(result):
                logs = [open(os.path.join(out, f"host{j}.log")).read()[-3000:] for j in range(2)]
                raise RuntimeError(f"the {kind} world failed ({codes}):\n" + "\n".join(logs))
            if codes != [0, 0]:  # after its results (seen: a rank's abort in gloo's teardown)
                print(f"the {kind} world exited with {codes} after writing its results")
            with open(result) as f:
                got[kind] = json.load(f)
            got.setdefault("exit_codes", {})[kind] = codes
    return got


def _forward_args(args) -> list:
    out = ["--rates", *args.rates, "--seq", str(args.seq), "--prompt", str(args.prompt)]
    out += ["--decode", str(args.decode), "--migrate", str(args.migrate)]
    return out + ["--iters", str(args.iters), "--cases", ",".join(args.cases)]


# -- predictions --------------------------------------------------------------------------------
def _median(rows, key):
    """The median of ``key`` over ``rows`` (robust to one run that other load slowed)."""
    return statistics.median(r[key] for r in rows)


def _calibration(rows, i, each: int = 2):
    """The unshaped entries that calibrate entry ``i``: the ``each`` just before and the ``each``
    just after it (for an unshaped entry, the other unshaped ones around it)."""
    j = [k for k in range(len(rows)) if rows[k]["rate"] is None and k != i]
    before = [k for k in j if k < i][-each:]
    after = [k for k in j if k > i][:each]
    return [rows[k] for k in before + after]


def _rates(unshaped: list, rate):
    """The planner's one-thread rates with the links of ``rate``: "inter" (the hosts' link, one
    per host: ``Rates.shared``) at the tbf rate's payload, but no faster than the probed
    unshaped bandwidth (what the two busy cores move: a 10gbit tbf does not make them faster);
    "intra" (loopback inside a host) at the probed unshaped bandwidth too; both latencies as
    probed unshaped (medians over every unshaped entry)."""
    from ringkv import planner

    r = planner.rates(planner.load_hardware(), "cpu", "float32")
    probed = statistics.median(x["bandwidth_inter"] for x in unshaped)
    bw = min(PAYLOAD * planner.parse_rate(rate), probed) if rate else probed
    r.links = {"intra": probed, "inter": bw}
    r.latency = {
        k: statistics.median(x[f"latency_{k}_s"] for x in unshaped) for k in ("intra", "inter")
    }
    r.shared = {"inter": True}
    return r


def predict(args, got: dict) -> list:
    """One row per schedule entry and case: predicted (from the unshaped entries around it and
    the link's parameters), measured."""
    from ringkv import planner

    rows = []
    ring = got.get("ring")
    if ring is None:
        raise ValueError("the predictions need the ring world (link probes): --cases ring,...")
    unshaped = [r for r in ring if r["rate"] is None]
    s, h, hkv, d, world = args.seq, RING["heads"], RING["kv_heads"], RING["head_dim"], 4

    def add(case, i, rate, pred, meas, **extra):
        rows.append(
            dict(case=case, entry=i, rate=rate or "unshaped", predicted_s=pred, measured_s=meas)
        )
        rows[-1].update(extra, error=pred / meas - 1)

    flops_step = 4 * d * h * s * s * 0.5 / world / world
    for i, row in enumerate(ring):
        cal = _calibration(ring, i)
        r = _rates(unshaped, row["rate"])
        # a ring step's compute from the no-comm times (the merge at the table's memory rate)
        merge = -(-s // world) * h * (d + 1) * (8 + 4) / r.memory
        f_nc, fb_nc = _median(cal, "ring_fwd_nocomm_s"), _median(cal, "ring_fwdbwd_nocomm_s")
        r.attention = flops_step / max(1e-6, (f_nc - (world - 1) * merge) / world)
        step_b = (fb_nc - f_nc) / world
        fwd = planner.ring_attention_seconds(s, h, hkv, d, world, 4, r, "inter")[0]
        bwd = planner.ring_backward_seconds(s, h, hkv, d, world, 4, r, "inter", step_b)
        add("ring fwd", i, row["rate"], fwd, row["ring_fwd_s"], nocomm_s=row["ring_fwd_nocomm_s"])
        add(
            "ring fwd+bwd",
            i,
            row["rate"],
            fwd + bwd,
            row["ring_fwdbwd_s"],
            nocomm_s=row["ring_fwdbwd_nocomm_s"],
        )
        nb = row["migration_bytes"]
        # the ends' bytes/s (copies, checksum): the unshaped time less its wire time; on these
        # 2 loaded cores that work does not overlap the wire (migration_seconds(overlap=False))
        r0 = _rates(unshaped, None)
        host_s = _median(cal, "migration_s") - r0.latency["inter"] - nb / r0.links["inter"]
        host_rate = nb / max(1e-6, host_s)
        pred = planner.migration_seconds(
            nb, r.links["inter"], r.latency["inter"], host_rate, overlap=False
        )
        add("migration", i, row["rate"], pred, row["migration_s"], bytes=nb)
        add("link probe", i, row["rate"], r.links["inter"], row["bandwidth_inter"], unit="B/s")
        rows[-1]["error"] = row["bandwidth_inter"] / r.links["inter"] - 1  # measured vs given

    cfg = planner.load_model(MODEL_CONFIG())
    for kind in ("pp", "sp"):
        if kind not in got:
            continue
        mesh = dict(tp=2, pp=2 if kind == "pp" else 1, sp=2 if kind == "sp" else 1)
        links = {"tp": "intra", "pp": "inter", "sp": "inter"}

        def run(n_out, measured):
            return planner.EngineRun(
                cfg=cfg,
                prompts=[args.prompt],
                max_tokens=n_out,
                num_blocks=_blocks(args, len(schedule(args.rates, args.iters))),
                measured_s=measured,
                max_num_seqs=4,
                max_num_batched_tokens=args.prompt,
                links=links,
                sp_prefill_min_tokens=64,
                **mesh,
            )

        runs = got[kind]
        for i, row in enumerate(runs):
            cal = _calibration(runs, i)
            pre, dec = _median(cal, "prefill_s"), _median(cal, "decode_step_s")
            fit = [run(1, pre), run(1 + args.decode, pre + args.decode * dec)]
            base = planner.fit_engine(fit, _rates(unshaped, None), keys=("matmul", "layer"))
            r = _rates(unshaped, row["rate"])
            r.matmul, r.host = base.matmul, dict(base.host)
            p1 = run(1, 0).seconds(r)
            p2 = run(1 + args.decode, 0).seconds(r)
            add(f"tp2{kind}2 prefill", i, row["rate"], p1, row["prefill_s"])
            step = (p2 - p1) / args.decode
            add(f"tp2{kind}2 decode step", i, row["rate"], step, row["decode_step_s"])
    return rows


def summary(rows) -> list:
    """Per (case, rate): the medians of predicted and measured over its entries, and the
    error."""
    out = {}
    for r in rows:
        out.setdefault((r["case"], r["rate"]), []).append(r)
    res = []
    for (case, rate), rs in out.items():
        pred, meas = _median(rs, "predicted_s"), _median(rs, "measured_s")
        res.append(dict(case=case, rate=rate, predicted_s=pred, measured_s=meas, n=len(rs)))
        res[-1]["error"] = (meas / pred - 1) if rs[0].get("unit") else pred / meas - 1
        if "nocomm_s" in rs[0]:
            res[-1]["overlap_measured"] = meas / _median(rs, "nocomm_s")
            res[-1]["overlap_predicted"] = pred / _median(rs, "nocomm_s")
        if rs[0].get("unit"):
            res[-1]["unit"] = rs[0]["unit"]
    order = {"unshaped": 0}
    return sorted(res, key=lambda r: (r["case"], order.get(r["rate"], 1), _bits(r["rate"])))


def _bits(rate: str) -> float:
    from ringkv import planner

    return 0.0 if rate == "unshaped" else planner.parse_rate(rate)


def MODEL_CONFIG() -> dict:
    """The engine model's config as an HF config dict (for ``ModelConfig.from_hf``)."""
    return dict(
        MODEL,
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        head_dim=MODEL["hidden_size"] // MODEL["num_attention_heads"],
    )


def table(rows) -> str:
    """The summary as a table: case, rate, predicted, measured, error (the link probe: measured
    over given), the overlap (time / no-comm time, predicted / measured) of the ring."""
    head = f"{'case':24} {'rate':>9} {'predicted':>12} {'measured':>12} {'error':>7}  n"
    lines = [head + "  overlap pred/meas"]
    for r in rows:
        unit = r.get("unit", "s")
        fmt = (lambda x: f"{x / 1e6:7.1f} MB/s") if unit == "B/s" else (lambda x: f"{x:10.4f}s")
        ov = (
            f"  {r['overlap_predicted']:.2f} / {r['overlap_measured']:.2f}"
            if "overlap_measured" in r
            else ""
        )
        lines.append(
            f"{r['case']:24} {r['rate']:>9} {fmt(r['predicted_s']):>12} "
            f"{fmt(r['measured_s']):>12} {100 * r['error']:+6.1f}%  {r['n']}{ov}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        kind, out = args.worker
        sched = schedule(args.rates, args.iters)
        if kind == "ring":
            _ring_world(args, out, sched)
        else:
            _engine_world(args, kind, out, sched)
        return 0
    import tempfile

    from benchmarks.models import load_average, machine, machine_line, write_json

    load0, t0 = load_average(), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hosts_plan") as work:
        got = run_worlds(args, work)
    entries = predict(args, got)
    rows = summary(entries)
    took = time.monotonic() - t0
    print(machine_line())
    print(f"load average {load0} -> {load_average()}, {took:.0f} s")
    print(table(rows))
    if args.json:
        write_json(
            args.json,
            dict(
                args={k: v for k, v in vars(args).items() if k not in ("json", "worker")},
                rows=rows,
                entries=entries,
                measured=got,
                loadavg=[load0, load_average()],
                seconds=took,
                machine=machine(threads=1),
                layout="zigzag",
                payload=PAYLOAD,
            ),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
