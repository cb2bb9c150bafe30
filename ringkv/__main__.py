"""Command line.

    ringkv generate --model PATH --prompt "..." [--max-tokens N] [--tp/--pp/--sp N] ...
    ringkv serve --model PATH [--tp/--pp/--sp N] [--host 127.0.0.1] [--port 8000] ...
    ringkv serve --model PATH --replicas N [--routing kv] ...   # a front and N instances here
    ringkv router --upstream URL [--upstream URL ...] [--port 8000]   # a front over instances
    ringkv plan --model PATH|config.json|NAME --seq N --gpus G [--gpu h100] ...

The serving flags (and their environment fallbacks) are the fields of
``ringkv.serve.ServeConfig``; the engine's are ``EngineConfig``'s.

With ``--tp/--pp/--sp`` the command starts the extra ranks itself; under
``torchrun --nproc-per-node N -m ringkv ...`` every rank runs it and rank 0 prints (generate)
or serves HTTP (serve).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from .engine import EngineConfig, flags
from .serve.config import ServeConfig


def _engine_options(g: argparse.ArgumentParser) -> None:
    """``--model`` and ``EngineConfig``'s flags (each field's own, ``engine/flags.py``)."""
    g.add_argument(
        "--model", required=True, help="HF directory (config.json + *.safetensors) or a .gguf file"
    )
    flags.add_arguments(EngineConfig, g)


def _generate_options(g: argparse.ArgumentParser) -> None:
    """``ringkv generate``'s own flags: the prompts and the sampling parameters."""
    g.add_argument(
        "--prompt", action="append", required=True, help="prompt text (repeat for a batch)"
    )
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    g.add_argument(
        "--stream", action="store_true", help="print tokens as they are generated (one prompt)"
    )


def _plan_options(q: argparse.ArgumentParser) -> None:
    """``ringkv plan``'s flags."""
    q.add_argument(
        "--model", required=True, help="preset name (e.g. llama-3-70b), HF directory or config.json"
    )
    q.add_argument("--seq", type=int, required=True, help="tokens per sequence (prompt + output)")
    q.add_argument("--batch", type=int, default=1, help="sequences held and decoded together")
    q.add_argument("--gpus", type=int, required=True)
    q.add_argument(
        "--gpu",
        default="h100",
        help="h100, h200, h800, a100, l40s, 4090, cpu (or one from --hardware)",
    )
    q.add_argument(
        "--interconnect",
        default="nvlink",
        help="link inside a node: nvlink, pcie; ib: one GPU per node",
    )
    q.add_argument(
        "--nodes", type=int, default=None, help="nodes holding the GPUs (between nodes: ib)"
    )
    q.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        default=["auto"],
        help="one or more of auto, int8, fp8, fp8_e5m2",
    )
    q.add_argument(
        "--dtype", default="bfloat16", help="bfloat16, float16, float32, fp8 (FP8 weights)"
    )
    q.add_argument(
        "--hardware", default=None, metavar="FILE", help="JSON merged over ringkv/hardware.json"
    )
    q.add_argument(
        "--calibrate",
        nargs="+",
        default=None,
        metavar="JSON",
        help="benchmark results (long_ctx.py, long_prefill.py, engine.py --json) or a rates file",
    )
    q.add_argument(
        "--output-tokens", type=int, default=256, help="decode length used to rank the options"
    )
    q.add_argument("--no-ulysses", action="store_true", help="plain ring only for SP")
    q.add_argument(
        "--link",
        action="append",
        default=[],
        metavar="LEVEL=RATE[,LATENCY]",
        help="a link's bandwidth and per-message latency, overriding the hardware table: "
        "intra (inside a node) or inter (between nodes), e.g. --link intra=10gbit,20us "
        "--link inter=1gbit,100us (tc units: 100mbit, 1gbit; or bytes/s)",
    )
    q.add_argument(
        "--migrate-tokens",
        type=int,
        default=None,
        metavar="N",
        help="also predict moving the K/V of a request of N tokens over the inter link "
        "(the intra link on one node)",
    )
    q.add_argument("--json", default=None, metavar="PATH", help="write the options as JSON")
    q.add_argument(
        "--plot", default=None, metavar="PATH", help="prefill vs decode plot of the options"
    )
    q.add_argument("--top", type=int, default=None, help="print only the best N options")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ringkv", description="ringkv: exact ring attention and an inference engine"
    )
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text with the ringkv engine")
    _engine_options(g)
    _generate_options(g)
    s = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)"
    )
    _engine_options(s)
    ServeConfig.add_arguments(s, "serve")
    r = sub.add_parser(
        "router",
        help="an OpenAI-compatible front over ringkv serve instances (KV-aware routing, "
        "live migration, failover)",
    )
    r.add_argument(
        "--upstream",
        action="append",
        default=[],
        metavar="URL",
        help="a ringkv serve instance started with --admin or the same --admin-key (repeat)",
    )
    ServeConfig.add_arguments(r, "router")
    q = sub.add_parser(
        "plan", help="choose TP/PP/SP (and KV dtype) for a model, a context length and a cluster"
    )
    _plan_options(q)
    return p


