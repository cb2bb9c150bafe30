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
  (``_step_terms`` -> ``StepTerms``, ``_step_cost``) and an event simulation of the driver and the
  stages gives the wall time (``engine_run_seconds``); ``fit_engine`` fits one thread's rates,
  host seconds and thread scaling on measured runs.

The modules, each importing only those above it in this list:

- ``catalogue``: model presets (``PRESETS``, ``ALIASES``), ``load_model``, ``model_of``,
  ``read_json``;
- ``memory``: ``DTYPES``, ``stage_sizes``, ``layer_params``, ``stage_weight_bytes``,
  ``stage_kv_bytes_per_token``, ``gb``;
- ``hardware``: the hardware table (``HARDWARE_PATH`` = ``ringkv/hardware.json``, ``load_hardware``,
  ``merge_hardware``), the rates the model prices with (``Rates``, ``rates``, ``with_threads``) and
  links given by the user (``LINK_LEVELS``, ``parse_rate``, ``parse_latency``, ``parse_link``,
  ``parse_links``);
- ``simulation``: ``ring_attention_seconds``, ``ring_backward_seconds``, ``message_seconds``,
  ``migration_seconds``, ``StepWork``, ``engine_workload``,
  ``StepTerms``, ``RingTerms``, ``_step_terms``, ``_step_cost``, ``engine_run_seconds``,
  ``_run_terms``,
  ``_simulate``, ``EngineRun``;
- ``sp_method``: ``choose_sp``, ``SPChoice``, ``sp_seconds``, ``ulysses_bytes``, ``local_rates``:
  the ring, Ulysses or USP for a model's heads on a world (``patch_model(method="auto")``);
- ``calibration``: ``FIT_KEYS``, ``fit_engine``, ``_nelder_mead``, ``RATE_KEYS``,
  ``apply_calibration``,
  ``_with``, ``fit_rates``, ``fit_keys``, ``_single_process_runs``, ``one_process_seconds``,
  ``_kind``,
  ``_fit_attention``, ``_parse_config``;
- ``options``: ``Option``, ``plan``, ``request_kv_bytes``, ``migration_time``, ``_option``,
  ``_rank``, ``_needs_sp``, ``_why``, ``_divisors``, ``_positive_int``, ``_link``, the seed
  constants (``SEED_SP_TOKENS``, ``SEED_MAX_PP``,
  ``WEAK_LINK_MAX_TP``);
- ``report``: ``format_table``, ``plot``, ``_svg``;
- ``hybrid`` (beside the others, importing ``sp`` and ``hf``): a hybrid model's recurrent layers as
  ``patch_model`` splits them (``recurrent_layers``, ``hybrid_plan``, ``format_hybrid``), what
  ``ringkv plan`` prints for a model the engine does not serve yet.

The public names are re-exported here (``ringkv.planner.X``); the private helpers (a leading
underscore) stay in their module. The formulas, the hardware table with its sources and the
validation are in docs/plan.md.
"""

from .catalogue import ALIASES, PRESETS, load_model
from .memory import (
    DTYPES,
    layer_params,
    stage_kv_bytes_per_token,
    stage_sizes,
    stage_weight_bytes,
)
from .hardware import (
    HARDWARE_PATH,
    LINK_LEVELS,
    Rates,
    load_hardware,
    parse_latency,
    parse_link,
    parse_links,
    parse_rate,
    rates,
)
from .simulation import (
    EngineRun,
    RingTerms,
    StepTerms,
    StepWork,
    engine_run_seconds,
    engine_workload,
    migration_seconds,
    ring_attention_seconds,
    ring_backward_seconds,
)
from .sp_method import SPChoice, choose_sp, local_rates, sp_seconds, ulysses_bytes
from .calibration import (
    FIT_KEYS,
    RATE_KEYS,
    apply_calibration,
    fit_engine,
    fit_keys,
    fit_rates,
    one_process_seconds,
)
from .options import (
    SEED_MAX_PP,
    SEED_SP_TOKENS,
    WEAK_LINK_MAX_TP,
    Option,
    migration_time,
    plan,
    request_kv_bytes,
)
from .report import format_table, plot

__all__ = [
    "ALIASES",
    "PRESETS",
    "load_model",
    "DTYPES",
    "layer_params",
    "stage_kv_bytes_per_token",
    "stage_sizes",
    "stage_weight_bytes",
    "HARDWARE_PATH",
    "LINK_LEVELS",
    "Rates",
    "load_hardware",
    "parse_latency",
    "parse_link",
    "parse_links",
    "parse_rate",
    "rates",
    "EngineRun",
    "RingTerms",
    "StepTerms",
    "StepWork",
    "engine_run_seconds",
    "engine_workload",
    "migration_seconds",
    "ring_attention_seconds",
    "ring_backward_seconds",
    "SPChoice",
    "choose_sp",
    "local_rates",
    "sp_seconds",
    "ulysses_bytes",
    "FIT_KEYS",
    "RATE_KEYS",
    "apply_calibration",
    "fit_engine",
    "fit_keys",
    "fit_rates",
    "one_process_seconds",
    "SEED_MAX_PP",
    "SEED_SP_TOKENS",
    "WEAK_LINK_MAX_TP",
    "Option",
    "migration_time",
    "plan",
    "request_kv_bytes",
    "format_table",
    "plot",
]
