"""Multi-instance serving: a router (``ringkv serve --replicas N``) in front of N engine
instances on this host, driven through its OpenAI API by streamed requests arriving as a
Poisson process.

    python benchmarks/cluster.py --scenario all --json results/cluster.json \\
        --plot results/cluster.png

Each setup starts its own front (``python -m ringkv serve --replicas N --admin ...``, one
thread per process), waits until all N instances are ``up`` (``GET /admin/instances``), sends
a few warm-up requests, then the measured load, and stops the front and its instances at
the end (also on errors and Ctrl-C). Per request: TTFT (send -> first content token), ITL (the
gaps between its streamed chunks), end-to-end latency, the ``usage`` of the final chunk
(``prompt_tokens_details.cached_tokens``: prompt tokens served from a prefix cache) and the
instance that served it (``x-ringkv-instance``). Router counters come from ``/metrics``
(differences over the measured load).

- ``--scenario prefix``: ``--prefixes`` K shared prefixes (system prompts of
  ``--prefix-tokens``) x ``--per-prefix`` M requests each, a short unique suffix, a few output
  tokens, in random order. An instance's KV cache (its device pool) holds ``--cache-prefixes``
  prefixes (default K/N; ``--cache-fraction F``: F x K, e.g. 0.25: a quarter of the working set)
  plus the own blocks of ``--cache-running`` running requests (default ``--max-num-seqs``).
  Setups (``--setups``, default: unbounded, kv, kv-old, round-robin, round-robin-old):

  - ``unbounded``: one instance whose cache holds every prefix (the reference hit rate);
  - ``one instance``: one instance with N x an instance's memory (the same total);
  - ``kv``: N instances routed ``kv`` with today's defaults: the host tier of the prefix cache
    (as large as the device pool) and peer pull (the front's hint; the instance pulls or
    recomputes by its cost model);
  - ``kv-old``: ``kv`` with ``--kv-host-memory 0 --no-kv-pull``: KV routing without the tiers
    and pull (issue #44's baseline);
  - ``round-robin``: N instances routed ``round-robin``, today's defaults (the front's pull
    hints included: an instance sent a prompt another holds may pull it);
  - ``round-robin-old``: ``round-robin`` with ``--kv-host-memory 0 --no-kv-pull``.

  Prefix hit rate = sum(cached_tokens) / sum(prompt_tokens) (cached: from the device, promoted
  from a tier or pulled from a peer); also given: the requests that did not reuse their prefix's
  full blocks (misses), on how many instances each prefix was computed, and from the instances'
  ``/metrics`` (differences over the load): pull decisions (pull / recompute / failed), pulled
  tokens and bytes, the router's pull hints, and after the load the blocks each tier holds and
  the measured link and prefill rates the pull cost model uses. Goals: kv >= 0.95x unbounded,
  kv >= 2x round-robin (and x round-robin-old), kv's throughput (req/s) >= 1.3x kv-old's (a
  rate the instances cannot keep up with measures throughput; a lower one measures the arrival
  rate), and kv >= 0.9x one instance where that setup runs.
- ``--scenario skew``: ``--bursts`` bursts of ``--burst-size`` requests that all share one prefix,
  longer outputs, few sequences per instance (``--skew-max-num-seqs``), with migration on and
  with ``--no-migration``. Before the bursts one request caches the prefix on one instance (the
  hot one) and the router's index is waited for (``ringkv_router_cached_blocks``), so that KV
  routing pins the bursts there. Migrations are the router's
  ``ringkv_router_migrations_out_total``. Goal: p99 TTFT with migration <= 0.5x without.
- ``--scenario failover``: a stream of requests over N instances; ``--kill-after`` seconds in, the
  instance serving the most of them is SIGKILLed (its pid from ``/admin/instances``). Every
  request must still finish with a finish_reason and no error (lost = 0). Requests that were
  moved (served by the killed instance and not done at the kill) are compared with the
  median end-to-end latency of the others; the router's ``ringkv_router_failovers_total`` is
  given next to them.

``--scenario all`` runs the three. The machine's load averages (``os.getloadavg``) are printed
with each setup: other processes on the cores change every timing.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]
ROOT = os.path.dirname(HERE)

from benchmarks.models import describe, machine, machine_line, model_path, write_json  # noqa: E402
from ringkv.serve.router import free_port  # noqa: E402

NAME = "bench"  # --served-model-name
DEFAULT_SETUPS = ["unbounded", "kv", "kv-old", "round-robin", "round-robin-old"]  # prefix
WORDS = (
    "river valley farming village trader coast salt cloth writing number town wall border kingdom "
    "scholar record clay market harbour ship merchant festival season harvest bridge road temple "
    "garden library school teacher student lesson question answer reason history science music "
    "painting poem story mountain forest desert island weather winter summer autumn spring morning "
    "evening night light shadow stone iron copper silver gold bread cheese apple orange water fire "
    "earth wind cloud rain snow storm careful polite helpful precise friendly brief detailed "
    "formal honest patient curious calm clear simple always never often explain describe compare "
    "summarise translate check answer list count measure"
).split()


def percentile(xs, q):
    """Nearest-rank percentile (as benchmarks/serve.py); nan for no values."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def load() -> list:
    return [round(x, 2) for x in os.getloadavg()]


# -- prompts ---------------------------------------------------------------------------------
class Prompts:
    """Prompts of a given length in tokens: text cut with the model's tokenizer, or (a random
    model without one) token ids."""

    def __init__(self, path: str):
        try:
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(path)
        except Exception:  # noqa: BLE001 - a random model: token ids
            self.tok = None

    def words(self, rng: random.Random, n_tokens: int, head: str):
        if self.tok is None:
            return [rng.randrange(3, 1000) for _ in range(n_tokens)]
        text = head + " " + " ".join(rng.choice(WORDS) for _ in range(2 * n_tokens))
        return self.tok.decode(self.tok.encode(text, add_special_tokens=False)[:n_tokens])

    def join(self, prefix, suffix):
        return prefix + suffix if self.tok is None else prefix + "\n\n" + suffix


