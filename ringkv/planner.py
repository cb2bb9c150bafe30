"""``ringkv.plan``: choose TP/PP/SP (and the KV cache dtype) for a model, a context length and a
cluster. Pure computation: nothing here communicates or allocates a model.

Every configuration ``tp x pp x sp = gpus`` the engine accepts (and Ulysses x ring splits of
``sp`` where the heads allow) becomes an ``Option`` with what each GPU holds and how fast it
runs. Memory uses the engine's own formulas (``EngineShape.bytes_per_token``, ``stage_sizes``,
``kv_heads_per_rank``), so the planner and ``LLM.kv_cache_info()`` cannot drift. Time is a
roofline model over the hardware table ``hardware.json`` (peak x efficiency, or rates measured
by ringkv's benchmarks via ``calibrate``):

- prefill, per layer and rank: linear layers ``2 x params_rank x tokens / matmul rate``; ring
  attention ``R`` steps of ``compute = causal FLOPs / R^2 / attention rate`` overlapped with the
  K/V block's transfer, ``max(compute, transfer)`` per step plus the fp32 (out, lse) merge
  (memory bound); Ulysses all-to-alls and the two TP all-reduces are not overlapped; PP runs
  the stages one after the other for a sequence (``sum of stages + (batch - 1) x slowest``);
- decode (memory bound): a step reads each stage's weights once per micro-batch and the K/V
  of the context, ``max(bytes / bandwidth, FLOPs / rate)`` (the weights at a measured
  decode-matmul rate by rows, ``Rates.gemm``, when calibrated with one), plus per-layer
  collectives (latency + bytes / bandwidth) and the host seconds of a step (``hardware.json``
  "host": per step, per sequence, per layer);
- a whole engine run (``EngineRun``: what ``benchmarks/engine.py`` measures): the engine's own
  scheduler replays the requests (``engine_workload``), each step is priced as above
  (``_step_cost``) and an event simulation of the driver and the stages gives the wall time
  (``engine_run_seconds``); ``fit_engine`` fits one thread's rates, host seconds and thread scaling
  on measured runs.

The formulas, the hardware table with its sources and the validation are in docs/plan.md.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

import torch

from .kernels import quant
from .model.config import ModelConfig
from .parallel.tp import check_tp, kv_heads_per_rank
from .parallel.worker import EngineShape

HARDWARE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hardware.json")
DTYPES = {"float32": (torch.float32, 4), "bfloat16": (torch.bfloat16, 2), "float16": (torch.float16, 2),
          "fp8": (torch.bfloat16, 1)}  # fp8: FP8 weights and matmuls, bf16 activations and K/V
SEED_SP_TOKENS = 32768  # seed rule 4: consider SP beyond 32K tokens
SEED_MAX_PP = 4  # seed rule 2: PP depth usually <= 4
WEAK_LINK_MAX_TP = 2  # seed (consumer cards): without NVLink TP=2 is the most that still pays


def _llama(layers, hidden, heads, kv_heads, inter, vocab, tied, **kw):
    return dict(model_type=kw.pop("model_type", "llama"), num_hidden_layers=layers, hidden_size=hidden,
                num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=inter,
                vocab_size=vocab, tie_word_embeddings=tied, **kw)


# name -> the fields of the model's HF config.json that the planner reads (sources: docs/plan.md)
PRESETS: Dict[str, Dict[str, Any]] = {
    "llama-3-8b": _llama(32, 4096, 32, 8, 14336, 128256, False),  # meta-llama/Meta-Llama-3-8B
    "llama-3-70b": _llama(80, 8192, 64, 8, 28672, 128256, False),  # meta-llama/Meta-Llama-3-70B
    "llama-3.1-405b": _llama(126, 16384, 128, 8, 53248, 128256, False),  # meta-llama/Llama-3.1-405B
    "qwen2.5-7b": _llama(28, 3584, 28, 4, 18944, 152064, False, model_type="qwen2"),  # Qwen/Qwen2.5-7B
    "mistral-7b": _llama(32, 4096, 32, 8, 14336, 32000, False, model_type="mistral"),  # Mistral-7B-v0.1
    "smollm2-135m": _llama(30, 576, 9, 3, 1536, 49152, True),  # HuggingFaceTB/SmolLM2-135M
    # random models of ringkv's own benchmarks (benchmarks/models.py), for calibration and validation
    "llama-120m": _llama(12, 768, 12, 4, 2048, 32000, False),
    "tiny-long": _llama(4, 256, 4, 2, 512, 1024, False),
}
ALIASES = {"smollm2": "smollm2-135m", "smollm2-135m-instruct": "smollm2-135m", "llama-3.1-8b": "llama-3-8b",
           "llama-3.1-70b": "llama-3-70b", "llama-3-405b": "llama-3.1-405b"}


# -- inputs --------------------------------------------------------------------------------------
def load_model(model) -> ModelConfig:
    """A ``ModelConfig`` from a preset name, an HF directory or ``config.json`` path, a config
    dict, a transformers config/model, or a ``ModelConfig``."""
    if isinstance(model, ModelConfig):
        return model
    if hasattr(model, "config") and hasattr(model.config, "to_dict"):
        model = model.config
    if hasattr(model, "to_dict"):
        model = model.to_dict()
    if isinstance(model, dict):
        return ModelConfig.from_hf(model)
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a preset name, a path or a config dict, got {type(model).__name__}")
    name = ALIASES.get(str(model).lower(), str(model).lower())
    if name in PRESETS:
        return ModelConfig.from_hf(PRESETS[name])
    path = os.path.join(model, "config.json") if os.path.isdir(model) else str(model)
    if not os.path.isfile(path):
        raise ValueError(f"unknown model {str(model)!r}: not a preset ({', '.join(PRESETS)}) nor a directory "
                         f"or config.json file")
    return ModelConfig.from_hf(_read_json(path, "model config"))


def load_hardware(path: Optional[str] = None) -> dict:
    """The hardware table (``ringkv/hardware.json``), with the entries of ``path`` merged over it."""
    table = _read_json(HARDWARE_PATH, "hardware table")
    if path is None:
        return table
    extra = _read_json(path, "hardware file")
    if not isinstance(extra, dict):
        raise ValueError(f"hardware file {path!r} must hold a JSON object like ringkv/hardware.json")
    return _merge(table, extra)


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@dataclass
class Rates:
    """Achievable rates of one device (on a CPU: one thread): FLOP/s of linear layers and of
    attention, memory bytes/s, per link bytes/s (one direction) and latency (s), host seconds
    per engine step (``step``, ``seq``: per sequence, ``layer``: per layer). A process with
    ``t`` threads computes and reads memory at ``t ** thread_scaling`` times these rates.
    ``gemm``: measured bytes/s at which a process of ``threads`` streams the weights through
    decode matmuls of ``rows`` tokens, ``{threads: {rows: bytes/s}}`` (``benchmarks/decode_gemm.py``);
    where it has the process's thread count, a step's weights are read at that rate (linear in
    rows between the measured ones, the nearest outside) instead of ``memory``."""
    matmul: float
    attention: float
    memory: float
    links: Dict[str, float]
    latency: Dict[str, float]
    source: str = "hardware table x efficiency"
    host: Dict[str, float] = field(default_factory=dict)
    thread_scaling: float = 1.0
    gemm: Dict[str, Dict[str, float]] = field(default_factory=dict)
    threads: int = 1  # the process's threads (``_threads``): selects the ``gemm`` row

    def weight_rate(self, rows: float) -> Optional[float]:
        """Measured weight bytes/s at ``rows`` for this process's threads, or None."""
        table = self.gemm.get(str(self.threads))
        if not table:
            return None
        pts = sorted((float(k), float(v)) for k, v in table.items())
        if rows <= pts[0][0]:
            return pts[0][1]
        for (r0, b0), (r1, b1) in zip(pts, pts[1:]):
            if rows <= r1:
                return b0 + (b1 - b0) * (rows - r0) / (r1 - r0)
        return pts[-1][1]


