"""The hardware table and the rates the time model prices with: ``load_hardware`` reads
``ringkv/hardware.json`` (``HARDWARE_PATH``, package data beside the package) with a user's file
merged over it; ``Rates`` are one device's (one CPU thread's) achievable rates, ``rates`` takes
them from the table (peak x efficiency), ``with_threads`` scales them to a process's threads.
Calibration (``calibration.py``) replaces them with measured ones."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Tuple, Union

from .catalogue import read_json

HARDWARE_PATH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hardware.json"
)


def load_hardware(path: Optional[str] = None) -> dict:
    """The hardware table (``ringkv/hardware.json``), with the entries of ``path`` merged over
    it."""
    table = read_json(HARDWARE_PATH, "hardware table")
    if path is None:
        return table
    extra = read_json(path, "hardware file")
    if not isinstance(extra, dict):
        raise ValueError(
            f"hardware file {path!r} must hold a JSON object like ringkv/hardware.json"
        )
    return merge_hardware(table, extra)


def merge_hardware(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = (
            merge_hardware(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


@dataclass(kw_only=True)
class Rates:
    """Achievable rates of one device (on a CPU: one thread): FLOP/s of linear layers and of
    attention, memory bytes/s, per link bytes/s (one direction) and latency (s), host seconds
    per engine step (``step``, ``seq``: per sequence, ``layer``: per layer). A process with
    ``t`` threads computes and reads memory at ``t ** thread_scaling`` times these rates.
    ``gemm``: measured bytes/s at which a process of ``threads`` streams the weights through
    decode matmuls of ``rows`` tokens, ``{threads: {rows: bytes/s}}``
    (``benchmarks/decode_gemm.py``); where it has the process's thread count, a step's weights are
    read at that rate (linear in rows between the measured ones, the nearest outside) instead of
    ``memory``."""

    matmul: float
    attention: float
    memory: float
    links: Dict[str, float]
    latency: Dict[str, float]
    source: str = "hardware table x efficiency"
    host: Dict[str, float] = field(default_factory=dict)
    thread_scaling: float = 1.0
    gemm: Dict[str, Dict[str, float]] = field(default_factory=dict)
    threads: int = 1  # the process's threads (``with_threads``): selects the ``gemm`` row
    # links that are one per node (a host's network link, ``plan(links={"inter": ...})``): the
    # node's ranks whose messages cross it at the same time share its bandwidth; the others
    # (the table's ``ib``: one NIC per GPU; NVLink) are per device
    shared: Dict[str, bool] = field(default_factory=dict)

    def weight_rate(self, rows: float) -> Optional[float]:
        """Measured weight bytes/s at ``rows`` for this process's threads, or None."""
        table = self.gemm.get(str(self.threads))
        if not table:
            return None
        pts = sorted((float(k), float(v)) for k, v in table.items())
        if rows <= pts[0][0]:
            return pts[0][1]
        for (r0, b0), (r1, b1) in zip(pts, pts[1:]):
            if rows <= r1:  # weighted so that a measured point comes back exactly
                t = (rows - r0) / (r1 - r0)
                return b0 * (1 - t) + b1 * t
        return pts[-1][1]


def rates(hw: dict, gpu: str, dtype: str = "bfloat16") -> Rates:
    """Peak x efficiency for ``gpu`` from the hardware table ``hw``."""
    g = hw["gpus"][gpu]
    eff = dict(hw["efficiency"], **g.get("efficiency", {}))
    flops = g["flops"]
    if dtype not in flops:
        raise ValueError(
            f"{gpu} has no {dtype} peak in the hardware table; choose dtype in {sorted(flops)}"
        )
    attn_dtype = "float32" if dtype == "float32" else "bfloat16"
    return Rates(
        matmul=flops[dtype] * eff["matmul"],
        attention=flops[attn_dtype] * eff["attention"],
        memory=g["mem_bw"] * eff["memory"],
        links={k: v * eff["link"] for k, v in g["links"].items()},
        latency={k: hw["links"].get(k, {}).get("latency", 0.0) for k in g["links"]},
        host={
            k: float(v)
            for k, v in dict(hw.get("host", {}), **g.get("host", {})).items()
            if not k.startswith("_")
        },
    )