def body_of(prompt, max_tokens: int, chat: bool) -> dict:
    body = {
        "model": NAME,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        system, user = prompt
        body["messages"] = [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ]
    else:
        body["prompt"] = prompt
    return body


# -- the front process -----------------------------------------------------------------------
def parse_metrics(text: str) -> dict:
    """Prometheus text -> {(name, ((label, value), ...)): value}."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?\s*$", line)
        if m is None or line.startswith("#"):
            continue
        labels = tuple(sorted(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or "")))
        try:
            out[(m.group(1), labels)] = float(m.group(3))
        except ValueError:
            pass
    return out


def per_instance(metrics: dict, name: str) -> dict:
    out = collections.Counter()
    for (n, ls), v in metrics.items():
        if n == name and "instance" in dict(ls):
            out[dict(ls)["instance"]] += v
    return dict(out)


def delta(m1: dict, m0: dict, name: str) -> dict:
    a, b = per_instance(m1, name), per_instance(m0, name)
    return {
        k: a.get(k, 0) - b.get(k, 0) for k in sorted(set(a) | set(b)) if a.get(k, 0) - b.get(k, 0)
    }


def instance_metrics(front) -> dict:
    """Each instance's own ``/metrics`` (parsed), by instance id; an instance that does not
    answer: absent."""
    out = {}
    for inst in front.instances():
        try:
            out[inst["id"]] = parse_metrics(front.http.get(inst["url"] + "/metrics").text)
        except Exception:  # noqa: BLE001 - a down instance: its numbers are missing
            pass
    return out


def pull_summary(after: dict, before: dict) -> dict:
    """The instances' pull and tier numbers over a load: decisions per outcome, pulled tokens and
    bytes and prefixes shared (differences, summed over instances), and per instance after the
    load the blocks each tier holds (``tier_blocks``; the device's: blocks in use, cached free
    ones not counted) and the measured link (bytes/s) and prefill (tokens/s) rates."""

    def total(m: dict, name: str, **labels) -> float:
        want = set(labels.items())
        return sum(v for (n, ls), v in m.items() if n == name and want <= set(ls))

    def diff(name: str, **labels) -> float:
        return sum(
            total(after[i], name, **labels) - total(before.get(i, {}), name, **labels)
            for i in after
        )

    tiers = {
        i: {dict(ls)["tier"]: v for (n, ls), v in m.items() if n == "ringkv_kv_tier_blocks"}
        for i, m in after.items()
    }
    return dict(
        pull_decisions={
            o: diff("ringkv_kv_pull_decisions_total", outcome=o)
            for o in ("pull", "recompute", "failed")
        },
        pulled_tokens=diff("ringkv_kv_pulled_tokens_total"),
        pulled_bytes=diff("ringkv_kv_pulled_bytes_total"),
        shared=diff("ringkv_kv_shared_total"),
        tier_blocks=tiers,
        link_bytes_s={i: total(m, "ringkv_kv_link_bytes_per_second") for i, m in after.items()},
        prefill_tokens_s={
            i: total(m, "ringkv_kv_prefill_tokens_per_second") for i, m in after.items()
        },
    )


def index_tiers(metrics: dict) -> dict:
    """The router's index (``ringkv_router_tier_blocks``): ``{instance: {tier: cached blocks}}``."""
    out = collections.defaultdict(dict)
    for (n, ls), v in metrics.items():
        if n == "ringkv_router_tier_blocks":
            out[dict(ls)["instance"]][dict(ls)["tier"]] = v
    return dict(out)


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie does not) and is a ringkv process (not a reused pid)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X") and b"ringkv" in cmd


