"""``/metrics`` of both fronts, on ``prometheus_client``.

- **Counts.** The async engine keeps its counters and histograms on its thread (``Metrics``),
  with the rates a peer pull's cost model reads (EWMAs of the link, its set-up and the prefill).
- **Families.** ``ENGINE_METRICS`` names an instance's metrics once (name, type, help, value);
  ``RouterCollector`` a router's (``ROUTER_PER_INSTANCE``: one sample per instance).
- **Registries.** Each front registers its collector in a registry of its own (``registry``),
  not the process's default one: several apps may live in one process (the tests'), and the
  values are read from the engine or the router when ``/metrics`` is asked (``exposition``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from .policy import InstanceState

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# seconds between a request's tokens (each sample's, a step apart)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0)
EWMA = 0.3  # weight of the newest measurement of the link and prefill rates
PULL_OUTCOMES = ("pull", "recompute", "failed")


@dataclass
class Buckets:
    """A histogram's counts: ``counts[i]``, observations <= ``bounds[i]``; their ``sum`` and
    ``count``."""

    bounds: Sequence[float]
    counts: List[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self):
        self.counts = self.counts or [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, b in enumerate(self.bounds):
            if value <= b:
                self.counts[i] += 1


@dataclass
class Metrics:
    """An instance's counts, kept on its engine's thread (read by ``/metrics`` and the cost
    model of a peer pull)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: Dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    ttft: Buckets = field(default_factory=lambda: Buckets(TTFT_BUCKETS))
    itl: Buckets = field(default_factory=lambda: Buckets(ITL_BUCKETS))  # inter-token latency
    migrations_in: int = 0
    migrations_out: int = 0
    rejected: int = 0  # 429s (max_waiting)
    recent: deque = field(default_factory=deque)  # (time, tokens) of the last steps, for tokens/s
    # peer pull: hints by outcome (PULL_OUTCOMES), what came in, what went out to pullers
    pulls: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(PULL_OUTCOMES, 0))
    pulled_tokens: int = 0  # prompt tokens this instance holds more thanks to pulls
    pulled_bytes: int = 0
    shared: int = 0  # prefixes sent to pulling peers
    shared_bytes: int = 0
    pull_error: Optional[str] = None  # why the last failed pull failed
    link_rate: Optional[float] = None  # bytes/s of pulls and migrations (EWMA); None: unmeasured
    link_setup: Optional[float] = None  # seconds before a pull's first byte (EWMA): ask, join
    prefill_rate: Optional[float] = None  # uncached prompt tokens / TTFT (EWMA), tokens/s
    kv_bytes_per_token: Optional[float] = None  # of a pulled prefix (measured)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_link(self, nbytes: int, seconds: float) -> None:
        """A transfer of ``nbytes`` took ``seconds``: the link rate's EWMA."""
        if nbytes > 0 and seconds > 0:
            self.link_rate = _ewma(self.link_rate, nbytes / seconds)

    def observe_setup(self, seconds: float) -> None:
        """A pull's holder was asked and its link joined after ``seconds``."""
        self.link_setup = _ewma(self.link_setup, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A request's ``tokens`` uncached prompt tokens gave its first token after ``seconds``."""
        if tokens > 0 and seconds > 0:
            self.prefill_rate = _ewma(self.prefill_rate, tokens / seconds)


def _ewma(old: Optional[float], new: float) -> float:
    return new if old is None else (1 - EWMA) * old + EWMA * new


# -- the exposition -----------------------------------------------------------------------------
class Family(NamedTuple):
    """One metric of an instance: ``value(engine)`` is its value (``family``)."""

    name: str
    kind: str  # counter (its name ends in _total), gauge or histogram
    help: str
    value: Callable
    label: Optional[str] = None


KINDS = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}


def family(kind: str, name: str, help: str, value, label: Optional[str] = None):
    """A ``prometheus_client`` metric family of ``kind``: ``value`` is a number, or
    ``{label value: number}`` (``label``), or (a histogram) ``Buckets``."""
    if kind == "histogram":
        buckets = [(floatToGoString(b), n) for b, n in zip(value.bounds, value.counts)]
        buckets.append(("+Inf", value.count))
        return HistogramMetricFamily(name, help, buckets=buckets, sum_value=value.sum)
    if label is None:
        return KINDS[kind](name, help, value=value)
    out = KINDS[kind](name, help, labels=[label])
    for k, v in value.items():
        out.add_metric([k], v)
    return out


def hit_rate(g: dict) -> float:
    return g["hits"] / g["queries"] if g["queries"] else 0.0