def rates(hw: dict, gpu: str, dtype: str = "bfloat16") -> Rates:
    """Peak x efficiency for ``gpu`` from the hardware table ``hw``."""
    g = hw["gpus"][gpu]
    eff = dict(hw["efficiency"], **g.get("efficiency", {}))
    flops = g["flops"]
    if dtype not in flops:
        raise ValueError(f"{gpu} has no {dtype} peak in the hardware table; choose dtype in {sorted(flops)}")
    attn_dtype = "float32" if dtype == "float32" else "bfloat16"
    return Rates(matmul=flops[dtype] * eff["matmul"], attention=flops[attn_dtype] * eff["attention"],
                 memory=g["mem_bw"] * eff["memory"], links={k: v * eff["link"] for k, v in g["links"].items()},
                 latency={k: hw["links"].get(k, {}).get("latency", 0.0) for k in g["links"]},
                 host={k: float(v) for k, v in dict(hw.get("host", {}), **g.get("host", {})).items()
                       if not k.startswith("_")})


# -- memory: the engine's formulas ----------------------------------------------------------------
def stage_sizes(cfg: ModelConfig, pp: int) -> List[int]:
    """Layers per PP stage, exactly as the engine splits them (decode-balanced, LM head counted)."""
    return EngineShape(pp=pp).stage_sizes(cfg)


def layer_params(cfg: ModelConfig, tp: int) -> Dict[str, int]:
    """Parameters of one decoder layer on a TP rank: ``linear`` (the matmul weights a token
    multiplies) and ``total`` (with norms and biases). Split as ``apply_tp`` splits them."""
    d, h = cfg.head_dim, cfg.hidden_size
    hq, hkv, inter = cfg.num_heads // tp, kv_heads_per_rank(cfg, tp), -(-cfg.intermediate_size // tp)
    linear = h * hq * d + 2 * h * hkv * d + hq * d * h + 3 * h * inter
    bias = (hq * d + 2 * hkv * d if cfg.qkv_bias else 0) + (h if cfg.o_bias else 0) + \
        (2 * inter + h if cfg.mlp_bias else 0)
    return dict(linear=linear, total=linear + bias + 2 * h)