def _describe(pid: int) -> str:
    """A process's state and command line, for a report."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        with open(f"/proc/{pid}/status") as f:
            sig = {
                k: v.strip()
                for k, v in (line.split(":", 1) for line in f)
                if k in ("SigCgt", "SigBlk", "PPid")
            }
    except OSError as e:
        return f"gone: {e}"
    return f"state {state}, {sig}, {cmd[-90:]}"


class Front:
    """``python -m ringkv serve --replicas N --admin ...`` as a subprocess (its own session, so
    its instances can be found and stopped), its output in a log file."""

    def __init__(self, path: str, replicas: int, extra: list, label: str):
        import httpx

        self.port, self.replicas, self.label = free_port(), replicas, label
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(trust_env=False, timeout=10)
        self.log = tempfile.NamedTemporaryFile(
            "w+",
            prefix="ringkv-cluster-" + re.sub(r"\W+", "-", label) + "-",
            suffix=".log",
            delete=False,
        )
        self.cmd = [
            sys.executable,
            "-m",
            "ringkv",
            "serve",
            "--model",
            path,
            "--port",
            str(self.port),
            "--served-model-name",
            NAME,
            "--replicas",
            str(replicas),
            "--admin",
            *extra,
        ]
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            MKL_NUM_THREADS="1",
            PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        )
        self.pids: set = set()  # every instance pid seen
        self.problems: list = []  # what the router did wrong on the way down
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )

    def tail(self, n: int = 3000) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return f.read()[-n:]

    def instances(self) -> list:
        r = self.http.get(self.url + "/admin/instances")
        r.raise_for_status()
        out = r.json()["instances"]
        self.pids |= {i["pid"] for i in out if i.get("pid")}
        return out

    def metrics(self) -> dict:
        return parse_metrics(self.http.get(self.url + "/metrics").text)

    def wait_up(self, timeout: float) -> list:
        """Until ``/health`` answers 200 and all ``replicas`` instances are up."""
        import httpx

        deadline, last = time.time() + timeout, None
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.label}: the front exited ({self.proc.returncode}):\n{self.tail()}"
                )
            try:
                if self.http.get(self.url + "/health", timeout=2).status_code == 200:
                    last = self.instances()
                    if len(last) == self.replicas and all(i["state"] == "up" for i in last):
                        return last
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        raise RuntimeError(
            f"{self.label}: not all {self.replicas} instances up after {timeout:.0f} s "
            f"(last /admin/instances: {last}):\n{self.tail()}"
        )

    def close(self) -> None:
        """Stop the front (SIGTERM, then SIGKILL); every instance pid it had must be gone (ones
        left running are reported in ``problems`` and killed)."""
        try:
            if self.proc.poll() is None:
                self.instances()
        except Exception:  # noqa: BLE001 - the pids seen so far
            pass
        t = time.time()
        grace = 30 * (self.replicas + 1)  # the front may wait 30 s for each instance
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.problems.append(
                    f"the front (pid {self.proc.pid}) did not exit within {grace} s of SIGTERM "
                    f"(killed)"
                )
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.stop_s = time.time() - t
        deadline = time.time() + 15
        while time.time() < deadline and any(alive(p) for p in self.pids):
            time.sleep(0.2)
        for p in sorted(self.pids):
            if alive(p):
                self.problems.append(
                    f"instance pid {p} ({_describe(p)}) still ran 15 s after the front exited "
                    f"({self.stop_s:.1f} s after its SIGTERM, exit code {self.proc.returncode}); "
                    "killed"
                )
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            os.killpg(
                self.proc.pid, signal.SIGKILL
            )  # anything else the front started in its session
        except (ProcessLookupError, PermissionError):
            pass
        self.http.close()
        self.log.close()
        if not self.problems:
            os.unlink(self.log.name)


# -- the client ------------------------------------------------------------------------------
async def one(client, url: str, req: dict, t0: float, chat: bool, bar, live: dict) -> dict:
    """One streamed request; its record (in ``live`` from the start, ``done`` at the end)."""
    rec = live[req["i"]] = dict(
        i=req["i"],
        group=req.get("group"),
        sent=time.perf_counter() - t0,
        ttft=None,
        e2e=None,
        itl=[],
        chunks=0,
        prompt_tokens=None,
        completion_tokens=None,
        cached_tokens=None,
        instance=None,
        id=None,
        finish_reason=None,
        error=None,
        status=None,
        done=False,
        saw_done=False,
    )
    start = time.perf_counter()
    times, tail = [], collections.deque(maxlen=3)  # the last events: kept for a request that fails
    try:
        async with client.stream(
            "POST",
            url + ("/v1/chat/completions" if chat else "/v1/completions"),
            json=body_of(req["prompt"], req["max_tokens"], chat),
        ) as r:
            rec["status"], rec["instance"] = r.status_code, r.headers.get("x-ringkv-instance")
            if r.status_code != 200:
                rec["error"] = (await r.aread()).decode(errors="replace")[:500]
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    tail.append(line[6:300])
                    if line == "data: [DONE]":
                        rec["saw_done"] = True
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        rec["error"] = json.dumps(chunk["error"])[:500]
                        continue
                    rec["id"] = rec["id"] or chunk.get("id")
                    if chunk.get("usage"):
                        u = chunk["usage"]
                        rec["prompt_tokens"], rec["completion_tokens"] = (
                            u.get("prompt_tokens"),
                            u.get("completion_tokens"),
                        )
                        rec["cached_tokens"] = (u.get("prompt_tokens_details") or {}).get(
                            "cached_tokens"
                        )
                    choices = chunk.get("choices") or []
                    for c in choices:
                        if c.get("finish_reason"):
                            rec["finish_reason"] = c["finish_reason"]
                    # a content chunk: not the usage chunk, not chat's opening {"role": "assistant",
                    # "content": ""}
                    if choices and not (
                        chat
                        and all(
                            "role" in (c.get("delta") or {})
                            and not (c.get("delta") or {}).get("content")
                            for c in choices
                        )
                    ):
                        times.append(time.perf_counter())
                        rec["chunks"] += 1
    except Exception as e:  # noqa: BLE001 - a lost request, counted
        rec["error"] = f"{type(e).__name__}: {e}"[:500]
    end = time.perf_counter()
    rec.update(
        e2e=end - start,
        end=end - t0,
        ttft=times[0] - start if times else None,
        itl=[b - a for a, b in zip(times, times[1:])],
    )
    rec["done"] = True
    rec["ok"] = rec["status"] == 200 and rec["finish_reason"] is not None and rec["error"] is None
    if not rec["ok"]:
        rec["tail"] = list(tail)
        if rec["error"] is None:
            rec["error"] = (
                f"no finish_reason: {rec['chunks']} content chunks, usage.completion_tokens "
                f"{rec['completion_tokens']}, [DONE] {'seen' if rec['saw_done'] else 'missing'}"
            )
    if rec["completion_tokens"] is None:
        rec["completion_tokens"] = rec["chunks"]
    bar.update(1)
    return rec


async def drive(url: str, reqs: list, chat: bool, bar, kill=None):
    """Send ``reqs`` at their ``at`` (seconds from the start); ``kill(live, t0)`` (a coroutine;
    ``live``: the records so far, by request) runs alongside. Returns (records, wall seconds,
    kill's result)."""
    import httpx

    async with httpx.AsyncClient(
        trust_env=False,
        timeout=httpx.Timeout(600, connect=30),
        limits=httpx.Limits(max_connections=1000, max_keepalive_connections=1000),
    ) as client:
        t0 = time.perf_counter()
        tasks, live = [], {}
        killer = asyncio.create_task(kill(live, t0)) if kill is not None else None
        for req in sorted(reqs, key=lambda q: q["at"]):
            await asyncio.sleep(max(0.0, t0 + req["at"] - time.perf_counter()))
            tasks.append(asyncio.create_task(one(client, url, req, t0, chat, bar, live)))
        records = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        killed = await killer if killer is not None else None
    return sorted(records, key=lambda r: r["i"]), wall, killed


def warm_up(front: Front, prompts: Prompts, chat: bool, rng: random.Random) -> None:
    """A few short requests of unique prompts (every instance computes its first steps before
    the measured load)."""
    from tqdm import tqdm

    reqs = [
        dict(
            i=i,
            at=0.05 * i,
            max_tokens=2,
            prompt=pair(
                prompts,
                prompts.words(rng, 24, f"Warm-up {i} {rng.random()}"),
                prompts.words(rng, 4, "Say hello"),
                chat,
            ),
        )
        for i in range(2 * front.replicas + 1)
    ]
    with tqdm(total=len(reqs), disable=True) as bar:
        asyncio.run(drive(front.url, reqs, chat, bar))


def prime(front: Front, req: dict, chat: bool, min_blocks: int, timeout: float = 10.0) -> dict:
    """Send ``req`` (its prompt gets cached on the instance the router picks), then wait until
    the router's index holds ``min_blocks`` more blocks for that instance
    (``ringkv_router_cached_blocks``): requests sharing the prefix are then routed there."""
    from tqdm import tqdm

    before = per_instance(front.metrics(), "ringkv_router_cached_blocks")
    with tqdm(total=1, disable=True) as bar:
        (rec,), _, _ = asyncio.run(drive(front.url, [dict(req, i=0, at=0.0)], chat, bar))
    inst, t = rec["instance"], time.perf_counter()
    while time.perf_counter() - t < timeout:
        if (
            per_instance(front.metrics(), "ringkv_router_cached_blocks").get(inst, 0)
            - before.get(inst, 0)
            >= min_blocks
        ):
            return dict(instance=inst, ok=rec["ok"], index_s=time.perf_counter() - t)
        time.sleep(0.1)
    return dict(instance=inst, ok=rec["ok"], index_s=None)  # the index never showed it


def pair(prompts: Prompts, prefix, suffix, chat: bool):
    return (prefix, suffix) if chat else prompts.join(prefix, suffix)


def poisson(rng: random.Random, n: int, rate: float, start: float = 0.0) -> list:
    t, out = start, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate) if rate != float("inf") else 0.0
    return out