ENGINE_METRICS = (
    Family(
        "ringkv_requests_running",
        "gauge",
        "Requests being computed.",
        lambda e: e.gauges["running"],
    ),
    Family(
        "ringkv_requests_waiting",
        "gauge",
        "Requests waiting to be admitted.",
        lambda e: e.gauges["waiting"],
    ),
    Family(
        "ringkv_kv_cache_usage_ratio",
        "gauge",
        "Fraction of KV cache blocks held by requests.",
        lambda e: e.gauges["kv_usage"],
    ),
    Family(
        "ringkv_prefix_cache_hit_rate",
        "gauge",
        "Prompt blocks served from the prefix cache / blocks looked up.",
        lambda e: hit_rate(e.gauges),
    ),
    Family(
        "ringkv_prefix_cache_hits_total",
        "counter",
        "Prompt blocks served from the prefix cache.",
        lambda e: e.gauges["hits"],
    ),
    Family(
        "ringkv_prefix_cache_queries_total",
        "counter",
        "Prompt blocks looked up in the prefix cache.",
        lambda e: e.gauges["queries"],
    ),
    Family(
        "ringkv_prompt_tokens_total",
        "counter",
        "Prompt tokens of admitted requests.",
        lambda e: e.metrics.prompt_tokens,
    ),
    Family(
        "ringkv_generation_tokens_total",
        "counter",
        "Tokens generated.",
        lambda e: e.metrics.generation_tokens,
    ),
    Family(
        "ringkv_generation_tokens_per_second",
        "gauge",
        "Tokens generated per second over the last 10 s.",
        lambda e: e.tokens_per_second(),
    ),
    Family(
        "ringkv_requests_finished_total",
        "counter",
        "Finished requests by reason.",
        lambda e: dict(sorted(e.metrics.finished.items())),
        "reason",
    ),
    Family(
        "ringkv_time_to_first_token_seconds",
        "histogram",
        "Time from admission to the first token.",
        lambda e: e.metrics.ttft,
    ),
    Family(
        "ringkv_inter_token_latency_seconds",
        "histogram",
        "Time between a request's tokens (a sample's next token after its last).",
        lambda e: e.metrics.itl,
    ),
    Family(
        "ringkv_kv_pull_decisions_total",
        "counter",
        "Pull hints by outcome: pull, recompute (nothing to gain, or prefilling is faster),"
        " failed (the pull failed; the request recomputed).",
        lambda e: {o: e.metrics.pulls[o] for o in PULL_OUTCOMES},
        "outcome",
    ),
    Family(
        "ringkv_kv_pulled_tokens_total",
        "counter",
        "Prompt tokens held more thanks to peer pulls.",
        lambda e: e.metrics.pulled_tokens,
    ),
    Family(
        "ringkv_kv_pulled_bytes_total",
        "counter",
        "K/V bytes received from peers.",
        lambda e: e.metrics.pulled_bytes,
    ),
    Family(
        "ringkv_kv_shared_total",
        "counter",
        "Cached prefixes sent to pulling peers.",
        lambda e: e.metrics.shared,
    ),
    Family(
        "ringkv_kv_shared_bytes_total",
        "counter",
        "K/V bytes sent to pulling peers.",
        lambda e: e.metrics.shared_bytes,
    ),
    Family(
        "ringkv_kv_link_bytes_per_second",
        "gauge",
        "Measured link rate of pulls and migrations (EWMA; 0: unmeasured).",
        lambda e: e.metrics.link_rate or 0.0,
    ),
    Family(
        "ringkv_kv_link_setup_seconds",
        "gauge",
        "Measured time a pull takes before its first byte (asking the holder, joining its"
        " link; EWMA; 0: unmeasured).",
        lambda e: e.metrics.link_setup or 0.0,
    ),
    Family(
        "ringkv_kv_prefill_tokens_per_second",
        "gauge",
        "Measured prefill rate: uncached prompt tokens / TTFT (EWMA; 0: unmeasured).",
        lambda e: e.metrics.prefill_rate or 0.0,
    ),
)


def tier_rows(info: dict) -> Dict[str, tuple]:
    """The prefix cache's tiers (``kv_cache_info()["tiers"]``): ``{tier: (blocks, bytes,
    capacity bytes)}`` of the device pool, the host-memory tier and the disk tier (a tier that
    is off: absent)."""
    tiers = info.get("tiers") or {}
    device = tiers.get("device")
    rows = {}
    if device is not None:
        # a logical block: block_size tokens on each rank (every rank's layers and KV heads)
        ranks = info.get("per_rank") or []
        per_block = sum(r.get("bytes_per_token", 0) for r in ranks) * info.get("block_size", 0)
        per_block = per_block or info.get("bytes_per_token", 0) * info.get("tokens_per_block", 0)
        rows["device"] = (
            device.get("blocks", 0),
            device.get("blocks", 0) * per_block,
            device.get("capacity", 0) * per_block,
        )
    for name in ("host", "disk"):
        t = tiers.get(name)
        if t is not None:
            rows[name] = (t.get("blocks", 0), t.get("bytes", 0), t.get("capacity_bytes", 0))
    return rows