def with_threads(r: Rates, t: int) -> Rates:
    """The rates of a process with ``t`` threads from one thread's ``r``: compute and memory times
    ``t ** thread_scaling``; the ``gemm`` row of ``t`` threads."""
    k = t**r.thread_scaling
    return dataclasses.replace(
        r, matmul=r.matmul * k, memory=r.memory * k, attention=r.attention * k, threads=t
    )


# -- links given by the user: --link intra=10gbit,20us --link inter=1gbit,100us
# --------------------------
LINK_LEVELS = ("intra", "inter")  # inside a node (host), between nodes
_RATE_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_rate(s: Union[str, float, int]) -> float:
    """Bytes/s of a link rate: tc's units (``100mbit``, ``1gbit``, ``10gbit``: bits/s; ``mbps``:
    megabytes/s, as tc reads it) or a plain number of bytes/s. ``ValueError`` unless > 0."""
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        v = float(s)
    else:
        m = re.fullmatch(
            r"(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\s*(?:([kmgt]?)(bit|bps))?", str(s).strip().lower()
        )
        if not m:
            raise ValueError(
                f"link rate {s!r}: use tc's units (100mbit, 1gbit, 10gbit; mbps = megabytes/s) or "
                "bytes/s (1.25e9)"
            )
        v = float(m.group(1))
        if m.group(3):
            v *= _RATE_UNITS[m.group(2)] / (8 if m.group(3) == "bit" else 1)
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"link rate {s!r} must be > 0")
    return v


def parse_latency(s: Union[str, float, int]) -> float:
    """Seconds of a per-message latency with its unit (``20us``, ``0.1ms``, ``1e-4s``); a plain
    number is seconds. ``ValueError`` if negative or not a time."""
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        v = float(s)
    else:
        m = re.fullmatch(
            r"(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\s*(s|ms|us|µs|ns)?", str(s).strip().lower()
        )
        if not m:
            raise ValueError(f"link latency {s!r}: give a time with its unit (20us, 0.1ms, 1s)")
        v = float(m.group(1)) * _TIME_UNITS[m.group(2) or "s"]
    if not (v >= 0 and math.isfinite(v)):
        raise ValueError(f"link latency {s!r} must be >= 0")
    return v


def parse_link(spec) -> Tuple[float, float]:
    """``(bytes/s, latency s)`` of a link: ``"10gbit,20us"``, ``"1gbit"`` (latency 0), or a
    ``(rate, latency)`` pair of numbers or strings."""
    if isinstance(spec, str):
        parts = [p.strip() for p in spec.split(",")]
        if len(parts) > 2 or not parts[0]:
            raise ValueError(f"link {spec!r}: give RATE[,LATENCY], e.g. 10gbit,20us")
        return parse_rate(parts[0]), parse_latency(parts[1] if len(parts) > 1 else 0.0)
    if isinstance(spec, (tuple, list)) and len(spec) == 2:
        return parse_rate(spec[0]), parse_latency(spec[1])
    raise ValueError(f"link {spec!r}: give (bytes_per_s, latency_s) or 'RATE,LATENCY'")


def parse_links(links) -> Dict[str, Tuple[float, float]]:
    """``{"intra": (bytes/s, s), "inter": ...}`` from a dict of levels (values as ``parse_link``
    takes them) or the CLI's ``["intra=10gbit,20us", "inter=1gbit,100us"]``."""
    if isinstance(links, Mapping):
        items = list(links.items())
    else:
        items = []
        for s in links:
            level, eq, spec = str(s).partition("=")
            if not eq:
                raise ValueError(f"--link {s!r}: give LEVEL=RATE[,LATENCY], e.g. inter=1gbit,100us")
            items.append((level.strip(), spec))
    out = {}
    for level, spec in items:
        if level not in LINK_LEVELS:
            raise ValueError(
                f"unknown link level {level!r}; choose {' or '.join(LINK_LEVELS)} (inside a "
                "node / between nodes)"
            )
        if level in out:
            raise ValueError(f"link level {level!r} given twice")
        out[level] = parse_link(spec)
    return out