# -- one setup -------------------------------------------------------------------------------
def run_setup(
    args, path, prompts, label, replicas, extra, reqs, bar, kill=None, primer=None
) -> dict:
    """Start a front, warm it (and ``prime`` it with ``primer``: (request, blocks)), send
    ``reqs``, stop it; the setup's row and its records."""
    from tqdm import tqdm

    bar.set_description(f"{label}: starting {replicas} instance(s)")
    t = time.perf_counter()
    front = Front(path, replicas, extra, label)
    try:
        insts = front.wait_up(args.start_timeout)
        started = time.perf_counter() - t
        warm_up(front, prompts, args.chat, random.Random(args.seed + 99))
        primed = prime(front, primer[0], args.chat, primer[1]) if primer else None
        bar.set_description(label)
        m0, im0, load0 = front.metrics(), instance_metrics(front), load()
        records, wall, killed = asyncio.run(
            drive(
                front.url,
                reqs,
                args.chat,
                bar,
                kill=(lambda live, t0: kill(front, live, t0)) if kill else None,
            )
        )
        load1 = load()
        try:
            m1, after, im1 = front.metrics(), front.instances(), instance_metrics(front)
        except Exception as e:  # noqa: BLE001 - the front is gone: the client-side numbers still hold
            time.sleep(1)
            m1, after, im1 = m0, f"{type(e).__name__}: {e}", im0
            front.problems.append(
                f"the front did not answer after the load ({after}); it "
                f"{'runs' if front.proc.poll() is None else f'exited with {front.proc.returncode}'}"
            )
    except BaseException:
        tqdm.write(
            f"{label}: the front (pid {front.proc.pid}) "
            f"{'runs' if front.proc.poll() is None else f'exited with {front.proc.returncode}'}; "
            f"its log ({front.log.name}):\n{front.tail()}"
        )
        front.problems.append("the setup failed")  # keep the log
        raise
    finally:
        front.close()
        for p in front.problems:
            tqdm.write(f"{label}: router problem: {p}; its log: {front.log.name}")
    ok = [r for r in records if r["ok"]]
    prompt_tokens = sum(r["prompt_tokens"] or 0 for r in records)
    have_cached = any(r["cached_tokens"] is not None for r in records)
    itl = [x for r in ok for x in r["itl"]]
    out_tokens = sum(r["completion_tokens"] or 0 for r in ok)
    row = dict(
        setup=label,
        replicas=replicas,
        server_args=" ".join(extra),
        instances=insts,
        start_s=started,
        instances_after=after,
        sent=len(records),
        completed=len(ok),
        lost=len(records) - len(ok),
        errors=[
            f"request {r['i']} (on {r['instance']}): {r['error']}" for r in records if r["error"]
        ][:5],
        wall_s=wall,
        req_s=len(ok) / wall,
        tok_s=out_tokens / wall,
        output_tokens=out_tokens,
        prompt_tokens=prompt_tokens,
        cached_tokens=sum(r["cached_tokens"] or 0 for r in records) if have_cached else None,
        hit_rate=(
            sum(r["cached_tokens"] or 0 for r in records) / prompt_tokens
            if have_cached and prompt_tokens
            else None
        ),
        ttft_p50=percentile([r["ttft"] for r in ok], 50),
        ttft_p99=percentile([r["ttft"] for r in ok], 99),
        itl_p50=percentile(itl, 50),
        itl_p99=percentile(itl, 99),
        itl_max=max(itl, default=float("nan")),
        e2e_p50=percentile([r["e2e"] for r in ok], 50),
        e2e_p99=percentile([r["e2e"] for r in ok], 99),
        per_instance=dict(
            sorted(collections.Counter(r["instance"] or "?" for r in records).items())
        ),
        migrations_out=delta(m1, m0, "ringkv_router_migrations_out_total"),
        migrations_in=delta(m1, m0, "ringkv_router_migrations_in_total"),
        failovers=delta(m1, m0, "ringkv_router_failovers_total"),
        pull_hints=delta(m1, m0, "ringkv_router_pull_hints_total"),
        index_tier_blocks=index_tiers(m1),
        **pull_summary(im1, im0),
        load_before=load0,
        load_after=load1,
        router_problems=front.problems,
        killed=killed,
        primed=primed,
    )
    row["migrations"] = sum(row["migrations_out"].values())
    return dict(row=row, records=records)