def stage_weight_bytes(cfg: ModelConfig, tp: int, pp: int, dtype: str = "bfloat16") -> List[int]:
    """Weight bytes of one rank of each PP stage (the engine's ``per_rank[i]["weight_bytes"]``):
    its layers' TP slices, the vocabulary slice of the embedding on the first stage and of the
    LM head on the last (one tensor when tied on a single stage), the final norm."""
    check_tp(cfg, tp)
    sizes, h = stage_sizes(cfg, pp), cfg.hidden_size
    vocab = -(-cfg.vocab_size // tp)
    per_layer = layer_params(cfg, tp)["total"]
    out = []
    for i, n in enumerate(sizes):
        first, last = i == 0, i == len(sizes) - 1
        params = n * per_layer + (vocab * h if first else 0)
        if last:
            params += h + (0 if cfg.tie_word_embeddings and first else vocab * h)
        out.append(params * DTYPES[dtype][1])
    return out


def stage_kv_bytes_per_token(cfg: ModelConfig, tp: int, pp: int, kv_cache_dtype: str = "auto",
                             dtype: str = "bfloat16") -> List[int]:
    """K/V bytes of one token on a rank of each stage: ``EngineShape.bytes_per_token``, the
    seed's ``2 x layers_on_stage x kv_heads_on_rank x head_dim x bytes`` (+ quantization scales)."""
    shape = EngineShape(pp=pp, tp=tp, kv_cache_dtype=kv_cache_dtype)
    return [shape.bytes_per_token(cfg, s, DTYPES[dtype][0]) for s in range(pp)]


# -- the option ------------------------------------------------------------------------------------
@dataclass
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


def plan(model, seq: int, *, batch: int = 1, gpus: int, gpu: str = "h100", interconnect: str = "nvlink",
         nodes: Optional[int] = None, kv_cache_dtype: Union[str, Sequence[str]] = "auto",
         dtype: str = "bfloat16", hardware: Union[None, str, dict] = None, calibrate=None,
         gpu_memory_utilization: float = 0.9, output_tokens: int = 256, ulysses: bool = True) -> List[Option]:
    """Every valid ``(tp, pp, sp[, ulysses])`` for ``gpus`` GPUs, best first; exactly one
    ``recommended`` among those that fit (none when nothing fits; each option's ``reason`` says why).

    ``model``: preset name (``PRESETS``), HF directory / config.json, config dict or ModelConfig.
    ``seq``: tokens per sequence (prompt + output), ``batch``: sequences held and decoded together.
    ``gpu``: a key of the hardware table; ``interconnect``: the link inside a node (``nvlink``,
    ``pcie``; ``ib``: one GPU per node); ``nodes``: how many nodes hold the GPUs (links between
    nodes are ``ib``). ``kv_cache_dtype``: one or several of ``auto``, ``int8``, ``fp8``...
    ``dtype``: weights/activations (``fp8``: FP8 weights and matmuls, bf16 K/V).
    ``hardware``: a file or dict merged over the table; ``calibrate``: benchmark JSON paths or a
    rates dict (see ``calibrate``) replacing the table's rates. ``output_tokens``: decode length
    used to rank options (prefill + that many decode steps)."""
    cfg = load_model(model)
    seq, batch, gpus = _positive_int("seq", seq), _positive_int("batch", batch), _positive_int("gpus", gpus)
    hw = load_hardware(hardware) if not isinstance(hardware, dict) else _merge(load_hardware(), hardware)
    if gpu not in hw["gpus"]:
        raise ValueError(f"unknown gpu {gpu!r}; choose one of {', '.join(hw['gpus'])} (or add it with --hardware)")
    g = hw["gpus"][gpu]
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    have = list(g["links"])
    if interconnect not in have:
        raise ValueError(f"{gpu} has no {interconnect!r} link in the hardware table; choose interconnect in {have}")
    if nodes is None:
        nodes = gpus if interconnect == "ib" else max(1, -(-gpus // g["gpus_per_node"]))
    nodes = _positive_int("nodes", nodes)
    if gpus % nodes:
        raise ValueError(f"nodes={nodes} does not divide gpus={gpus}; give gpus as nodes x GPUs per node")
    if nodes > 1 and "ib" not in have:
        raise ValueError(f"{gpu} has no 'ib' link for {nodes} nodes in the hardware table; add it with --hardware")
    gpn = gpus // nodes
    if gpn > g["gpus_per_node"]:
        raise ValueError(f"{gpn} GPUs per node exceed the {g['gpus_per_node']} a {gpu} node holds; give --nodes")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    kv_dtypes = [kv_cache_dtype] if isinstance(kv_cache_dtype, str) else list(kv_cache_dtype)
    for k in kv_dtypes:
        quant.resolve(k)  # ValueError naming the choices
    r = rates(hw, gpu, dtype)
    if calibrate is not None:
        r = apply_calibration(r, calibrate)
    intra = interconnect
    usable = int(g["memory"] * gpu_memory_utilization)

    options = []
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
                for kvd in kv_dtypes:
                    links = dict(tp=_link(tp, tp, gpn, intra),
                                 ulysses=_link(u, tp * u, gpn, intra),
                                 ring=_link(sp // u, tp * sp, gpn, intra),
                                 pp=_link(pp, gpus, gpn, intra))
                    options.append(_option(cfg, seq, batch, tp, pp, sp, u, kvd, dtype, r, links, usable,
                                           output_tokens))
    if not options:
        raise ValueError(f"no (tp, pp, sp) with tp x pp x sp = {gpus} suits this model "
                         f"({cfg.num_heads} heads, {cfg.num_kv_heads} KV heads, {cfg.num_layers} layers)")
    return _rank(options, cfg, seq, gpn, interconnect, output_tokens, g)


def _option(cfg, seq, batch, tp, pp, sp, u, kvd, dtype, r: Rates, links, usable, output_tokens) -> Option:
    act = 4 if dtype == "float32" else 2  # activation / ring K/V bytes
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
    t_attn, step, xfer, ring_bytes = ring_attention_seconds(seq, heads_att, kv_att, d, ring, act, r, links["ring"])
    u_bytes = int((u - 1) / u * tok * d * act * (2 * hq + 2 * max(hkv, u))) if u > 1 else 0
    t_u = _xfer(u_bytes, links["ulysses"], r, 4) if u > 1 else 0.0
    tp_bytes = int(2 * 2 * (tp - 1) / tp * tok * h * act) if tp > 1 else 0
    t_tp = _xfer(tp_bytes, links["tp"], r, 2 * 2 * (tp - 1)) if tp > 1 else 0.0
    t_layer = t_lin + t_attn + t_u + t_tp
    handoff = _xfer(tok * h * act, links["pp"], r) if pp > 1 else 0.0
    host = r.host.get("step", 0.0) + r.host.get("seq", 0.0)  # per step: the driver's scheduling and sampling
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
            t += n * 2 * _xfer(int(2 * (tp - 1) / tp * micro * h * act), links["tp"], r, 2 * (tp - 1))
        if sp > 1:  # (out, lse) partials merged across the SP group each layer
            t += n * _xfer(micro * hq * (d + 1) * 4, links["ring"], r, math.ceil(math.log2(sp)))
        if pp > 1:
            t += _xfer(micro * h * act, links["pp"], r)
        steps.append(t)
    step_t = pp * (max(steps) + r.host.get("step", 0.0) + r.host.get("seq", 0.0) * micro)
    decode = batch / step_t
    return Option(tp=tp, pp=pp, sp=sp, ulysses=u, kv_cache_dtype=kvd, layers_per_stage=sizes,
                  kv_heads_per_gpu=hkv, weight_bytes_per_gpu=max(wb), kv_bytes_per_token_per_gpu=max(kvt),
                  kv_bytes_per_gpu=max(kv_gpu), memory_per_gpu=usable, fits=need <= usable,
                  ring_bytes_per_step=ring_bytes, ring_compute_s_per_step=step if ring > 1 else 0.0,
                  ring_transfer_s_per_step=xfer, tp_allreduce_bytes_per_layer=tp_bytes,
                  ulysses_bytes_per_layer=u_bytes, links=links, prefill_s=prefill, decode_tokens_per_s=decode,
                  decode_step_s=step_t)


def ring_attention_seconds(seq: int, heads: int, kv_heads: int, head_dim: int, ring: int, act_bytes: int,
                           r: Rates, link: str, causal: bool = True):
    """One rank's forward ring attention over ``ring`` ranks (balanced layout): ``(total s, compute
    s per step, transfer s per step, K/V bytes per step)``. Step 0 computes the local block; each
    of the ``ring - 1`` others takes ``max(compute, transfer)`` (the next hop is in flight while a
    block computes) plus the fp32 (out, lse) merge, which reads and writes the accumulator."""
    flops = 4 * head_dim * heads * seq * seq / ring * (0.5 if causal else 1.0)  # this rank's pairs x 4 D
    step = flops / ring / r.attention
    nbytes = 2 * -(-seq // ring) * kv_heads * head_dim * act_bytes if ring > 1 else 0
    xfer = _xfer(nbytes, link, r) if ring > 1 else 0.0
    merge = -(-seq // ring) * heads * (head_dim + 1) * (8 + act_bytes) / r.memory
    return step + (ring - 1) * (max(step, xfer) + merge), (step if ring > 1 else 0.0), xfer, nbytes


def _xfer(nbytes: float, link: str, r: Rates, messages: int = 1) -> float:
    return messages * r.latency.get(link, 0.0) + nbytes / r.links[link]


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def _rank(options: List[Option], cfg, seq, gpn, interconnect, output_tokens, g) -> List[Option]:
    """Seed rules as penalties, then predicted request time; one recommendation among those that fit."""
    weak = "nvlink" not in g["links"] or interconnect != "nvlink"

    def penalties(o: Option) -> List[str]:
        out = []
        if o.links["tp"] == "ib":
            out.append(f"TP {o.tp} crosses nodes (keep TP inside a node's fast link)")
        if weak and o.tp > WEAK_LINK_MAX_TP:
            out.append(f"TP {o.tp} over {interconnect} (without NVLink TP > {WEAK_LINK_MAX_TP} stops paying)")
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
    fit = sorted((o for o in options if o.fits),
                 key=lambda o: (len(o.warnings), cost(o) * (1.02 if o.ulysses > 1 else 1.0)))
    nofit = sorted((o for o in options if not o.fits), key=lambda o: o.weight_bytes_per_gpu + o.kv_bytes_per_gpu)
    if fit:
        best = fit[0]
        best.recommended = True
        best.reason = "recommended: " + _why(best, seq, cfg)
        for o in fit[1:]:
            slower = cost(o) / cost(best)
            o.reason = (f"{'; '.join(o.warnings)}" if len(o.warnings) > len(best.warnings) else
                        f"{slower:.2f}x the recommended time (prefill {o.prefill_s:.3g} s, "
                        f"decode {o.decode_tokens_per_s:.3g} tok/s)")
    for o in nofit:
        o.reason = (f"does not fit: weights {_gb(o.weight_bytes_per_gpu)} + KV {_gb(o.kv_bytes_per_gpu)} "
                    f"> {_gb(o.memory_per_gpu)} usable per GPU")
    return fit + nofit


def _needs_sp(o: Option, options: List[Option]) -> bool:
    """True when no option without SP with the same tp fits (SP is then needed for memory)."""
    return not any(p.fits and p.sp == 1 and p.kv_cache_dtype == o.kv_cache_dtype for p in options)


def _why(o: Option, seq: int, cfg) -> str:
    parts = [f"fits ({_gb(o.weight_bytes_per_gpu + o.kv_bytes_per_gpu)} of {_gb(o.memory_per_gpu)})"]
    if o.tp > 1:
        parts.append(f"TP {o.tp} over {o.links['tp']}")
    if o.pp > 1:
        parts.append(f"PP {o.pp} over {o.links['pp']}")
    if o.sp > 1:
        parts.append(f"SP {o.sp} ({'Ulysses %d x ' % o.ulysses if o.ulysses > 1 else ''}ring over "
                     f"{o.links['ring']}) for {seq} tokens")
    parts.append(f"prefill {o.prefill_s:.3g} s, decode {o.decode_tokens_per_s:.3g} tok/s")
    return ", ".join(parts)


# -- the engine's workload: what a benchmark run schedules, step by step ------------------------------
@dataclass
class StepWork:
    """One engine step as the scheduler built it (what its cost depends on)."""
    seqs: int  # sequences in the step
    tokens: int  # tokens computed (prompt chunks + one per decoding sequence)
    completing: int  # sequences whose last token is computed: LM head rows, sampled tokens
    pairs: int  # causal (query, key) pairs of attention: sum of n x (start + (n + 1) / 2)
    kv_tokens: int  # K/V token slots the batched paged attention reads: seqs x longest context
    longest: int  # the largest chunk (sp > 1: ring mode from sp_prefill_min_tokens on)


def engine_workload(prompts, max_tokens: int, num_blocks: int, *, pp: int = 1, sp: int = 1, block_size: int = 16,
                    max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, prefix_caching: bool = True):
    """The steps ``LLM.generate`` runs for ``prompts`` (token-id lists, or lengths: distinct ids)
    with ``max_tokens`` output tokens each (EOS ignored) on a cache of ``num_blocks`` blocks:
    the engine's own ``Scheduler`` and ``BlockManager`` driven as ``LLM._advance`` drives them
    (``pp`` steps in flight, each with its share of the sequences; chunked prefill; preemption
    by recompute with prefix-cache hits). Returns ``(steps, events)``: a ``StepWork`` per step
    and the driver's order of ``("submit", k)`` / ``("complete", k)``."""
    from collections import deque

    from .cache.block_manager import BlockManager
    from .engine.params import SamplingParams
    from .engine.scheduler import Scheduler
    from .engine.sequence import Sequence

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, seed=0)
    blocks = BlockManager(num_blocks, block_size * sp, enable_prefix_caching=prefix_caching)
    sched = Scheduler(blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    for i, p in enumerate(prompts):
        ids = list(range(10_000_000 * (i + 1), 10_000_000 * (i + 1) + p)) if isinstance(p, int) else list(p)
        sched.add(Sequence(i, None, ids, params))
    steps, events, inflight = [], [], deque()
    fresh = 10 ** 12
    while sched.has_work() or inflight:
        share = -(-(len(sched.running) + len(sched.waiting)) // pp)
        while len(inflight) < pp:
            busy = {s.seq for _, b in inflight for s in b}
            batch = sched.schedule(busy, max_seqs=share if pp > 1 else None)
            if not batch:
                break
            for s in batch:
                s.seq.num_computed = s.start + s.n
            ends = [s.start + s.n for s in batch]
            steps.append(StepWork(seqs=len(batch), tokens=sum(s.n for s in batch),
                                  completing=sum(s.completes for s in batch),
                                  pairs=sum(s.n * s.start + s.n * (s.n + 1) // 2 for s in batch),
                                  kv_tokens=len(batch) * max(ends), longest=max(s.n for s in batch)))
            events.append(("submit", len(steps) - 1))
            inflight.append((len(steps) - 1, batch))
        if not inflight:
            raise RuntimeError("the scheduler made no progress (a sequence larger than the cache?)")
        k, batch = inflight.popleft()
        events.append(("complete", k))
        for s in batch:
            blocks.register(s.seq.block_table, s.seq.token_ids, s.start + s.n, None, s.seq.prefix_cursor)
        for s in batch:
            if s.completes and not s.seq.finished:
                fresh += 1
                s.seq.token_ids.append(fresh)
                if s.seq.num_tokens - len(s.seq.prompt_token_ids) >= max_tokens:
                    s.seq.finish("length")
                    sched.finish(s.seq)
    return steps, events


def _step_terms(cfg: ModelConfig, w: StepWork, *, tp: int, pp: int, sp: int, stage: int, dtype: str,
                sp_prefill_min_tokens: int) -> tuple:
    """What step ``w`` asks of one rank of ``stage``, independent of the rates: ``(layers,
    bytes, linear FLOPs, attention FLOPs, ring, messages, weight bytes, rows)`` (``bytes``
    includes the weights). ``ring``: ``(tokens, heads, kv_heads,
    head_dim, layers x pairs / ring pairs)`` when the step runs the SP ring, else None;
    ``messages``: ``(bytes sent in all, message count)`` of its collectives and hand-offs."""
    act = DTYPES[dtype][1] if dtype != "fp8" else 2
    n = stage_sizes(cfg, pp)[stage]
    first, last = stage == 0, stage == pp - 1
    d, h = cfg.head_dim, cfg.hidden_size
    hq, hkv = cfg.num_heads // tp, kv_heads_per_rank(cfg, tp)
    lin = layer_params(cfg, tp)
    vocab = -(-cfg.vocab_size // tp)
    ring = sp > 1 and w.longest >= sp_prefill_min_tokens  # else replicated: every SP rank computes all tokens
    rows = w.tokens / sp if ring else w.tokens
    flops = 2 * n * lin["linear"] * rows + (2 * vocab * h * w.completing if last else 0)
    wbytes = (n * lin["total"] + (vocab * h if last and w.completing else 0)) * act
    nbytes = wbytes + n * w.kv_tokens / sp * 2 * hkv * d * act  # + the K/V a rank stores, read by the paged kernel
    msgs = []
    if ring:
        ring_terms, attn = (w.tokens, hq, hkv, d, sp, act, n * w.pairs / max(1, w.tokens * (w.tokens + 1) // 2)), 0.0
    else:
        ring_terms, attn = None, n * 4 * hq * d * w.pairs / sp
        if sp > 1:  # (out, lse) partials merged over the SP group each layer
            msgs.append((n * w.tokens * hq * (d + 1) * 4, n * math.ceil(math.log2(sp))))
    if tp > 1:  # two all-reduces per layer (+ the vocab-parallel embedding), the vocabulary gather
        count = 2 * n + first  # ring all-reduces: 2 (tp - 1) messages, 2 (tp - 1) / tp of the tensor sent
        msgs.append((count * 2 * (tp - 1) / tp * rows * h * act, count * 2 * (tp - 1)))
        if last and w.completing:
            msgs.append(((tp - 1) * vocab * w.completing * act, tp - 1))
    if pp > 1 and not last:
        msgs.append((rows * h * act, 1))
    return n, nbytes, flops, attn, ring_terms, msgs, wbytes, rows


def _step_cost(terms: tuple, r: Rates, link: str) -> float:
    """Seconds of one rank's share of a step: ``layers x host["layer"] + max(bytes / memory,
    linear FLOPs / matmul) + attention FLOPs / attention`` (or the ring), plus its messages; with
    a measured ``gemm`` rate the weights' share of ``bytes`` is read at it."""
    n, nbytes, flops, attn, ring, msgs, wbytes, rows = terms
    bw = r.weight_rate(rows)
    read = nbytes / r.memory if bw is None else (nbytes - wbytes) / r.memory + wbytes / bw
    t = n * r.host.get("layer", 0.0) + max(read, flops / r.matmul) + attn / r.attention
    if ring is not None:  # one ring per layer over the step's tokens (scaled to its causal pairs)
        tokens, hq, hkv, d, sp, act, scale = ring
        t += scale * ring_attention_seconds(tokens, hq, hkv, d, sp, act, r, link)[0]
    for nb, count in msgs:
        t += count * r.latency.get(link, 0.0) + nb / r.links[link]
    return t


def engine_run_seconds(cfg: ModelConfig, steps, events, r: Rates, *, tp: int = 1, pp: int = 1, sp: int = 1,
                       dtype: str = "float32", sp_prefill_min_tokens: int = 64, link: Optional[str] = None) -> float:
    """Wall time of the steps of ``engine_workload`` run by a ``tp x pp x sp`` engine whose ranks
    have rates ``r``. The driver (rank 0, also stage 0) spends ``host["step"] + host["seq"] x
    seqs`` per step (schedule, step plan, publish, sample, append), then runs stage 0; stage ``i``
    starts a step once it is free and stage ``i - 1`` has handed it over (``_step_cost``); a
    step completes when its last stage is done; the driver plans the next steps after
    completing the oldest one in flight (``pp`` in flight). TP and SP ranks of a stage run in
    lockstep (their collectives are in the step cost)."""
    terms = _run_terms(cfg, steps, tp, pp, sp, dtype, sp_prefill_min_tokens)
    return _simulate(steps, events, terms, r, link or next(iter(r.links)))


def _run_terms(cfg, steps, tp, pp, sp, dtype="float32", sp_prefill_min_tokens=64) -> list:
    """``_step_terms`` of every step (rows) and stage (columns)."""
    return [[_step_terms(cfg, w, tp=tp, pp=pp, sp=sp, stage=i, dtype=dtype, sp_prefill_min_tokens=sp_prefill_min_tokens)
             for i in range(pp)] for w in steps]


def _simulate(steps, events, terms, r: Rates, link: str) -> float:
    """The event simulation of ``engine_run_seconds`` over precomputed ``_step_terms``."""
    step_s, seq_s = r.host.get("step", 0.0), r.host.get("seq", 0.0)
    pp = len(terms[0]) if terms else 1
    t0, free, end = 0.0, [0.0] * pp, {}
    for kind, k in events:
        if kind == "submit":
            t0 += step_s + seq_s * steps[k].seqs
            start = t0
            for i in range(pp):
                free[i] = max(start, free[i]) + _step_cost(terms[k][i], r, link)
                start = free[i]
            t0, end[k] = free[0], free[-1]
        else:
            t0 = max(t0, end[k])
    return t0


@dataclass
class EngineRun:
    """A measured engine run: its model, requests (token-id lists or prompt lengths), output
    tokens per request, cache blocks, wall seconds, mesh, torch threads per rank and scheduler
    limits; ``seconds(r)`` is the model's time for it with one thread's rates ``r`` (the
    workload and step terms are computed once)."""
    cfg: ModelConfig
    prompts: list
    max_tokens: int
    num_blocks: int
    measured_s: float
    tp: int = 1
    pp: int = 1
    sp: int = 1
    threads: int = 1
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    label: str = ""
    _cache: Any = field(default=None, repr=False)

    def seconds(self, r: Rates) -> float:
        if self._cache is None:
            steps, events = engine_workload(self.prompts, self.max_tokens, self.num_blocks, pp=self.pp, sp=self.sp,
                                            max_num_seqs=self.max_num_seqs,
                                            max_num_batched_tokens=self.max_num_batched_tokens)
            self._cache = steps, events, _run_terms(self.cfg, steps, self.tp, self.pp, self.sp)
        steps, events, terms = self._cache
        return _simulate(steps, events, terms, _threads(r, self.threads), next(iter(r.links)))


FIT_KEYS = ("matmul", "memory", "attention", "step", "seq", "layer", "thread_scaling")


def fit_engine(runs: Sequence[EngineRun], r: Rates, keys: Sequence[str] = ("matmul", "memory", "step", "seq",
                                                                           "layer")) -> Rates:
    """``r`` with ``keys`` (one thread's rates: matmul, memory, attention; host seconds: step,
    seq, layer; ``thread_scaling``, which needs runs with different thread counts) chosen to
    minimise the squared log error of ``runs``' modelled times (Nelder-Mead over the
    logarithms; the other fields stay). Never fit on the run being predicted."""
    bad = [k for k in keys if k not in FIT_KEYS]
    if bad or not runs:
        raise ValueError(f"fit_engine needs runs and keys among {FIT_KEYS}, got {list(keys)}")
    start = dict(matmul=r.matmul, memory=r.memory, attention=r.attention, step=r.host.get("step") or 1e-3,
                 seq=r.host.get("seq") or 1e-4, layer=r.host.get("layer") or 1e-4, thread_scaling=r.thread_scaling)

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


def _nelder_mead(f, x0: List[float], step: float = 0.7, iters: int = 400, tol: float = 1e-9) -> List[float]:
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


# -- calibration: rates measured by ringkv's benchmarks ---------------------------------------------
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


def _read_json(path, what: str = "calibration file"):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {what} {path!r}: {e}") from None


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
    docs = [(p, d, _kind(p, d)) for p, d in ((p, _read_json(p)) for p in paths)]
    out, used, runs = copy.deepcopy(r), [], []
    for p, d, kind in sorted(docs, key=lambda t: order[t[2]]):  # stable: the given order within a kind
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


def fit_keys(runs: Sequence["EngineRun"]) -> tuple:
    """What ``runs`` can tell ``fit_engine``: matmul; memory and host seconds given multi-step
    (engine) runs; ``thread_scaling`` given runs on different thread counts."""
    keys = ("matmul", "memory", "step", "seq", "layer") if any(x.max_tokens > 1 for x in runs) else ("matmul",)
    return keys + (("thread_scaling",) if len({x.threads for x in runs}) > 1 else ())


def _threads(r: Rates, t: int) -> Rates:
    """The rates of a process with ``t`` threads from one thread's ``r``: compute and memory times
    ``t ** thread_scaling``; the ``gemm`` row of ``t`` threads."""
    k = t ** r.thread_scaling
    return dataclasses.replace(r, matmul=r.matmul * k, memory=r.memory * k, attention=r.attention * k, threads=t)


def _single_process_runs(d: dict) -> List[EngineRun]:
    """``EngineRun``s of the one-process runs in a ``long_prefill.py`` (its ``--sweep`` too) or
    ``engine.py`` JSON."""
    out = []
    if d.get("kind") in ("prefill", "sweep"):
        for row in d["rows"]:
            if row.get("sp", 1) == 1:
                seq = row["seq"]
                out.append(EngineRun(_model_of(row.get("model", d.get("model"))), [seq], 1, seq // 16 + 8,
                                     one_process_seconds(row), threads=row.get("threads") or d.get("cores") or 1,
                                     max_num_seqs=1,
                                     max_num_batched_tokens=row.get("chunk") or seq,
                                     label=f"{row.get('model')} {seq} sp=1"))
        return out
    cfg = _model_of(d["model"])
    for row in d["rows"]:
        n, total = row["requests"], row["prompt_tokens"]
        prompts = [total // n + (i < total % n) for i in range(n)]
        out.append(EngineRun(cfg, prompts, d["max_tokens"], row["base_capacity_tokens"] // 16,
                             row["output_tokens"] / row["base_tok_s"], threads=row.get("base_threads", d["cores"]),
                             max_num_seqs=n, label=f"{n} requests, one process"))
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
    raise ValueError(f"{path!r} is not a rates file nor the JSON of long_ctx.py, long_prefill.py or engine.py")


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
        raise ValueError("long_ctx JSON has no causal zigzag/striped row to fit the attention rate from")
    return sorted(vals)[len(vals) // 2]


def _model_of(name: str) -> ModelConfig:
    name = str(name)
    if "{" in name:  # engine.py writes "random llama-120m ({config})"
        return ModelConfig.from_hf(dict(json.loads(name[name.index("{"):name.rindex("}") + 1]), model_type="llama"))
    return load_model(name)


def _parse_config(s: str) -> Dict[str, int]:
    return {k: int(v) for k, v in (kv.split("=") for kv in s.split())}


# -- output ---------------------------------------------------------------------------------------
def format_table(options: List[Option]) -> str:
    """One row per option, the recommended one marked ``*``."""
    head = f"{'':1s} {'tp':>3s} {'pp':>3s} {'sp':>4s} {'uly':>3s} {'kv':>8s} {'weights/GPU':>11s} " \
           f"{'KV B/tok/GPU':>12s} {'KV/GPU':>9s} {'fits':>4s} {'ring B/step':>11s} {'TP AR B/layer':>13s} " \
           f"{'prefill':>9s} {'decode tok/s':>12s}  reason"
    lines = [head]
    for o in options:
        lines.append(f"{'*' if o.recommended else ' '} {o.tp:3d} {o.pp:3d} {o.sp:4d} {o.ulysses:3d} "
                     f"{o.kv_cache_dtype:>8s} {_gb(o.weight_bytes_per_gpu):>11s} {o.kv_bytes_per_token_per_gpu:12,d} "
                     f"{_gb(o.kv_bytes_per_gpu):>9s} {'yes' if o.fits else 'no':>4s} {o.ring_bytes_per_step:11.3g} "
                     f"{o.tp_allreduce_bytes_per_layer:13.3g} {o.prefill_s:8.3g}s {o.decode_tokens_per_s:12.3g}  "
                     f"{o.reason}")
    return "\n".join(lines)


def plot(options: List[Option], path: str, title: str = "") -> None:
    """Prefill time against decode tokens/s of every option (matplotlib; a plain SVG without it)."""
    pts = [(o.prefill_s, o.decode_tokens_per_s, f"tp{o.tp} pp{o.pp} sp{o.sp}" + (f" u{o.ulysses}" if o.ulysses > 1
                                                                                    else ""), o) for o in options]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _svg(pts, path, title)
    fig, ax = plt.subplots(figsize=(8, 5))
    for x, y, label, o in pts:
        style = dict(marker="*", s=200, c="tab:red") if o.recommended else \
            dict(marker="o", c="tab:blue") if o.fits else dict(marker="x", c="tab:gray")
        ax.scatter([x], [y], **style)
        ax.annotate(label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted prefill (s)")
    ax.set_ylabel("predicted decode (tokens/s)")
    ax.set_title(title or "ringkv plan: * recommended, o fits, x does not fit", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _svg(pts, path: str, title: str) -> None:
    w, h, m = 640, 400, 50
    xs = [math.log10(max(p[0], 1e-12)) for p in pts]
    ys = [math.log10(max(p[1], 1e-12)) for p in pts]
    x0, x1, y0, y1 = min(xs), max(xs) + 1e-9, min(ys), max(ys) + 1e-9
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-size="9">',
           f'<text x="{m}" y="20">{title or "ringkv plan (log-log): prefill s (x) vs decode tok/s (y)"}</text>']
    for (px, py, label, o), lx, ly in zip(pts, xs, ys):
        cx = m + (lx - x0) / (x1 - x0) * (w - 2 * m)
        cy = h - m - (ly - y0) / (y1 - y0) * (h - 2 * m)
        color = "red" if o.recommended else "blue" if o.fits else "gray"
        out.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="4" fill="{color}"/>'
                   f'<text x="{cx + 5:.1f}" y="{cy - 5:.1f}">{label}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out))