def _plan_migration(args) -> tuple:
    """``(link level, bytes, seconds)`` of moving ``--migrate-tokens`` tokens' K/V."""
    from . import planner

    given = planner.parse_links(args.link)
    level = "inter" if (args.nodes or 1) > 1 or args.interconnect == "ib" else "intra"
    if level not in given:
        raise ValueError(
            f"--migrate-tokens needs the {level} link's rate: give --link {level}=RATE,LATENCY"
        )
    kv_dtype = args.kv_cache_dtype[0]
    return (
        level,
        planner.request_kv_bytes(args.model, args.migrate_tokens, kv_dtype, args.dtype),
        planner.migration_time(
            args.model, args.migrate_tokens, given[level], kv_cache_dtype=kv_dtype, dtype=args.dtype
        ),
    )


def _plan_json(args, opts, migration) -> None:
    """``--json``: the inputs, the options and the migration estimate."""
    import json

    with open(args.json, "w") as f:
        json.dump(
            dict(
                inputs={
                    k: v for k, v in vars(args).items() if k not in ("json", "plot", "command")
                },
                options=[o.asdict() for o in opts],
                **(
                    {}
                    if migration is None
                    else {
                        "migration": dict(
                            tokens=args.migrate_tokens,
                            link=migration[0],
                            bytes=migration[1],
                            seconds=migration[2],
                        )
                    }
                ),
            ),
            f,
            indent=2,
        )


def _plan(args) -> int:
    from . import planner
    from .planner import hybrid

    if hybrid.engine_memory(args.model) is not None:  # not in the engine planner's table yet
        return _plan_hybrid(args, None)
    try:
        opts = planner.plan(
            args.model,
            args.seq,
            batch=args.batch,
            gpus=args.gpus,
            gpu=args.gpu,
            interconnect=args.interconnect,
            nodes=args.nodes,
            kv_cache_dtype=args.kv_cache_dtype,
            dtype=args.dtype,
            hardware=args.hardware,
            calibrate=args.calibrate,
            output_tokens=args.output_tokens,
            ulysses=not args.no_ulysses,
            links=args.link,
        )
        migration = None if args.migrate_tokens is None else _plan_migration(args)
    except (ValueError, TypeError) as e:
        if "unsupported model_type" in str(e):  # a hybrid model: patch_model's split, if one
            return _plan_hybrid(args, e)
        print(f"ringkv: {e}", file=sys.stderr)
        return 2
    print(planner.format_table(opts[: args.top] if args.top else opts))
    best = [o for o in opts if o.recommended]
    if best:
        b = best[0]
        ulysses = f" ulysses={b.ulysses}" if b.ulysses > 1 else ""
        print(f"\nrecommended: tp={b.tp} pp={b.pp} sp={b.sp}{ulysses}")
    else:
        print(
            f"\nnothing fits (closest: {opts[0].reason}); use more GPUs, a quantized KV cache or "
            f"a shorter sequence"
        )
    if migration is not None:
        level, nbytes, seconds = migration
        print(
            f"migration of {args.migrate_tokens} tokens' K/V ({nbytes / 1e6:.3g} MB) over the "
            f"{level} link: {seconds:.3g} s"
        )
    if args.json:
        _plan_json(args, opts, migration)
    if args.plot:
        planner.plot(opts, args.plot, f"{args.model}, {args.seq} tokens, {args.gpus} x {args.gpu}")
    return 0