def engine_args(args, max_num_seqs: int, blocks: int, max_model_len: int) -> list:
    extra = ["--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len)]
    if args.kv_cache_memory is not None:
        gib = args.kv_cache_memory
    else:
        gib = blocks * args.block_size * args.bytes_per_token / 2**30 * 1.001
    return (
        extra
        + ["--block-size", str(args.block_size), "--kv-cache-memory", f"{gib:.6f}"]
        + args.server_args.split()
    )


def blocks(args, tokens: int) -> int:
    return -(-tokens // args.block_size)


# -- scenarios -------------------------------------------------------------------------------
def scenario_prefix(args, path, prompts, bar) -> dict:
    rng = random.Random(args.seed)
    K, M, N = args.prefixes, args.per_prefix, args.replicas
    prefixes = [
        prompts.words(
            rng, args.prefix_tokens, f"System prompt {k}: you are assistant number {k}, be"
        )
        for k in range(K)
    ]
    order = [k for k in range(K) for _ in range(M)]
    rng.shuffle(order)
    times = poisson(rng, len(order), args.prefix_rate)
    reqs = [
        dict(
            i=i,
            group=k,
            at=at,
            max_tokens=args.prefix_max_tokens,
            prompt=pair(
                prompts,
                prefixes[k],
                prompts.words(rng, args.suffix_tokens, f"Question {i}:"),
                args.chat,
            ),
        )
        for i, (k, at) in enumerate(zip(order, times))
    ]
    fit = args.cache_prefixes if args.cache_prefixes is not None else K / N
    if args.cache_fraction is not None:
        fit = args.cache_fraction * K
    # a running request's own blocks: the prefix's last partial block, its suffix and output
    own = (
        blocks(args, args.prefix_tokens + args.suffix_tokens + args.prefix_max_tokens + 8)
        - args.prefix_tokens // args.block_size
    )
    running = args.cache_running if args.cache_running is not None else args.max_num_seqs
    per = int(fit * blocks(args, args.prefix_tokens)) + running * own + 2
    mml = args.prefix_tokens + args.suffix_tokens + args.prefix_max_tokens + 64
    # every prefix besides the running requests' own blocks: no prefix is ever evicted
    every = K * blocks(args, args.prefix_tokens) + running * own + 2
    one = engine_args(args, args.max_num_seqs, per, mml)
    old = ["--kv-host-memory", "0", "--no-kv-pull"]
    setups = {
        "unbounded": (1, engine_args(args, args.max_num_seqs, max(every, N * per), mml)),
        "one instance": (1, engine_args(args, args.max_num_seqs, N * per, mml)),
        "kv": (N, one + ["--routing", "kv"]),
        "kv-old": (N, one + ["--routing", "kv"] + old),
        "round-robin": (N, one + ["--routing", "round-robin"]),
        "round-robin-old": (N, one + ["--routing", "round-robin"] + old),
    }
    if args.kv_cache_memory is not None:  # the same total memory for one instance
        for name, n in (("one instance", N), ("unbounded", max(N, K))):
            extra = setups[name][1]
            extra[extra.index("--kv-cache-memory") + 1] = f"{n * args.kv_cache_memory:.6f}"
    rows, records = [], {}
    for name in args.setups or DEFAULT_SETUPS:
        if name not in setups:
            raise SystemExit(f"--setups: {name!r} is not one of {list(setups)}")
        replicas, extra = setups[name]
        res = run_setup(args, path, prompts, f"prefix/{name}", replicas, extra, reqs, bar)
        recs = res["records"]
        full = (
            args.prefix_tokens // args.block_size * args.block_size
        )  # a prefix hit: its full blocks
        where = collections.defaultdict(set)
        for r in recs:
            where[r["group"]].add(r["instance"])
        rows.append(
            dict(
                res["row"],
                name=name,
                blocks_per_instance=(
                    per if replicas > 1 else max(every, N * per) if name == "unbounded" else N * per
                ),
                prefix_misses=sum((r["cached_tokens"] or 0) < full for r in recs),
                instances_per_prefix=statistics.fmean(len(v) for v in where.values()),
            )
        )
        records[name] = res["records"]
    by = {r["name"]: r for r in rows}
    goals = {}
    kv = by.get("kv", {}).get("hit_rate")
    if kv is not None and by.get("unbounded", {}).get("hit_rate") is not None:
        ref = by["unbounded"]["hit_rate"]
        goals["kv >= 0.95x unbounded"] = dict(
            value=kv / ref if ref else float("inf"), met=kv >= 0.95 * ref
        )
    if kv is not None and by.get("one instance", {}).get("hit_rate") is not None:
        one_rate = by["one instance"]["hit_rate"]
        goals["kv >= 0.9x one instance"] = dict(
            value=kv / one_rate if one_rate else float("inf"), met=kv >= 0.9 * one_rate
        )
    for rr_name in ("round-robin", "round-robin-old"):
        rr = by.get(rr_name, {}).get("hit_rate")
        if kv is not None and rr is not None:
            goals[f"kv >= 2x {rr_name}"] = dict(
                value=kv / rr if rr else float("inf"), met=kv >= 2 * rr
            )
    if "kv" in by and "kv-old" in by:
        old = by["kv-old"]["req_s"]
        goals["kv throughput >= 1.3x kv-old"] = dict(
            value=by["kv"]["req_s"] / old if old else float("inf"),
            met=by["kv"]["req_s"] >= 1.3 * old,
        )
    return dict(
        rows=rows,
        goals=goals,
        records=records,
        sizes=dict(
            prefixes=K,
            per_prefix=M,
            prefix_tokens=args.prefix_tokens,
            suffix_tokens=args.suffix_tokens,
            max_tokens=args.prefix_max_tokens,
            rate=args.prefix_rate,
            cache_prefixes=fit,
            cache_fraction=args.cache_fraction,
            cache_running=running,
            blocks_per_instance=per,
            kv_cache_memory=args.kv_cache_memory,
        ),
    )


def scenario_skew(args, path, prompts, bar) -> dict:
    rng = random.Random(args.seed + 1)
    prefix = prompts.words(
        rng, args.prefix_tokens, "System prompt for the skewed burst: you are a guide, be"
    )
    reqs = []
    for b in range(args.bursts):
        for at in poisson(rng, args.burst_size, args.burst_rate, start=b * args.burst_gap):
            i = len(reqs)
            reqs.append(
                dict(
                    i=i,
                    group=b,
                    at=at,
                    max_tokens=args.skew_max_tokens,
                    prompt=pair(
                        prompts,
                        prefix,
                        prompts.words(rng, args.suffix_tokens, f"Question {i}:"),
                        args.chat,
                    ),
                )
            )
    mml = args.prefix_tokens + args.suffix_tokens + args.skew_max_tokens + 64
    per = 4 * blocks(args, args.prefix_tokens) + 2 * args.burst_size * blocks(args, mml)
    base = engine_args(args, args.skew_max_num_seqs, per, mml) + ["--routing", args.routing]
    mig = base + (
        ["--migration-threshold", str(args.migration_threshold)]
        if args.migration_threshold is not None
        else []
    )
    setups = {"migration": mig, "no migration": base + ["--no-migration"]}
    # the prefix is cached on one instance before the bursts (and the router's index knows it)
    primer = (
        dict(
            max_tokens=1,
            prompt=pair(
                prompts, prefix, prompts.words(rng, args.suffix_tokens, "Warm-up:"), args.chat
            ),
        ),
        args.prefix_tokens // args.block_size - 1,
    )
    rows, records = [], {}
    for name, extra in setups.items():
        res = run_setup(
            args, path, prompts, f"skew/{name}", args.replicas, extra, reqs, bar, primer=primer
        )
        rows.append(dict(res["row"], name=name))
        records[name] = res["records"]
    by = {r["name"]: r for r in rows}
    a, b = by["migration"]["ttft_p99"], by["no migration"]["ttft_p99"]
    goals = {
        "p99 TTFT with migration <= 0.5x without": dict(
            value=a / b if b else float("inf"), met=a <= 0.5 * b
        )
    }
    return dict(
        rows=rows,
        goals=goals,
        records=records,
        sizes=dict(
            bursts=args.bursts,
            burst_size=args.burst_size,
            burst_rate=args.burst_rate,
            burst_gap=args.burst_gap,
            max_tokens=args.skew_max_tokens,
            max_num_seqs=args.skew_max_num_seqs,
            prefix_tokens=args.prefix_tokens,
        ),
    )


def scenario_failover(args, path, prompts, bar) -> dict:
    rng = random.Random(args.seed + 2)
    groups = 4  # a few prefixes, so that KV routing spreads the requests over the instances
    prefixes = [
        prompts.words(rng, args.prefix_tokens // 2, f"Failover prompt {k}: you are a writer, be")
        for k in range(groups)
    ]
    times = poisson(rng, args.failover_requests, args.failover_rate)
    reqs = [
        dict(
            i=i,
            group=i % groups,
            at=at,
            max_tokens=args.failover_max_tokens,
            prompt=pair(
                prompts,
                prefixes[i % groups],
                prompts.words(rng, args.suffix_tokens, f"Question {i}:"),
                args.chat,
            ),
        )
        for i, at in enumerate(times)
    ]
    mml = args.prefix_tokens // 2 + args.suffix_tokens + args.failover_max_tokens + 64
    per = groups * blocks(args, args.prefix_tokens) + 2 * args.max_num_seqs * blocks(args, mml)
    extra = engine_args(args, args.max_num_seqs, per, mml) + ["--routing", args.routing]

    async def kill(front: Front, live: dict, t0: float):
        """At ``--kill-after``: SIGKILL the instance with the most of our requests in flight (by
        their ``x-ringkv-instance``)."""
        import httpx

        await asyncio.sleep(max(0.0, t0 + args.kill_after - time.perf_counter()))
        async with httpx.AsyncClient(trust_env=False, timeout=10) as c:
            insts = (await c.get(front.url + "/admin/instances")).json()["instances"]
        front.pids |= {i["pid"] for i in insts if i.get("pid")}
        busy = collections.Counter(
            r["instance"] for r in live.values() if not r["done"] and r["instance"]
        )
        up = [i for i in insts if i["state"] == "up" and i.get("pid")]
        if not up:
            return dict(error=f"no local instance up to kill: {insts}")
        victim = max(up, key=lambda i: busy.get(i["id"], 0))
        t = time.perf_counter() - t0
        os.kill(victim["pid"], signal.SIGKILL)
        return dict(
            instance=victim["id"],
            pid=victim["pid"],
            at=t,
            in_flight=dict(busy),
            loads={i["id"]: i.get("load") for i in insts},
        )

    res = run_setup(args, path, prompts, "failover", args.replicas, extra, reqs, bar, kill=kill)
    row, recs = dict(res["row"], name="failover"), res["records"]
    killed = row["killed"] or {}
    victim, at = killed.get("instance"), killed.get("at", float("inf"))
    for r in recs:
        r["moved"] = victim is not None and r["instance"] == victim and r["end"] > at
    moved = [r for r in recs if r["moved"]]
    others = [r["e2e"] for r in recs if not r["moved"] and r["ok"]]
    base = median(others)
    row.update(
        moved=len(moved),
        moved_ok=sum(r["ok"] for r in moved),
        others_e2e_p50=base,
        added_p50=median([r["e2e"] - base for r in moved]),
        added_max=max([r["e2e"] - base for r in moved], default=float("nan")),
        moved_itl_max=max([max(r["itl"], default=0.0) for r in moved], default=float("nan")),
        failovers_total=sum(row["failovers"].values()),
    )
    goals = {"lost = 0": dict(value=row["lost"], met=row["lost"] == 0 and victim is not None)}
    return dict(
        rows=[row],
        goals=goals,
        records={"failover": recs},
        sizes=dict(
            requests=args.failover_requests,
            rate=args.failover_rate,
            max_tokens=args.failover_max_tokens,
            kill_after=args.kill_after,
        ),
    )


# -- report ----------------------------------------------------------------------------------
def f2(x, fmt="{:.2f}"):
    return "n/a" if x is None or (isinstance(x, float) and x != x) else fmt.format(x)


def ms(x) -> str:
    return f2(None if x is None or x != x else 1e3 * x, "{:.0f}")


def tiers_after(t: dict) -> str:
    """``{instance: {tier: blocks}}`` as ``r0: 40 12 0, r1: ...`` (``-``: a tier that is off)."""
    return (
        ", ".join(
            f"{i}: " + " ".join(f"{b[k]:g}" if k in b else "-" for k in ("device", "host", "disk"))
            for i, b in sorted(t.items())
        )
        or "-"
    )


def counts(d: dict) -> str:
    return " ".join(f"{k}:{v:g}" for k, v in d.items()) or "-"


def report(results: dict, args, mach: dict) -> None:
    print(machine_line(mach) + " per process (every instance and the front: OMP_NUM_THREADS=1)")
    print(
        f"{describe(args.model)}; "
        f"{'chat' if args.chat else 'completions'} API, streamed, greedy, EOS ignored"
    )
    if "prefix" in results:
        s = results["prefix"]["sizes"]
        print(
            f"\nprefix: {s['prefixes']} prefixes x {s['per_prefix']} requests, prefix "
            f"{s['prefix_tokens']} + "
            f"suffix {s['suffix_tokens']} tokens, {s['max_tokens']} output tokens, Poisson "
            f"{s['rate']:g} req/s; "
            + (
                f"an instance's KV cache: {s['blocks_per_instance']} blocks of {args.block_size} "
                f"tokens ({s['cache_prefixes']:g} prefixes"
                + (
                    f" = {s['cache_fraction']:g} of the working set"
                    if s.get("cache_fraction") is not None
                    else ""
                )
                + f" + {s['cache_running']} running requests; one instance: {args.replicas}x "
                "that; unbounded: every prefix)"
                if s["kv_cache_memory"] is None
                else f"--kv-cache-memory {s['kv_cache_memory']:g} GiB per instance "
                f"({args.replicas}x for one instance)"
            )
        )
        print(
            "| setup | instances | ok / sent | prefix hit rate | prefix misses | instances per "
            "prefix | req/s | output tok/s | TTFT p50 / p99 (s) | E2E p50 / p99 (s) | requests per "
            "instance | migrations | pull hints | pull / recompute / failed | pulled tokens | "
            "cached blocks after: device host disk (router's index) | load 1/5/15 min |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|---:|---:|---|---:|---|---|")
        for r in results["prefix"]["rows"]:
            print(
                f"| {r['name']} | {r['replicas']} | {r['completed']} / {r['sent']} | "
                f"{f2(r['hit_rate'], '{:.3f}')} | {r['prefix_misses']} | "
                f"{r['instances_per_prefix']:.2f} | {r['req_s']:.2f} | {r['tok_s']:.1f} | "
                f"{f2(r['ttft_p50'])} / {f2(r['ttft_p99'])} | {f2(r['e2e_p50'])} / "
                f"{f2(r['e2e_p99'])} | {counts(r['per_instance'])} | {r['migrations']:g} | "
                f"{sum(r['pull_hints'].values()):g} | "
                f"{'/'.join(f'{v:g}' for v in r['pull_decisions'].values())} | "
                f"{r['pulled_tokens']:g} | {tiers_after(r['index_tier_blocks'])} | "
                f"{' '.join(map(str, r['load_after']))} |"
            )
    if "skew" in results:
        s = results["skew"]["sizes"]
        print(
            f"\nskew: {s['bursts']} bursts x {s['burst_size']} requests sharing one "
            f"{s['prefix_tokens']}-token prefix, Poisson {s['burst_rate']:g} req/s within a burst, "
            f"a burst every {s['burst_gap']:g} s, {s['max_tokens']} output tokens, --max-num-seqs "
            f"{s['max_num_seqs']}, {args.replicas} instances, --routing {args.routing}; the prefix "
            "cached on one instance (hot) first"
        )
        print(
            "| setup | hot | ok / sent | req/s | output tok/s | TTFT p50 / p99 (s) | ITL p50 / p99 "
            "(ms) | largest gap (s) | E2E p50 / p99 (s) | requests per instance | migrations out | "
            "load 1/5/15 min |"
        )
        print("|---|---|---:|---:|---:|---|---|---:|---|---|---|---|")
        for r in results["skew"]["rows"]:
            hot = (r["primed"] or {}).get("instance") or "?"
            if (r["primed"] or {}).get("index_s") is None:
                hot += " (not in the router's index)"
            print(
                f"| {r['name']} | {hot} | {r['completed']} / {r['sent']} | {r['req_s']:.2f} | "
                f"{r['tok_s']:.1f} | {f2(r['ttft_p50'])} / {f2(r['ttft_p99'])} | "
                f"{ms(r['itl_p50'])} / {ms(r['itl_p99'])} | {f2(r['itl_max'])} | "
                f"{f2(r['e2e_p50'])} / {f2(r['e2e_p99'])} | {counts(r['per_instance'])} | "
                f"{r['migrations']:g} ({counts(r['migrations_out'])}) | "
                f"{' '.join(map(str, r['load_after']))} |"
            )
    if "failover" in results:
        s = results["failover"]["sizes"]
        r = results["failover"]["rows"][0]
        k = r["killed"] or {}
        print(
            f"\nfailover: {s['requests']} requests, Poisson {s['rate']:g} req/s, {s['max_tokens']} "
            f"output tokens, {args.replicas} instances, --routing {args.routing}; SIGKILL of the "
            f"busiest instance at {s['kill_after']:g} s"
        )
        print(
            "| sent | completed | lost | killed | at (s) | moved (header) / ok | router failovers "
            "| E2E p50 of the others (s) | added E2E of the moved: p50 / max (s) | largest gap in "
            "a moved stream (s) | TTFT p50 / p99 (s) | requests per instance | after | load 1/5/15 "
            "min |"
        )
        print("|---:|---:|---:|---|---:|---:|---|---:|---|---:|---|---|---|---|")
        after = r["instances_after"]
        after = (
            " ".join(f"{i['id']}:{i['state']}" for i in after)
            if isinstance(after, list)
            else str(after)
        )
        print(
            f"| {r['sent']} | {r['completed']} | {r['lost']} | "
            f"{k.get('instance', k.get('error', '-'))} "
            f"(pid {k.get('pid', '-')}) | {f2(k.get('at'))} | {r['moved']} / {r['moved_ok']} | "
            f"{r['failovers_total']:g} ({counts(r['failovers'])}) | {f2(r['others_e2e_p50'])} | "
            f"{f2(r['added_p50'])} / {f2(r['added_max'])} | {f2(r['moved_itl_max'])} | "
            f"{f2(r['ttft_p50'])} / {f2(r['ttft_p99'])} | {counts(r['per_instance'])} | {after} | "
            f"{' '.join(map(str, r['load_after']))} |"
        )
    print()
    for name, res in results.items():
        for goal, g in res["goals"].items():
            print(
                f"goal ({name}): {goal}: "
                f"{f2(g['value'], '{:.2f}') if not isinstance(g['value'], int) else g['value']}"
                f" -> {'met' if g['met'] else 'NOT met'}"
            )
        for r in res["rows"]:
            if r["errors"]:
                print(f"{name}/{r['name']}: {r['lost']} lost; first errors: {r['errors'][:3]}")
            for p in r["router_problems"]:
                print(f"{name}/{r['name']}: router problem: {p}")
    print(f"load averages (1, 5, 15 min) at the end: {' '.join(map(str, load()))}")


def plot(results: dict, path: str, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in ("prefix", "skew", "failover") if n in results]
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        rows = results[name]["rows"]
        if name == "prefix":
            xs = range(len(rows))
            ax.bar(
                xs, [r["hit_rate"] or 0 for r in rows], color="tab:blue", label="prefix hit rate"
            )
            for x, r in zip(xs, rows):
                ax.text(x, (r["hit_rate"] or 0) + 0.02, f2(r["hit_rate"]), ha="center")
            ax.set_xticks(list(xs), [r["name"] for r in rows])
            ax.set_ylabel("prefix hit rate")
            ax.set_ylim(0, 1)
            tw = ax.twinx()
            tw.plot(xs, [r["ttft_p50"] for r in rows], "ko-", label="TTFT p50")
            tw.plot(xs, [r["ttft_p99"] for r in rows], "k^--", label="TTFT p99")
            tw.set_ylabel("seconds")
            tw.set_ylim(bottom=0)
            tw.legend(loc="upper right", fontsize=8)
            ax.set_title("prefix: hit rate and TTFT")
        elif name == "skew":
            keys = [
                ("ttft_p50", "TTFT p50"),
                ("ttft_p99", "TTFT p99"),
                ("itl_p50", "ITL p50"),
                ("itl_p99", "ITL p99"),
            ]
            w = 0.8 / len(rows)
            for j, r in enumerate(rows):
                ax.bar(
                    [k + j * w for k in range(len(keys))],
                    [r[k] for k, _ in keys],
                    w,
                    label=f"{r['name']} ({r['migrations']:g} migrations)",
                )
            ax.set_xticks([k + 0.4 - w / 2 for k in range(len(keys))], [t for _, t in keys])
            ax.set_yscale("log")
            top = max((r[k] for r in rows for k, _ in keys if r[k] == r[k]), default=1.0)
            ax.set_ylim(top=top * 6)  # room for the legend
            ax.set_ylabel("seconds")
            ax.legend(loc="upper left", fontsize=8)
            ax.set_title("skew: one hot prefix")
        else:
            recs = results[name]["records"]["failover"]
            for moved, style in ((False, "o"), (True, "x")):
                rs = [r for r in recs if r["moved"] == moved]
                ax.plot(
                    [r["sent"] for r in rs],
                    [r["e2e"] for r in rs],
                    style,
                    color="tab:red" if moved else "tab:blue",
                    label="failed over" if moved else "others",
                )
            k = rows[0]["killed"] or {}
            if k.get("at") is not None:
                ax.axvline(k["at"], color="k", ls="--", label=f"SIGKILL {k.get('instance')}")
            ax.set_xlabel("sent at (s)")
            ax.set_ylabel("end-to-end latency (s)")
            ax.legend()
            ax.set_title(f"failover: {rows[0]['lost']} lost of {rows[0]['sent']}")
    m = machine(threads=1)
    fig.suptitle(
        f"ringkv serve --replicas {args.replicas}: {describe(args.model)}; {m['cpu']}, {m['isa']}, "
        f"{m['cores']} cores"
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--scenario", choices=["prefix", "skew", "failover", "all"], default="all")
    ap.add_argument(
        "--model",
        default="smollm2",
        help="smollm2, a preset of benchmarks/models.py, or a directory",
    )
    ap.add_argument("--replicas", type=int, default=2, help="N: engine instances behind the router")
    ap.add_argument("--routing", default="kv", help="the router's --routing in skew and failover")
    ap.add_argument(
        "--chat",
        action="store_true",
        help="/v1/chat/completions, the prefix as the system message (default: /v1/completions)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=8, help="per instance (prefix, failover)")
    ap.add_argument(
        "--kv-cache-memory",
        type=float,
        default=None,
        help="GiB per instance (default: sized from the model and the scenario)",
    )
    ap.add_argument(
        "--server-args", default="", help="extra arguments for every ringkv serve (e.g. '--tp 2')"
    )
    ap.add_argument(
        "--start-timeout", type=float, default=300, help="seconds for all instances to be up"
    )
    g = ap.add_argument_group("prefix")
    g.add_argument(
        "--setups",
        nargs="+",
        default=None,
        help="of unbounded, 'one instance', kv, kv-old, round-robin, round-robin-old (default: all "
        "but 'one instance')",
    )
    g.add_argument("--prefixes", type=int, default=4, help="K shared prefixes")
    g.add_argument("--per-prefix", type=int, default=8, help="M requests per prefix")
    g.add_argument("--prefix-tokens", type=int, default=300)
    g.add_argument("--suffix-tokens", type=int, default=12)
    g.add_argument("--prefix-max-tokens", type=int, default=8)
    g.add_argument("--prefix-rate", type=float, default=1.5, help="requests/s (Poisson)")
    g.add_argument(
        "--cache-prefixes",
        type=float,
        default=None,
        help="prefixes an instance's KV cache holds besides its running requests (default K/N)",
    )
    g.add_argument(
        "--cache-fraction",
        type=float,
        default=None,
        help="an instance's KV cache holds this fraction of the K prefixes (0.25: a quarter of "
        "the working set) besides its running requests; instead of --cache-prefixes",
    )
    g.add_argument(
        "--cache-running",
        type=int,
        default=None,
        help="running requests whose own blocks (prefix tail, suffix, output) an instance's cache "
        "holds besides the prefixes (default --max-num-seqs)",
    )
    g = ap.add_argument_group("skew")
    g.add_argument("--bursts", type=int, default=2)
    g.add_argument("--burst-size", type=int, default=12)
    g.add_argument(
        "--burst-rate", type=float, default=8.0, help="requests/s within a burst (Poisson)"
    )
    g.add_argument(
        "--burst-gap", type=float, default=12.0, help="seconds from one burst's start to the next"
    )
    g.add_argument("--skew-max-tokens", type=int, default=48)
    g.add_argument("--skew-max-num-seqs", type=int, default=4)
    g.add_argument(
        "--migration-threshold", type=float, default=None, help="the router's (default: its own)"
    )
    g = ap.add_argument_group("failover")
    g.add_argument("--failover-requests", type=int, default=16)
    g.add_argument("--failover-rate", type=float, default=2.0, help="requests/s (Poisson)")
    g.add_argument("--failover-max-tokens", type=int, default=32)
    g.add_argument("--kill-after", type=float, default=3.0, help="seconds into the load")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    if args.cache_fraction is not None:
        if args.cache_prefixes is not None:
            ap.error("give --cache-fraction or --cache-prefixes, not both")
        if not 0 < args.cache_fraction <= 1:
            ap.error(f"--cache-fraction must be in (0, 1], got {args.cache_fraction}")
    from tqdm import tqdm

    signal.signal(
        signal.SIGTERM, lambda *_: sys.exit(143)
    )  # a SIGTERM stops the fronts too (finally)
    path = model_path(args.model)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype_bytes = 2 if re.search(r"--dtype\s+(bfloat16|float16|bf16|fp16)", args.server_args) else 4
    args.bytes_per_token = (
        2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes
    )
    prompts = Prompts(path)
    scenarios = ["prefix", "skew", "failover"] if args.scenario == "all" else [args.scenario]
    total = {
        "prefix": args.prefixes * args.per_prefix * len(args.setups or DEFAULT_SETUPS),
        "skew": 2 * args.bursts * args.burst_size,
        "failover": args.failover_requests,
    }
    bar = tqdm(total=sum(total[s] for s in scenarios), desc="requests", unit="req")
    load0, results = load(), {}
    fn = dict(prefix=scenario_prefix, skew=scenario_skew, failover=scenario_failover)
    try:
        for s in scenarios:
            results[s] = fn[s](args, path, prompts, bar)
    finally:
        bar.close()
    mach = machine(threads=1)  # Front: OMP_NUM_THREADS=1 for every process it starts
    report(results, args, mach)
    print(f"load averages (1, 5, 15 min) at the start: {' '.join(map(str, load0))}")
    if args.json:
        write_json(
            args.json,
            dict(
                model=describe(args.model),
                cores=mach["cores"],
                machine=mach,
                replicas=args.replicas,
                args={k: v for k, v in vars(args).items()},
                load_start=load0,
                load_end=load(),
                scenarios=results,
            ),
        )
    if args.plot:
        plot(results, args.plot, args)


if __name__ == "__main__":
    main()
