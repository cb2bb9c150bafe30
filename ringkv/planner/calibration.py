"""Calibration: rates measured by ringkv's benchmarks replace the hardware table's.
``apply_calibration`` takes a rates dict or benchmark JSON files; ``fit_rates`` reads them (rates
files, ``long_ctx.py``'s attention rate via ``_fit_attention``, the one-process runs of
``long_prefill.py`` and ``engine.py`` via ``_single_process_runs``) and ``fit_engine`` fits one
thread's rates, host seconds and thread scaling on measured ``EngineRun``s (Nelder-Mead over the
logarithms of ``FIT_KEYS``)."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from typing import Dict, Iterable, List, Sequence

from .catalogue import model_of, read_json
from .hardware import Rates
from .simulation import EngineRun


# -- fitting the time model to measured engine runs
# ----------------------------------------------------
FIT_KEYS = ("matmul", "memory", "attention", "step", "seq", "layer", "thread_scaling")


def fit_engine(
    runs: Sequence[EngineRun],
    r: Rates,
    keys: Sequence[str] = ("matmul", "memory", "step", "seq", "layer"),
) -> Rates:
    """``r`` with ``keys`` (one thread's rates: matmul, memory, attention; host seconds: step,
    seq, layer; ``thread_scaling``, which needs runs with different thread counts) chosen to
    minimise the squared log error of ``runs``' modelled times (Nelder-Mead over the
    logarithms; the other fields stay). Never fit on the run being predicted."""
    bad = [k for k in keys if k not in FIT_KEYS]
    if bad or not runs:
        raise ValueError(f"fit_engine needs runs and keys among {FIT_KEYS}, got {list(keys)}")
    start = dict(
        matmul=r.matmul,
        memory=r.memory,
        attention=r.attention,
        step=r.host.get("step") or 1e-3,
        seq=r.host.get("seq") or 1e-4,
        layer=r.host.get("layer") or 1e-4,
        thread_scaling=r.thread_scaling,
    )

    def make(x) -> Rates:
        out = copy.deepcopy(r)
        for k, v in zip(keys, x):
            if k in ("step", "seq", "layer"):
                out.host[k] = math.exp(v)
            else:
                setattr(out, k, math.exp(v))
        return out

    def loss(x) -> float:
        rr = make(x)
        return sum(math.log(run.seconds(rr) / run.measured_s) ** 2 for run in runs)

    x = _nelder_mead(loss, [math.log(start[k]) for k in keys])
    x = _nelder_mead(loss, x)  # a restart around the first optimum
    return make(x)


def _nelder_mead(
    f, x0: List[float], step: float = 0.7, iters: int = 400, tol: float = 1e-9
) -> List[float]:
    """Minimise ``f`` from ``x0`` (standard reflection / expansion / contraction / shrink)."""
    n = len(x0)
    pts = [list(x0)] + [[x0[j] + (step if j == i else 0.0) for j in range(n)] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(n + 1), key=vals.__getitem__)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < tol:
            break
        c = [sum(p[j] for p in pts[:-1]) / n for j in range(n)]
        xr = [2 * c[j] - pts[-1][j] for j in range(n)]
        fr = f(xr)
        if fr < vals[0]:
            xe = [3 * c[j] - 2 * pts[-1][j] for j in range(n)]
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = [(c[j] + pts[-1][j]) / 2 for j in range(n)]
            fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                pts = [pts[0]] + [[(pts[0][j] + p[j]) / 2 for j in range(n)] for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    return pts[min(range(n + 1), key=vals.__getitem__)]


# -- calibration: rates measured by ringkv's benchmarks
# ---------------------------------------------
RATE_KEYS = ("matmul", "attention", "memory", "thread_scaling", "links", "latency", "host", "gemm")


def apply_calibration(r: Rates, calibrate) -> Rates:
    """``r`` with rates replaced: ``calibrate`` is a rates dict (keys of ``Rates``), a path to one
    (``{"rates": {...}}`` or the dict itself), or benchmark JSON paths (see ``fit_rates``)."""
    if isinstance(calibrate, dict):
        return _with(r, calibrate)
    paths = [calibrate] if isinstance(calibrate, (str, os.PathLike)) else list(calibrate)
    return fit_rates(paths, r)


def _with(r: Rates, d: dict) -> Rates:
    d = d.get("rates", d)  # a benchmark's JSON holds its rates under "rates"
    bad = [k for k in d if k not in RATE_KEYS + ("source",)]
    if bad:
        raise ValueError(f"unknown calibration keys {bad}; use {list(RATE_KEYS)}")
    out = copy.deepcopy(r)
    for k in ("matmul", "attention", "memory", "thread_scaling"):
        if k in d:
            out.__dict__[k] = float(d[k])
    for k in ("links", "latency", "host"):
        out.__dict__[k].update({n: float(v) for n, v in d.get(k, {}).items()})
    for t, table in d.get("gemm", {}).items():
        out.gemm[str(t)] = {str(rows): float(v) for rows, v in table.items()}
    out.source = d.get("source", "calibration")
    return out


def fit_rates(paths: Iterable, r: Rates) -> Rates:
    """One thread's rates fitted from benchmark JSON files, in this order whatever the order
    given: rates files (``benchmarks/collective_latency.py --json`` is one: a link's latency and
    bandwidth under load); ``benchmarks/long_ctx.py --json`` (attention FLOP/s of one rank: the
    balanced causal rows); then, pooled, the one-process runs of ``benchmarks/long_prefill.py
    --json`` (its ``sp = 1`` rows) and ``benchmarks/engine.py --json`` (the ``tp = pp = sp = 1``
    baseline of every row), each with its torch threads: ``fit_engine`` over the engine's
    workload (prompts of the row's mean length) fits matmul (and, given engine rows, memory
    bandwidth and the host seconds per step, per sequence and per layer; given runs with
    different thread counts, ``thread_scaling``; else a rank's rates are the process's divided by
    its threads, the 16K ring run having measured 1.91x for attention at 2 threads)."""
    order = {"rates": 0, "long_ctx": 1, "prefill": 2, "engine": 2}
    docs = [(p, d, _kind(p, d)) for p, d in ((p, read_json(p)) for p in paths)]
    out, used, runs = copy.deepcopy(r), [], []
    for p, d, kind in sorted(
        docs, key=lambda t: order[t[2]]
    ):  # stable: the given order within a kind
        if kind == "rates":
            out = _with(out, d)
        elif kind == "long_ctx":
            out.attention = _fit_attention(d)
        else:
            runs += _single_process_runs(d)
        used.append(os.path.basename(str(p)))
    if runs:
        out = dataclasses.replace(fit_engine(runs, out, fit_keys(runs)), attention=out.attention)
    out.source = "calibrated from " + ", ".join(used)
    return out


def fit_keys(runs: Sequence[EngineRun]) -> tuple:
    """What ``runs`` can tell ``fit_engine``: matmul; memory and host seconds given multi-step
    (engine) runs; ``thread_scaling`` given runs on different thread counts."""
    keys = (
        ("matmul", "memory", "step", "seq", "layer")
        if any(x.max_tokens > 1 for x in runs)
        else ("matmul",)
    )
    return keys + (("thread_scaling",) if len({x.threads for x in runs}) > 1 else ())


def _single_process_runs(d: dict) -> List[EngineRun]:
    """``EngineRun``s of the one-process runs in a ``long_prefill.py`` (its ``--sweep`` too) or
    ``engine.py`` JSON."""
    out = []
    if d.get("kind") in ("prefill", "sweep"):
        for row in d["rows"]:
            if row.get("sp", 1) == 1:
                seq = row["seq"]
                out.append(
                    EngineRun(
                        cfg=model_of(row.get("model", d.get("model"))),
                        prompts=[seq],
                        max_tokens=1,
                        num_blocks=seq // 16 + 8,
                        measured_s=one_process_seconds(row),
                        threads=row.get("threads") or d.get("cores") or 1,
                        max_num_seqs=1,
                        max_num_batched_tokens=row.get("chunk") or seq,
                        label=f"{row.get('model')} {seq} sp=1",
                    )
                )
        return out
    cfg = model_of(d["model"])
    for row in d["rows"]:
        n, total = row["requests"], row["prompt_tokens"]
        prompts = [total // n + (i < total % n) for i in range(n)]
        out.append(
            EngineRun(
                cfg=cfg,
                prompts=prompts,
                max_tokens=d["max_tokens"],
                num_blocks=row["base_capacity_tokens"] // 16,
                measured_s=row["output_tokens"] / row["base_tok_s"],
                threads=row.get("base_threads", d["cores"]),
                max_num_seqs=n,
                label=f"{n} requests, one process",
            )
        )
    return out


def one_process_seconds(row: dict) -> float:
    """The time of a one-process ``long_prefill.py`` row (``ttft_s``; ``sp1_s`` of a sweep row);
    for a one-thread run its CPU seconds (``cpu_s``): the time it ran on a core, which a loaded
    machine does not stretch as it stretches the wall time."""
    if row.get("threads") == 1 and row.get("cpu_s"):
        return min(row["cpu_s"])
    return row["ttft_s"] if "ttft_s" in row else row["sp1_s"]


def _kind(path, d: dict) -> str:
    if "rates" in d or any(k in d for k in RATE_KEYS):
        return "rates"
    if d.get("kind") in ("prefill", "sweep"):
        return "prefill"
    rows = d.get("rows") or []
    if rows and "tflops_per_rank" in rows[0]:
        return "long_ctx"
    if rows and "parallel_tok_s" in rows[0]:
        return "engine"
    raise ValueError(
        f"{path!r} is not a rates file nor the JSON of long_ctx.py, long_prefill.py or engine.py"
    )


def _fit_attention(d: dict) -> float:
    """FLOP/s of one rank's attention blocks: counted FLOPs over the ring time without communication
    (``time_nocomm_s``, else ``time_s``), median over the balanced causal rows."""
    a = d["args"]
    vals = []
    for row in d["rows"]:
        if row.get("causal") and row.get("layout") in ("zigzag", "striped"):
            t = row.get("time_nocomm_s") or row["time_s"]
            vals.append(4 * row["pairs_per_rank"] * a["batch"] * a["heads"] * a["head_dim"] / t)
    if not vals:
        raise ValueError(
            "long_ctx JSON has no causal zigzag/striped row to fit the attention rate from"
        )
    return sorted(vals)[len(vals) // 2]


def _parse_config(s: str) -> Dict[str, int]:
    """The mesh of an ``engine.py`` row's ``config`` ("tp=2 pp=2 sp=1") as ``EngineRun``
    keywords."""
    return {k: int(v) for k, v in (kv.split("=") for kv in s.split())}
