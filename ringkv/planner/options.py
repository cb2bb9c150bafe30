"""The planner's options: ``plan()`` enumerates every ``(tp, pp, sp[, ulysses])`` the engine
accepts for a number of GPUs, prices each (``_option``: memory from ``memory.py``, prefill and
decode from the roofline with ``ring_attention_seconds`` and ``message_seconds``) into an
``Option``, and ranks them by the seed's rules (``_rank``, ``_why``, ``_needs_sp``;
``SEED_SP_TOKENS``, ``SEED_MAX_PP``, ``WEAK_LINK_MAX_TP``), recommending exactly one that fits."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Union

from ..kernels import quant
from ..parallel.tp import check_tp, kv_heads_per_rank
from ..sp.ulysses import HeadSplit
from .calibration import apply_calibration
from .catalogue import load_model
from .hardware import Rates, merge_hardware, load_hardware, parse_link, parse_links, rates
from .memory import (
    DTYPES,
    gb,
    layer_params,
    stage_kv_bytes_per_token,
    stage_sizes,
    stage_weight_bytes,
)
from .simulation import shared_link, message_seconds, migration_seconds, ring_attention_seconds
from .sp_method import ulysses_bytes

SEED_SP_TOKENS = 32768  # seed rule 4: consider SP beyond 32K tokens
SEED_MAX_PP = 4  # seed rule 2: PP depth usually <= 4
WEAK_LINK_MAX_TP = 2  # seed (consumer cards): without NVLink TP=2 is the most that still pays


# -- the option ------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class Option:
    """One configuration and what it costs. Bytes are per GPU (the fullest stage), times in s."""

    tp: int
    pp: int
    sp: int
    ulysses: int  # Ulysses degree inside sp (1: plain ring); ring degree = sp / ulysses
    kv_cache_dtype: str
    layers_per_stage: List[int]
    kv_heads_per_gpu: int
    weight_bytes_per_gpu: int
    kv_bytes_per_token_per_gpu: int
    kv_bytes_per_gpu: int
    memory_per_gpu: int  # usable: memory x utilization
    fits: bool
    ring_bytes_per_step: int  # K/V block one rank sends per ring step, per layer
    ring_compute_s_per_step: float
    ring_transfer_s_per_step: float
    tp_allreduce_bytes_per_layer: int  # bytes one rank sends in a layer's two all-reduces (prefill)
    ulysses_bytes_per_layer: int  # bytes one rank sends in a layer's four all-to-alls (prefill)
    links: Dict[str, str]  # the link each axis uses
    prefill_s: float
    decode_tokens_per_s: float
    decode_step_s: float
    recommended: bool = False
    reason: str = ""
    warnings: List[str] = field(default_factory=list)

    def asdict(self) -> dict:
        return asdict(self)


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return v


def _link(group: int, span: int, gpn: int, intra: str) -> str:
    """The link an axis's group uses: ``intra`` if the ``span`` consecutive ranks it covers stay
    inside a node (global rank = (pp_rank * sp + sp_rank) * tp + tp_rank), else ``ib``."""
    return intra if group == 1 or gpn % span == 0 else "ib"


def plan(
    model,
    seq: int,
    *,
    batch: int = 1,
    gpus: int,
    gpu: str = "h100",
    interconnect: str = "nvlink",
    nodes: Optional[int] = None,
    kv_cache_dtype: Union[str, Sequence[str]] = "auto",
    dtype: str = "bfloat16",
    hardware: Union[None, str, dict] = None,
    calibrate=None,
    gpu_memory_utilization: float = 0.9,
    output_tokens: int = 256,
    ulysses: bool = True,
    links=None,
) -> List[Option]:
    """Every valid ``(tp, pp, sp[, ulysses])`` for ``gpus`` GPUs, best first; exactly one
    ``recommended`` among those that fit (none when nothing fits; each option's ``reason`` says
    why).

    ``model``: preset name (``PRESETS``), HF directory / config.json, config dict or ModelConfig.
    ``seq``: tokens per sequence (prompt + output), ``batch``: sequences held and decoded together.
    ``gpu``: a key of the hardware table; ``interconnect``: the link inside a node (``nvlink``,
    ``pcie``; ``ib``: one GPU per node); ``nodes``: how many nodes hold the GPUs (links between
    nodes are ``ib``). ``kv_cache_dtype``: one or several of ``auto``, ``int8``, ``fp8``...
    ``dtype``: weights/activations (``fp8``: FP8 weights and matmuls, bf16 K/V).
    ``hardware``: a file or dict merged over the table; ``calibrate``: benchmark JSON paths or a
    rates dict (see ``calibrate``) replacing the table's rates. ``output_tokens``: decode length
    used to rank options (prefill + that many decode steps). ``links``: the links' bandwidth
    (bytes/s) and per-message latency (s) per level, overriding the table's (and a
    calibration's): ``{"intra": (bytes_per_s, latency_s), "inter": ...}`` (values may be strings,
    ``"10gbit,20us"``; ``parse_links``); ``intra`` is the link inside a node (``interconnect``),
    ``inter`` the link between nodes (``ib``)."""
    cfg = load_model(model)
    given = parse_links(links) if links is not None else {}
    seq, batch, gpus = (
        _positive_int("seq", seq),
        _positive_int("batch", batch),
        _positive_int("gpus", gpus),
    )
    hw, g = _gpu_of(hardware, gpu, dtype)
    gpn = _gpus_per_node(gpus, nodes, gpu, g, interconnect, given)
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(
            f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}"
        )
    kv_dtypes = [kv_cache_dtype] if isinstance(kv_cache_dtype, str) else list(kv_cache_dtype)
    for k in kv_dtypes:
        quant.resolve(k)  # ValueError naming the choices
    r = _rates_for(hw, gpu, dtype, calibrate, given, interconnect)
    intra = interconnect
    usable = int(g["memory"] * gpu_memory_utilization)

    options = []
    for tp, pp, sp, u in _layouts(cfg, gpus, ulysses):
        for kvd in kv_dtypes:
            links = dict(
                tp=_link(tp, tp, gpn, intra),
                ulysses=_link(u, tp * u, gpn, intra),
                ring=_link(sp // u, tp * sp, gpn, intra),
                pp=_link(pp, gpus, gpn, intra),
            )
            # ranks of one node sending over an axis's link at once: a stage's TP x SP
            # ranks hand off together, each TP rank rings its own heads
            share = dict(tp=1, ulysses=min(gpn, tp * u), ring=tp, pp=min(gpn, tp * sp))
            options.append(
                _option(
                    cfg,
                    seq,
                    batch,
                    tp,
                    pp,
                    sp,
                    u,
                    kvd,
                    dtype,
                    r,
                    links,
                    usable,
                    output_tokens,
                    share,
                )
            )
    if not options:
        raise ValueError(
            f"no (tp, pp, sp) with tp x pp x sp = {gpus} suits this model "
            f"({cfg.num_heads} heads, {cfg.num_kv_heads} KV heads, {cfg.num_layers} layers)"
        )
    return _rank(options, cfg, seq, gpn, interconnect, output_tokens, g)


def _rates_for(hw: dict, gpu: str, dtype: str, calibrate, given: dict, interconnect: str) -> Rates:
    """The table's rates for ``gpu``/``dtype``, calibrated, with the ``given`` links over them."""
    r = rates(hw, gpu, dtype)
    if calibrate is not None:
        r = apply_calibration(r, calibrate)
    for level, (bw, lat) in given.items():
        name = interconnect if level == "intra" else "ib"
        r.links[name], r.latency[name] = bw, lat
        r.shared[name] = level == "inter"  # a node's link, shared by its ranks that cross at once
    return r