def tier_families(info: dict) -> Iterator:
    """Blocks, bytes and capacity of each tier of the prefix cache; the device's cached blocks
    and promotions (with a device tier)."""
    rows = tier_rows(info)
    for i, (metric, help) in enumerate(
        (
            ("blocks", "KV blocks held in each tier of the prefix cache."),
            ("bytes", "KV bytes held in each tier of the prefix cache."),
            ("capacity_bytes", "KV bytes each tier of the prefix cache can hold."),
        )
    ):
        values = {t: row[i] for t, row in rows.items()}
        yield family("gauge", f"ringkv_kv_tier_{metric}", help, values, "tier")
    device = (info.get("tiers") or {}).get("device")
    if device is not None:
        yield GaugeMetricFamily(
            "ringkv_kv_device_cached_blocks",
            "Prefix-cache blocks registered on the device.",
            value=device.get("cached", 0),
        )
        yield CounterMetricFamily(
            "ringkv_kv_promotions_total",
            "Blocks brought back to the device from the tiers.",
            value=device.get("promotions", 0),
        )


class EngineCollector:
    """An instance's metrics (``ENGINE_METRICS`` and its tiers), read from its ``AsyncEngine``."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self) -> Iterator:
        for f in ENGINE_METRICS:
            yield family(f.kind, f.name, f.help, f.value(self.engine), f.label)
        yield from tier_families(self.engine.info)


# the router's per-instance metrics: name (a counter's ends in _total), type, what its value is
# (``instance_value``), help
ROUTER_PER_INSTANCE = """
instance_up gauge up 1 if the instance is up.
requests_running gauge running Requests the instance computes.
requests_waiting gauge waiting Requests waiting in the instance.
requests_inflight gauge inflight Sub-requests the router streams from the instance.
kv_cache_usage_ratio gauge kv_usage Fraction of the instance's KV blocks in use.
cached_blocks gauge blocks Prefix blocks (any tier) the router's index holds for the instance.
requests counter requests Sub-requests sent to the instance.
prompt_tokens counter prompt_tokens Prompt tokens of requests the instance finished.
prefix_hit_tokens counter cached_tokens Prompt tokens the instance served from its prefix cache.
migrations_in counter migrations_in Requests migrated to the instance.
migrations_out counter migrations_out Requests migrated off the instance.
failovers counter failovers Streams of the instance that broke and went on elsewhere.
pull_hints counter pull_hints Sub-requests sent there with a pull hint (a peer holds more).
"""


ROUTER_COUNTERS = {  # the router's own counters (Router.counters)
    "migrations": "Requests the router moved between instances.",
    "migration_failures": "Moves that failed (the request ran on where it was).",
    "auto_migrations": "Moves the load policy made.",
    "requests": "Client requests.",
    "failed_requests": "Client requests that ended with an error.",
}


def instance_value(inst, key: str) -> float:
    """An instance's value of ``ROUTER_PER_INSTANCE``'s ``key``, as the router sees it."""
    if key == "up":
        return int(inst.state == InstanceState.UP)
    if key == "kv_usage":
        return float(inst.load.get("kv_usage", 0.0))
    if key in ("inflight", "blocks"):
        return inst.inflight if key == "inflight" else len(inst.blocks)
    return inst.counters[key] if key in inst.counters else inst.load.get(key, 0)


class RouterCollector:
    """A router's metrics: each instance's (``ROUTER_PER_INSTANCE``, its index's blocks per
    tier), the router's settings and its own counters."""

    def __init__(self, router):
        self.router = router

    def collect(self) -> Iterator:
        r = self.router
        families = {}
        for row in ROUTER_PER_INSTANCE.strip().splitlines():  # name, type, its value's key, help
            name, kind, key, help = row.split(maxsplit=3)
            values = {i.id: instance_value(i, key) for i in r.instances}
            f = family(kind, f"ringkv_router_{name}", help, values, "instance")
            families[f.name] = f
        # the router's own counters (requests: its per-instance family's unlabelled sample)
        for k, v in r.counters.items():
            name = f"ringkv_router_{k}"
            if name not in families:
                families[name] = CounterMetricFamily(name, ROUTER_COUNTERS[k])
            f = families[name]
            f.add_metric([], v)
        yield from families.values()
        tiers = GaugeMetricFamily(
            "ringkv_router_tier_blocks",
            "Prefix blocks the router's index holds for the instance, per tier.",
            labels=["instance", "tier"],
        )
        for i in r.instances:
            for t, n in i.tier_blocks().items():
                tiers.add_metric([i.id, t], n)
        yield tiers
        for name, help, value in (
            ("kv_pull", "1 if instances are told where to pull cached prefixes.", r.kv_pull),
            ("auto_migration", "1 if load-balancing migration is on.", r.migration),
            ("migration_threshold", "The load gap that moves a request.", r.threshold),
        ):
            yield GaugeMetricFamily(f"ringkv_router_{name}", help, value=float(value))


def registry(collector) -> CollectorRegistry:
    """A registry of its own for one front's ``collector`` (not the process's default)."""
    out = CollectorRegistry(auto_describe=False)
    out.register(collector)
    return out


def exposition(reg: CollectorRegistry) -> str:
    """The Prometheus text of ``reg``."""
    return generate_latest(reg).decode()