def _plan_hybrid(args, refused: Exception) -> int:
    """``ringkv plan`` of a hybrid model (``refused``: the engine's refusal of a model it does
    not run, None for one it serves): what the engine keeps per sequence, and the recurrent
    layers as ``patch_model`` splits them (``planner.hybrid``); or the engine's refusal."""
    from . import planner
    from .planner import hybrid

    try:
        layers = hybrid.recurrent_layers(args.model)
    except TypeError as e:  # a recurrent layer ringkv cannot split, named
        print(f"ringkv: {e}", file=sys.stderr)
        return 2
    if layers is None:
        print(f"ringkv: {refused}", file=sys.stderr)
        return 2
    try:  # choose_form with the target's link and matmul rate
        r = planner.rates(planner.load_hardware(args.hardware), args.gpu, args.dtype)
    except (ValueError, KeyError) as e:
        print(f"ringkv: {e}", file=sys.stderr)
        return 2
    link = r.links.get(args.interconnect, min(r.links.values()))
    rates = dict(link_bytes_per_s=link, flops_per_s=r.matmul)
    itemsize = 4 if args.dtype == "float32" else 2
    rows = hybrid.hybrid_plan(layers, args.seq, args.gpus, itemsize, rates)
    memory = hybrid.engine_memory(args.model, itemsize)
    if memory is not None:
        print(
            f"ringkv: the engine serves this {memory['model_type']} hybrid (docs/engine.md, Hybrid "
            f"models); the TP/PP/SP table does not model its recurrent layers yet."
        )
        print(hybrid.format_engine_memory(memory) + "\n")
    else:
        print(f"ringkv: {refused}: the engine does not serve this hybrid model.")
    print(
        f"patch_model (training, prefill) splits its recurrent layers over an SP group as follows "
        f"({args.seq} tokens, zigzag, batch 1, bytes one rank sends per layer and forward; "
        f"auto: the form method='auto' picks at {link / 1e9:.3g} GB/s and "
        f"{r.matmul / 1e12:.3g} TFLOP/s):\n"
    )
    print(hybrid.format_hybrid(rows))
    if args.json:
        import json

        with open(args.json, "w") as f:
            out = dict(model=str(args.model), seq=args.seq, hybrid=rows, engine=memory)
            json.dump(out, f, indent=1)
    return 0


def _build(args, instance_id: Optional[str] = None):
    """The engine of a parsed command line: its ``EngineConfig`` from the flags; ``instance_id``:
    a serving instance's name, under which it keeps its disk tier (replicas never share one
    directory)."""
    import os

    from .engine import LLM

    disk = args.kv_disk
    if disk is not None and instance_id:
        disk = os.path.join(disk, instance_id)
    return LLM(args.model, flags.from_args(EngineConfig, args, kv_disk=disk))