def _gpu_of(hardware, gpu: str, dtype: str):
    """``(hardware table, its row for gpu)``; ValueError for an unknown gpu or dtype."""
    hw = (
        load_hardware(hardware)
        if not isinstance(hardware, dict)
        else merge_hardware(load_hardware(), hardware)
    )
    if gpu not in hw["gpus"]:
        raise ValueError(
            f"unknown gpu {gpu!r}; choose one of {', '.join(hw['gpus'])} (or add it with "
            "--hardware)"
        )
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return hw, hw["gpus"][gpu]


def _gpus_per_node(gpus: int, nodes, gpu: str, g: dict, interconnect: str, given: dict) -> int:
    """GPUs per node of ``gpus`` over ``nodes`` (None: as few as hold them), checked against the
    links the table (or ``given``) has for ``gpu`` and the GPUs one of its nodes holds."""
    have = list(g["links"]) + [
        name for level, name in (("intra", interconnect), ("inter", "ib")) if level in given
    ]
    if interconnect not in have:
        raise ValueError(
            f"{gpu} has no {interconnect!r} link in the hardware table; choose interconnect in "
            f"{have}"
        )
    if nodes is None:
        nodes = gpus if interconnect == "ib" else max(1, -(-gpus // g["gpus_per_node"]))
    nodes = _positive_int("nodes", nodes)
    if gpus % nodes:
        raise ValueError(
            f"nodes={nodes} does not divide gpus={gpus}; give gpus as nodes x GPUs per node"
        )
    if nodes > 1 and "ib" not in have:
        raise ValueError(
            f"{gpu} has no 'ib' link for {nodes} nodes in the hardware table; give it with "
            "--link inter=RATE,LATENCY (or --hardware)"
        )
    gpn = gpus // nodes
    if gpn > g["gpus_per_node"]:
        raise ValueError(
            f"{gpn} GPUs per node exceed the {g['gpus_per_node']} a {gpu} node holds; give --nodes"
        )
    return gpn


def _layouts(cfg, gpus: int, ulysses: bool):
    """Every ``(tp, pp, sp, u)`` with ``tp x pp x sp = gpus`` the model takes (``u``: the Ulysses
    degree inside ``sp``, 1 unless ``ulysses``)."""
    for tp in _divisors(gpus):
        try:
            check_tp(cfg, tp)
        except ValueError:
            continue
        for pp in _divisors(gpus // tp):
            if pp > cfg.num_layers:
                continue
            sp = gpus // tp // pp
            hq = cfg.num_heads // tp
            for u in [d for d in _divisors(sp) if hq % d == 0 and (ulysses or d == 1)]:
                yield tp, pp, sp, u


def request_kv_bytes(
    model, tokens: int, kv_cache_dtype: str = "auto", dtype: str = "bfloat16"
) -> int:
    """Bytes of the K/V cache of one request of ``tokens`` tokens, all layers and KV heads (what
    a migration moves; a TP/PP/SP engine holds it in pieces, the same total)."""
    cfg = load_model(model)
    tokens = _positive_int("tokens", tokens)
    quant.resolve(kv_cache_dtype)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return tokens * stage_kv_bytes_per_token(cfg, 1, 1, kv_cache_dtype, dtype)[0]


def migration_time(
    model,
    tokens: int,
    link,
    *,
    kv_cache_dtype: str = "auto",
    dtype: str = "bfloat16",
    host_rate: Optional[float] = None,
) -> float:
    """Predicted seconds to move the K/V of a request of ``tokens`` tokens
    (``request_kv_bytes``) over ``link``: ``(bytes_per_s, latency_s)`` or ``"1gbit,100us"``
    (``parse_link``). ``host_rate``: bytes/s the two ends process (copies, checksum), pipelined
    with the wire (``simulation.migration_seconds``); None: the wire alone."""
    bw, lat = parse_link(link)
    nbytes = request_kv_bytes(model, tokens, kv_cache_dtype, dtype)
    return migration_seconds(nbytes, bw, lat, host_rate)


def _option(
    cfg, seq, batch, tp, pp, sp, u, kvd, dtype, r: Rates, links, usable, output_tokens, share=None
) -> Option:
    act = 4 if dtype == "float32" else 2  # activation / ring K/V bytes
    share = share or {}

    def on(axis: str) -> Rates:  # the rates with a per-node link of ``axis`` shared
        return shared_link(r, links[axis], share.get(axis, 1))

    sizes = stage_sizes(cfg, pp)
    wb = stage_weight_bytes(cfg, tp, pp, dtype)
    kvt = stage_kv_bytes_per_token(cfg, tp, pp, kvd, dtype)
    tokens_rank = batch * -(-seq // sp)  # a token's K/V lives on one SP rank
    kv_gpu = [t * tokens_rank for t in kvt]
    need = max(w + k for w, k in zip(wb, kv_gpu))
    d, h = cfg.head_dim, cfg.hidden_size
    hq, hkv = cfg.num_heads // tp, kv_heads_per_rank(cfg, tp)
    lin = layer_params(cfg, tp)["linear"]

    # prefill of one sequence, per layer on one rank
    ring = sp // u
    heads_att, kv_att = hq // u, max(1, hkv // u)
    tok = -(-seq // sp)
    t_lin = 2 * lin * tok / r.matmul
    t_attn, step, xfer, ring_bytes = ring_attention_seconds(
        seq, heads_att, kv_att, d, ring, act, on("ring"), links["ring"]
    )
    u_bytes = ulysses_bytes(HeadSplit(hq, hkv, u), tok, d, d, act) if u > 1 else 0
    t_u = message_seconds(u_bytes, links["ulysses"], on("ulysses"), 4) if u > 1 else 0.0
    tp_bytes = int(2 * 2 * (tp - 1) / tp * tok * h * act) if tp > 1 else 0
    t_tp = message_seconds(tp_bytes, links["tp"], r, 2 * 2 * (tp - 1)) if tp > 1 else 0.0
    t_layer = t_lin + t_attn + t_u + t_tp
    handoff = message_seconds(tok * h * act, links["pp"], on("pp")) if pp > 1 else 0.0
    host = r.host.get("step", 0.0) + r.host.get(
        "seq", 0.0
    )  # per step: the driver's scheduling and sampling
    stage_t = [n * (t_layer + r.host.get("layer", 0.0)) + handoff for n in sizes]
    # a sequence runs the stages one after the other; the next one enters when the slowest is free
    prefill = sum(stage_t) + (batch - 1) * max(stage_t) + host

    # decode: batch sequences at context seq; pp micro-batches in flight
    micro = -(-batch // pp)
    steps = []
    for i, n in enumerate(sizes):
        kv_bytes = micro * tokens_rank // batch * kvt[i]
        flops = 2 * micro * n * lin + 4 * micro * tok * hq * d * n
        bw = r.weight_rate(micro)  # a measured decode-matmul rate, if calibrated
        read = (wb[i] + kv_bytes) / r.memory if bw is None else wb[i] / bw + kv_bytes / r.memory
        t = max(read, flops / min(r.matmul, r.attention)) + n * r.host.get("layer", 0.0)
        if tp > 1:
            t += (
                n
                * 2
                * message_seconds(
                    int(2 * (tp - 1) / tp * micro * h * act), links["tp"], r, 2 * (tp - 1)
                )
            )
        if sp > 1:  # (out, lse) partials merged across the SP group each layer
            merge = micro * hq * (d + 1) * 4
            t += n * message_seconds(merge, links["ring"], on("ring"), math.ceil(math.log2(sp)))
        if pp > 1:
            t += message_seconds(micro * h * act, links["pp"], on("pp"))
        steps.append(t)
    step_t = pp * (max(steps) + r.host.get("step", 0.0) + r.host.get("seq", 0.0) * micro)
    decode = batch / step_t
    return Option(
        tp=tp,
        pp=pp,
        sp=sp,
        ulysses=u,
        kv_cache_dtype=kvd,
        layers_per_stage=sizes,
        kv_heads_per_gpu=hkv,
        weight_bytes_per_gpu=max(wb),
        kv_bytes_per_token_per_gpu=max(kvt),
        kv_bytes_per_gpu=max(kv_gpu),
        memory_per_gpu=usable,
        fits=need <= usable,
        ring_bytes_per_step=ring_bytes,
        ring_compute_s_per_step=step if ring > 1 else 0.0,
        ring_transfer_s_per_step=xfer,
        tp_allreduce_bytes_per_layer=tp_bytes,
        ulysses_bytes_per_layer=u_bytes,
        links=links,
        prefill_s=prefill,
        decode_tokens_per_s=decode,
        decode_step_s=step_t,
    )


def _rank(options: List[Option], cfg, seq, gpn, interconnect, output_tokens, g) -> List[Option]:
    """Seed rules as penalties, then predicted request time; one recommendation among those that
    fit."""
    weak = "nvlink" not in g["links"] or interconnect != "nvlink"

    def penalties(o: Option) -> List[str]:
        out = []
        if o.links["tp"] == "ib":
            out.append(f"TP {o.tp} crosses nodes (keep TP inside a node's fast link)")
        if weak and o.tp > WEAK_LINK_MAX_TP:
            out.append(
                f"TP {o.tp} over {interconnect} (without NVLink TP > {WEAK_LINK_MAX_TP} stops "
                "paying)"
            )
        if o.pp > SEED_MAX_PP:
            out.append(f"PP {o.pp} > {SEED_MAX_PP} (deep pipelines add bubbles)")
        if o.sp > 1 and seq < SEED_SP_TOKENS and o.fits and not _needs_sp(o, options):
            out.append(f"SP {o.sp} for {seq} tokens (< {SEED_SP_TOKENS}: SP does not pay yet)")
        if o.kv_cache_dtype != "auto":
            out.append(f"KV {o.kv_cache_dtype} (slight quality loss)")
        return out

    def cost(o: Option) -> float:  # one request's time: prefill, then output_tokens decode steps
        return o.prefill_s + output_tokens * o.decode_step_s

    for o in options:
        o.warnings = penalties(o)
    # a Ulysses split must win by more than 2% to beat the plain ring (one more collective to run)
    fit = sorted(
        (o for o in options if o.fits),
        key=lambda o: (len(o.warnings), cost(o) * (1.02 if o.ulysses > 1 else 1.0)),
    )
    nofit = sorted(
        (o for o in options if not o.fits),
        key=lambda o: o.weight_bytes_per_gpu + o.kv_bytes_per_gpu,
    )
    if fit:
        best = fit[0]
        best.recommended = True
        best.reason = "recommended: " + _why(best, seq, cfg)
        for o in fit[1:]:
            slower = cost(o) / cost(best)
            o.reason = (
                f"{'; '.join(o.warnings)}"
                if len(o.warnings) > len(best.warnings)
                else f"{slower:.2f}x the recommended time (prefill {o.prefill_s:.3g} s, "
                f"decode {o.decode_tokens_per_s:.3g} tok/s)"
            )
    for o in nofit:
        o.reason = (
            f"does not fit: weights {gb(o.weight_bytes_per_gpu)} + KV {gb(o.kv_bytes_per_gpu)} "
            f"> {gb(o.memory_per_gpu)} usable per GPU"
        )
    return fit + nofit


def _needs_sp(o: Option, options: List[Option]) -> bool:
    """True when no option without SP with the same tp fits (SP is then needed for memory)."""
    return not any(p.fits and p.sp == 1 and p.kv_cache_dtype == o.kv_cache_dtype for p in options)


def _why(o: Option, seq: int, cfg) -> str:
    parts = [f"fits ({gb(o.weight_bytes_per_gpu + o.kv_bytes_per_gpu)} of {gb(o.memory_per_gpu)})"]
    if o.tp > 1:
        parts.append(f"TP {o.tp} over {o.links['tp']}")
    if o.pp > 1:
        parts.append(f"PP {o.pp} over {o.links['pp']}")
    if o.sp > 1:
        parts.append(
            f"SP {o.sp} ({'Ulysses %d x ' % o.ulysses if o.ulysses > 1 else ''}ring over "
            f"{o.links['ring']}) for {seq} tokens"
        )
    parts.append(f"prefill {o.prefill_s:.3g} s, decode {o.decode_tokens_per_s:.3g} tok/s")
    return ", ".join(parts)
