"""The engine serving a hybrid model against a dense one of the same width and depth: decode
throughput, memory per sequence, TTFT cold vs. a prefix hit, and the prefix-cache hit rate of a
shared-prompt workload.

    python benchmarks/hybrid_engine.py --json results/hybrid_engine.json
    python benchmarks/hybrid_engine.py --family lfm2      # or bamba: another hybrid

Both models have random weights (relative cost only, never text quality), float32, built in this
process from transformers configs of one shape (default: hidden 1024, intermediate 3072, 8 layers,
8 attention heads, 2 KV heads, head_dim 128, vocabulary 32000, untied LM head):

- hybrid (``--family``): ``--ratio`` recurrent layers per attention layer (default 3: ``lin lin
  lin attn`` twice). ``qwen3_5``: Qwen3.5-text gated DeltaNet, ``--linear-key-heads`` 8 and
  ``--linear-value-heads`` 16 of ``--linear-head-dim`` 128 (Qwen3-Next's 1:2 ratio), conv kernel
  4. ``lfm2``: LFM2 short convolutions (kernel 3). ``bamba``: Mamba2, expand 2, heads of
  ``--linear-head-dim``, one group, state ``--state-dim`` 128, conv 4. LFM2 and Bamba attention
  heads are ``hidden / heads`` wide.
- dense: Qwen3 of the same hidden / intermediate / layers / heads / head_dim / vocabulary.

One engine per model (``block_size`` 16, ``max_num_batched_tokens`` 2048, ``max_num_seqs``
``--seqs``, ``kv_cache_memory`` ``--kv-mib``, the hybrid's ``state_checkpoint_blocks``
``--checkpoint-blocks``, default auto), warmed by an unrelated prompt (256 tokens), then in this
order (random token prompts, the same for both models; distinct phases never share a prefix):

1. TTFT: a ``--ttft-prompt`` (4096) token prompt with ``max_tokens=1``, the whole ``generate``
   call timed: ``cold`` (nothing of it cached), then ``hit`` (the same prompt again, its first run
   finished: served from the prefix cache; ``cached`` = its ``num_cached_tokens``: the dense
   model's whole blocks but the last token, the hybrid's deepest state checkpoint). ``hit/cold``:
   the goal is <= 0.2. ``--reps`` (3) repetitions (a fresh prompt each): medians.
2. Shared prefix: ``--shared-requests`` (16) prompts of one ``--system`` (2048) token prefix and
   distinct tails of ``--tail`` (64-256) tokens, 4 output tokens each; the first alone (it fills
   the cache), then the rest at once. ``hit rate`` = cached prompt tokens / prompt tokens over all
   of them (goal: hybrid within 5% of dense); ``saved`` / ``restored``: state snapshots the phase
   saved and resumed from (``kv_cache_info()["state"]``).
3. Decode: ``--seqs`` (16) prompts of ``--prompt`` (512) tokens, ``--decode-tokens`` (64) new
   tokens each, greedy, ``ignore_eos``, driven by ``LLM.step``. ``decode tok/s`` = tokens
   generated after the step at which every sequence had its first token, divided by the wall time
   from that step's end to the last step's end (pure decode steps of all ``--seqs`` rows);
   ``step ms`` = that time / those steps; ``to first`` = seconds from the requests' arrival to that
   step (chunked prefill of every prompt).

Memory per sequence at 4K / 16K / 64K tokens, from ``kv_cache_info()``: dense ``bytes_per_token x
tokens``; hybrid ``bytes_per_token x tokens + state bytes_per_sequence`` (its attention layers'
K/V plus one float32 recurrent state); ``ratio`` = hybrid / dense. Nothing is run at those sizes.

``--sp-prefill N`` measures only the hybrid's SP prefill instead: the cold TTFT of a
``--ttft-prompt`` token prompt (``max_tokens=4``, medians over ``--reps`` fresh prompts) on an
``sp=N`` engine whose long chunks are spread over the SP ranks (``sp_prefill_min_tokens`` 64:
zigzag rows, ring attention, state passing), on the same mesh computing every chunk on every SP
rank (``sp_prefill_min_tokens`` above the prompt: the replicated prefill), and on one process
(``sp=1``); the greedy tokens of the three must agree.

Ratios compare hybrid and dense within this run. Load averages before and after are printed:
other processes on the cores change every timing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

from benchmarks.models import load_average, machine, machine_line, write_json  # noqa: E402

FAMILIES = ("qwen3_5", "lfm2", "bamba")
CONTEXTS = (4096, 16384, 65536)
MIB = 1 << 20
TTFT_GOAL = 0.2  # hit TTFT / cold TTFT
HIT_RATE_GAP = 0.05  # hybrid's hit rate within 5% of dense's


def _common(a) -> dict:
    return dict(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        max_position_embeddings=max(CONTEXTS),
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )


def attention_layers(a) -> list:
    """Indices of the attention layers: the last of every ``ratio + 1``."""
    return [i for i in range(a.layers) if i % (a.ratio + 1) == a.ratio]


def hybrid_config(a):
    import transformers

    attn = attention_layers(a)
    if a.family == "qwen3_5":
        kinds = ["full_attention" if i in attn else "linear_attention" for i in range(a.layers)]
        return transformers.Qwen3_5TextConfig(
            **_common(a),
            head_dim=a.head_dim,
            layer_types=kinds,
            linear_num_key_heads=a.linear_key_heads,
            linear_num_value_heads=a.linear_value_heads,
            linear_key_head_dim=a.linear_head_dim,
            linear_value_head_dim=a.linear_head_dim,
            linear_conv_kernel_dim=4,
        )
    if a.family == "lfm2":
        kinds = ["full_attention" if i in attn else "conv" for i in range(a.layers)]
        return transformers.Lfm2Config(
            **_common(a), layer_types=kinds, conv_L_cache=3, block_auto_adjust_ff_dim=False
        )
    return transformers.BambaConfig(  # bamba
        **_common(a),
        attn_layer_indices=attn,
        mamba_expand=2,
        mamba_d_head=a.linear_head_dim,
        mamba_n_heads=2 * a.hidden // a.linear_head_dim,
        mamba_n_groups=1,
        mamba_d_state=a.state_dim,
        mamba_d_conv=4,
    )


def dense_config(a):
    import transformers

    # LFM2's and Bamba's attention heads are hidden / heads wide
    head_dim = a.head_dim if a.family == "qwen3_5" else a.hidden // a.heads
    return transformers.Qwen3Config(**_common(a), head_dim=head_dim)


def build(cfg, seed: int = 0):
    import torch
    import transformers

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def tokens(rng: random.Random, n: int, vocab: int) -> list:
    return [rng.randrange(3, vocab) for _ in range(n)]


def timed_generate(llm, prompts, max_tokens: int):
    from ringkv import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t, outs


def state_counts(llm) -> dict:
    s = llm.kv_cache_info()["state"]
    return dict(saved=s["saved"], restored=s["restored"]) if s else dict(saved=0, restored=0)


def ttft(llm, a, rng) -> dict:
    """Cold and hit TTFT of ``--ttft-prompt`` tokens (medians over ``--reps`` fresh prompts)."""
    cold, hit, cached = [], [], []
    for _ in range(a.reps):
        prompt = tokens(rng, a.ttft_prompt, a.vocab)
        cold.append(timed_generate(llm, [prompt], 1)[0])
        seconds, (out,) = timed_generate(llm, [prompt], 1)
        hit.append(seconds)
        cached.append(out.num_cached_tokens)
    c, h = statistics.median(cold), statistics.median(hit)
    return dict(prompt=a.ttft_prompt, cold_s=c, hit_s=h, hit_over_cold=h / c, cached=min(cached))


def shared_prefix(llm, a, rng) -> dict:
    """The shared-system-prompt workload: the first request alone, then the rest at once."""
    system = tokens(rng, a.system, a.vocab)
    prompts = [
        system + tokens(rng, rng.randint(*a.tail), a.vocab) for _ in range(a.shared_requests)
    ]
    before = state_counts(llm)
    t = time.perf_counter()
    outs = timed_generate(llm, prompts[:1], 4)[1] + timed_generate(llm, prompts[1:], 4)[1]
    seconds = time.perf_counter() - t
    after = state_counts(llm)
    cached = sum(o.num_cached_tokens for o in outs)
    total = sum(len(p) for p in prompts)
    return dict(
        requests=len(prompts),
        prompt_tokens=total,
        cached_tokens=cached,
        hit_rate=cached / total,
        cached_per_request=[o.num_cached_tokens for o in outs],
        seconds=seconds,
        **{k: after[k] - before[k] for k in after},
    )


def decode(llm, a, rng) -> dict:
    """``--seqs`` prompts through ``LLM.step``: tok/s of the steps after every sequence has its
    first token."""
    from ringkv import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=a.decode_tokens, ignore_eos=True)
    prompts = [tokens(rng, a.prompt, a.vocab) for _ in range(a.seqs)]
    t_start = time.perf_counter()
    for p in prompts:
        llm.add_request(p, params)
    got, t0, base, steps = {}, None, 0, 0
    while llm.has_unfinished_requests():
        for out in llm.step():
            got[out.request_id] = len(out.token_ids)
        if t0 is None:
            if len(got) == a.seqs and min(got.values()) >= 1:
                t0, base = time.perf_counter(), sum(got.values())
        else:
            steps += 1
    t1 = time.perf_counter()
    generated = sum(got.values()) - base
    return dict(
        seqs=a.seqs,
        prompt=a.prompt,
        new_tokens=a.decode_tokens,
        to_first_s=t0 - t_start,
        decode_s=t1 - t0,
        decode_steps=steps,
        decode_tokens=generated,
        tok_s=generated / (t1 - t0),
        step_ms=1000 * (t1 - t0) / max(steps, 1),
    )


def memory(info: dict) -> dict:
    """Bytes per sequence at each of ``CONTEXTS`` tokens, from ``kv_cache_info()``."""
    state = info["state"]["bytes_per_sequence"] if info["state"] else 0
    return {n: info["bytes_per_token"] * n + state for n in CONTEXTS}


def engine_settings(a, hybrid: bool) -> dict:
    kw = dict(
        block_size=16,
        max_num_batched_tokens=2048,
        max_num_seqs=a.seqs,
        kv_cache_memory=int(a.kv_mib * MIB),
    )
    if hybrid:
        kw["state_checkpoint_blocks"] = a.checkpoint_blocks
    return kw


def measure(model, a, hybrid: bool) -> dict:
    """Every measurement of one model on one engine (the prompts: seeded, the same per model)."""
    from ringkv import LLM

    with LLM(model, **engine_settings(a, hybrid)) as llm:
        # warm-up: kernels built and self-checked (ringkv/kernels/native.py), first-call costs
        timed_generate(llm, [tokens(random.Random(-1), min(256, a.prompt), a.vocab)], 2)
        info = llm.kv_cache_info()
        out = dict(
            params=sum(p.numel() for p in model.parameters()),
            bytes_per_token=info["bytes_per_token"],
            state_bytes_per_sequence=info["state"]["bytes_per_sequence"] if hybrid else 0,
            checkpoint_blocks=info["state"]["checkpoint_blocks"] if hybrid else None,
            num_blocks=info["num_blocks"],
            memory=memory(info),
            ttft=ttft(llm, a, random.Random(1)),
            shared=shared_prefix(llm, a, random.Random(2)),
            decode=decode(llm, a, random.Random(3)),
        )
        out["preemptions"] = llm.num_preemptions
    return out


def sp_prefill(model, a) -> dict:
    """Cold TTFT of the hybrid at ``sp=1``, and at ``sp=--sp-prefill`` replicated and spread."""
    from ringkv import LLM

    runs = dict(
        one=dict(sp=1),
        replicated=dict(sp=a.sp_prefill, sp_prefill_min_tokens=1 << 30),
        spread=dict(sp=a.sp_prefill, sp_prefill_min_tokens=64),
    )
    out, tokens_of = {}, {}
    for name, mesh in runs.items():
        with LLM(model, **engine_settings(a, True), **mesh) as llm:
            timed_generate(llm, [tokens(random.Random(-1), 256, a.vocab)], 2)  # warm-up
            rng, seconds, got = random.Random(1), [], []
            for _ in range(a.reps):
                t, (o,) = timed_generate(llm, [tokens(rng, a.ttft_prompt, a.vocab)], 4)
                seconds.append(t)
                got.append(o.token_ids)
        out[name] = dict(mesh, cold_s=statistics.median(seconds))
        tokens_of[name] = got
    out["same_tokens"] = len({repr(t) for t in tokens_of.values()}) == 1
    out["spread_over_replicated"] = out["spread"]["cold_s"] / out["replicated"]["cold_s"]
    return out


def summary(r: dict) -> dict:
    h, d = r["models"]["hybrid"], r["models"]["dense"]
    return dict(
        decode_vs_dense=h["decode"]["tok_s"] / d["decode"]["tok_s"],
        memory_ratio={n: h["memory"][n] / d["memory"][n] for n in CONTEXTS},
        ttft_hit_over_cold=h["ttft"]["hit_over_cold"],
        ttft_goal_met=h["ttft"]["hit_over_cold"] <= TTFT_GOAL,
        hit_rate_vs_dense=h["shared"]["hit_rate"] / d["shared"]["hit_rate"],
        hit_rate_goal_met=h["shared"]["hit_rate"] >= (1 - HIT_RATE_GAP) * d["shared"]["hit_rate"],
    )


def _rows(header: list, rows: list) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")
    print()


def print_tables(r: dict) -> None:
    m, s, a = r["models"], r["summary"], r["args"]
    names = dict(hybrid=f"hybrid {a['family']}", dense="dense qwen3")
    print(machine_line(r["machine"]))
    print(f"{r['title']}; load {r['load'][0]} before, {r['load'][1]} after; {r['seconds']:.0f} s\n")
    print(f"Decode, {a['seqs']} sequences x {a['prompt']} prompt tokens, {a['decode_tokens']} new")
    _rows(
        ["model", "params", "to first s", "decode steps", "step ms", "decode tok/s", "vs dense"]
        + ["preemptions"],
        [
            [names[k], f"{v['params'] / 1e6:.1f}M", f"{v['decode']['to_first_s']:.2f}"]
            + [v["decode"]["decode_steps"], f"{v['decode']['step_ms']:.1f}"]
            + [
                f"{v['decode']['tok_s']:.1f}",
                f"{v['decode']['tok_s'] / m['dense']['decode']['tok_s']:.2f}",
                v["preemptions"],
            ]
            for k, v in m.items()
        ],
    )
    h, d = m["hybrid"], m["dense"]
    print(
        f"Memory per sequence: hybrid K/V {h['bytes_per_token'] / 1024:.1f} KiB/token + state "
        f"{h['state_bytes_per_sequence'] / MIB:.2f} MiB (checkpoint every "
        f"{h['checkpoint_blocks']} blocks); dense K/V {d['bytes_per_token'] / 1024:.1f} KiB/token"
    )
    _rows(
        ["tokens", "dense MiB", "hybrid MiB", "hybrid/dense"],
        [
            [n, f"{d['memory'][n] / MIB:.1f}", f"{h['memory'][n] / MIB:.1f}"]
            + [f"{s['memory_ratio'][n]:.3f}"]
            for n in CONTEXTS
        ],
    )
    print(
        f"TTFT of a {a['ttft_prompt']}-token prompt, median of {a['reps']} "
        f"(goal: hit/cold <= {TTFT_GOAL})"
    )
    _rows(
        ["model", "cold s", "hit s", "hit/cold", "cached tokens"],
        [
            [names[k], f"{v['ttft']['cold_s']:.3f}", f"{v['ttft']['hit_s']:.3f}"]
            + [f"{v['ttft']['hit_over_cold']:.3f}", v["ttft"]["cached"]]
            for k, v in m.items()
        ],
    )
    print(
        f"Shared prefix: {a['shared_requests']} requests, {a['system']}-token system prompt + "
        f"{a['tail'][0]}-{a['tail'][1]}-token tails (goal: hybrid hit rate >= "
        f"{1 - HIT_RATE_GAP:.2f} x dense's; now {s['hit_rate_vs_dense']:.3f})"
    )
    _rows(
        ["model", "prompt tokens", "cached tokens", "hit rate", "saved", "restored", "seconds"],
        [
            [names[k], v["shared"]["prompt_tokens"], v["shared"]["cached_tokens"]]
            + [f"{v['shared']['hit_rate']:.3f}", v["shared"]["saved"], v["shared"]["restored"]]
            + [f"{v['shared']['seconds']:.2f}"]
            for k, v in m.items()
        ],
    )


def describe(cfg) -> str:
    keys = dict(hidden="hidden_size", layers="num_hidden_layers", vocab="vocab_size")
    return f"{cfg.model_type} (" + " ".join(f"{k} {getattr(cfg, v)}" for k, v in keys.items()) + ")"


def parse(argv):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--family", choices=FAMILIES, default="qwen3_5")
    for name, default in [
        ("hidden", 1024), ("intermediate", 3072), ("layers", 8), ("vocab", 32000), ("heads", 8),
        ("kv-heads", 2), ("head-dim", 128), ("ratio", 3), ("linear-key-heads", 8),
        ("linear-value-heads", 16), ("linear-head-dim", 128), ("state-dim", 128), ("seqs", 16),
        ("prompt", 512), ("decode-tokens", 64), ("ttft-prompt", 4096), ("reps", 3),
        ("system", 2048), ("shared-requests", 16),
    ]:  # fmt: skip
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--tail", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--checkpoint-blocks", type=int, default=None, help="default: auto")
    ap.add_argument("--kv-mib", type=float, default=1024, help="kv_cache_memory in MiB")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--sp-prefill", type=int, default=0, help="measure SP prefill only (see above)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.decode_tokens < 2:
        ap.error("--decode-tokens must be >= 2 (the first token ends the prefill)")
    return a


def main(argv=None) -> int:
    import torch

    a = parse(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    load_before, t = load_average(), time.perf_counter()
    if a.sp_prefill:
        r = dict(args=vars(a), title=describe(hybrid_config(a)), machine=machine())
        r["sp_prefill"] = sp_prefill(build(hybrid_config(a)), a)
        r.update(seconds=time.perf_counter() - t, load=[load_before, load_average()])
        print(json.dumps(r["sp_prefill"], indent=1), "\nload", r["load"], r["machine"])
        if a.json:
            write_json(a.json, r)
        return 0
    cfgs = dict(hybrid=hybrid_config(a), dense=dense_config(a))
    models = {k: measure(build(cfg), a, k == "hybrid") for k, cfg in cfgs.items()}
    r = dict(
        args=vars(a),
        title=f"{describe(cfgs['hybrid'])} vs {describe(cfgs['dense'])}, random weights, float32",
        machine=machine(),
        models=models,
        seconds=time.perf_counter() - t,
        load=[load_before, load_average()],
    )
    r["summary"] = summary(r)
    print_tables(r)
    if a.json:
        write_json(a.json, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