def _router(config: ServeConfig, upstream=(), replicas=None) -> int:
    """A front: over ``upstream`` URLs (``ringkv router``), or over ``replicas`` it starts (the
    ``ringkv serve`` argument lists of ``ringkv serve --replicas``)."""
    from .serve.router import Router, new_key, run

    c = config
    try:
        router = Router(
            routing=c.routing,
            migration=c.migration,
            threshold=c.migration_threshold,
            balance=c.balance,
            kv_pull=c.kv_pull,
            admin=c.admin,
            admin_key=c.admin_key,
            upstream_key=c.admin_key or (new_key() if replicas else None),
            api_key=c.api_key,
            protect_metrics=c.protect_metrics,
        )
        for url in upstream:
            router.add(url)
    except ValueError as e:
        print(f"ringkv: {e}", file=sys.stderr)
        return 2
    if replicas is None and not upstream:
        print(
            "ringkv: router needs at least one --upstream URL "
            "(more can join: POST /admin/instances)",
            file=sys.stderr,
        )
    print(
        f"ringkv: routing ({c.routing}) on http://{c.host}:{c.port}/v1",
        file=sys.stderr,
        flush=True,
    )
    run(
        router,
        host=c.host,
        port=c.port,
        log_level=c.log_level,
        replicas=replicas,
        max_request_bytes=c.max_request_bytes,
    )
    if router.fatal:
        print(f"ringkv: {router.fatal}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "plan":
        return _plan(args)
    config = ServeConfig.from_args(args)  # serve and router: with the environment's fallbacks
    if args.command == "router":
        return _router(config, args.upstream)
    if args.command == "serve" and config.replicas is not None:
        import os

        if config.replicas < 1 or not os.path.exists(args.model):
            why = (
                f"--replicas must be >= 1, got {config.replicas}"
                if config.replicas < 1
                else f"no model at {args.model!r}"
            )
            print(f"ringkv: {why}", file=sys.stderr)
            return 2
        argv = ServeConfig.replica_argv(sys.argv[1:] if argv is None else list(argv))
        return _router(config, replicas=[list(argv) for _ in range(config.replicas)])
    from .engine import SamplingParams

    params = None
    if args.command == "generate":
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_tokens=args.max_tokens,
            stop=args.stop,
            seed=args.seed,
        )
        problem = params.problem()
        if problem:
            print(f"ringkv: {problem}", file=sys.stderr)
            return 2
    try:
        if args.command == "serve":
            return _serve(args, config)
        llm = _build(args)
    except (FileNotFoundError, ValueError, TypeError) as e:
        print(f"ringkv: {e}", file=sys.stderr)
        return 2
    with llm:
        try:
            return _run(llm, args, params)
        except KeyboardInterrupt:  # Ctrl-C: the step in flight finished on every rank; stop quietly
            print("\nringkv: interrupted", file=sys.stderr)
            return 130


def _serve(args, config: ServeConfig) -> int:
    """``ringkv serve``: rank 0 (the only process, or torchrun's rank 0) opens the port, then
    builds the engine while ``/health`` says "starting" (``serve.serve``); torchrun's other ranks
    build it and run rank 0's steps."""
    import os
    from dataclasses import replace

    from .serve import follow_forever, serve

    if os.environ.get("RANK", "0") != "0":  # under torchrun: rank 0 serves, the others follow
        with _build(args, config.instance_id) as llm:
            follow_forever(llm)
        return 0
    c = replace(config, model_name=config.model_name or args.model)
    print(
        f"ringkv: serving {c.model_name!r} on http://{c.host}:{c.port}/v1 "
        f'(/health says "starting" until the engine is built)',
        file=sys.stderr,
        flush=True,
    )
    if c.api_key is None and c.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"ringkv: WARNING: serving on {c.host} without an API key: anyone who reaches the "
            f"port can use it (--api-key or RINGKV_API_KEY)",
            file=sys.stderr,
            flush=True,
        )
    serve(lambda: _build(args, c.instance_id), c)
    return 0


def _run(llm, args, params) -> int:
    show = llm.rank == 0  # under torchrun every rank runs the command; rank 0 prints
    if llm.tokenizer is None:
        print(
            f"ringkv: no tokenizer files in {args.model!r}; text prompts need one", file=sys.stderr
        )
        return 2
    if args.stream and len(args.prompt) == 1:
        try:
            for delta in llm.stream(args.prompt[0], params, apply_chat_template=args.chat):
                if show:
                    print(delta.text, end="", flush=True)
        except ValueError as e:
            print(f"ringkv: {e}", file=sys.stderr)
            return 1
        if show:
            print()
        return 0
    outs = llm.generate(args.prompt, params, use_tqdm=False, apply_chat_template=args.chat)
    for o in outs if show else []:
        if o.finish_reason == "error":
            print(f"ringkv: {o.error}", file=sys.stderr)
            continue
        if len(outs) > 1:
            print(f"--- [{o.request_id}] ({o.finish_reason})")
        print(o.text)
    return int(any(o.finish_reason == "error" for o in outs))


if __name__ == "__main__":
    sys.exit(main())
