"""Replica processes a router supervises: ``ringkv serve --replicas N`` starts N instances on
this host (``start_replicas``), each a child that goes when the front goes (even on SIGKILL);
one that exits is started again (``supervise``), unless it exited ``MAX_CRASHES`` times in a
row before it ever answered (e.g. a bad model path); ``stop_replicas`` ends them with the front.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import List

from .policy import Instance, InstanceState

RESTART_AFTER = 5.0  # seconds a replica that exited has run at least before it is started again
MAX_CRASHES = 3  # a replica that exits this often in a row before it answers is not started again


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    # Linux: a replica goes when the front goes, even on SIGKILL
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def log_tail(proc, n: int = 400) -> str:
    """The end of a replica's log: why it exited."""
    try:
        with open(proc.log.name, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace").strip().splitlines()[-1][-n:]
    except (OSError, IndexError, AttributeError):
        return ""


def start_process(argv: List[str], log) -> subprocess.Popen:
    env = dict(os.environ)
    proc = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent
    )
    proc.log, proc.started = log, time.monotonic()
    return proc


class Terminated(BaseException):
    """SIGTERM, raised in ``run`` so that its replicas and their logs go first."""


def on_sigterm(signum, frame) -> None:
    """The SIGTERM handler of ``run``: raises ``Terminated``."""
    raise Terminated()


def new_key() -> str:
    return secrets.token_urlsafe(24)


def start_replicas(router, replicas: List[List[str]], logs: str, procs: list) -> None:
    """Start a ``ringkv serve`` instance per argument list of ``replicas`` on a free port of
    this host (logs in ``logs``), each added to ``router`` (``--instance-id r<i>``; the admin
    and API keys in its environment, not on its command line) and to ``procs``."""
    for i, extra in enumerate(replicas):
        p = free_port()
        argv = [sys.executable, "-m", "ringkv", "serve", *extra]
        argv += ["--host", "127.0.0.1", "--port", str(p), "--instance-id", f"r{i}"]
        log = open(os.path.join(logs, f"r{i}.log"), "ab")
        os.environ["RINGKV_ADMIN_KEY"] = router.upstream_key  # the replicas read it
        if router.api_key is not None:
            os.environ["RINGKV_API_KEY"] = router.api_key
        proc = start_process(argv, log)
        procs.append(proc)
        router.add(f"http://127.0.0.1:{p}", f"r{i}", proc=proc, argv=argv)
    if replicas:
        msg = f"ringkv: {len(replicas)} replicas starting (logs in {logs})"
        print(msg, file=sys.stderr, flush=True)


def stop_replicas(instances: List[Instance], procs: List[subprocess.Popen], logs: str) -> None:
    """End the replicas among ``instances`` (SIGTERM, then SIGKILL after 30 s) and their logs."""
    for inst in instances:
        if inst.proc is not None and inst.proc.poll() is None:
            inst.proc.terminate()
    for inst in instances:
        if inst.proc is not None:
            try:
                inst.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                inst.proc.kill()
    for proc in procs:
        proc.log.close()
    shutil.rmtree(logs, ignore_errors=True)  # the replicas' logs went with them


def supervise(router, inst: Instance) -> bool:
    """Whether ``inst`` is a replica whose process exited: then it is marked down (or failed,
    after ``MAX_CRASHES``) and, with ``router.restart``, started again after ``RESTART_AFTER``
    seconds."""
    if inst.proc is None or inst.proc.poll() is None:
        return False
    if inst.state not in (InstanceState.DOWN, InstanceState.FAILED):
        if inst.state == InstanceState.STARTING:
            inst.crashes += 1  # exited before it ever answered
        router.down(inst, f"its process exited ({inst.proc.returncode}): {log_tail(inst.proc)}")
        if inst.crashes >= MAX_CRASHES:
            # e.g. a bad model path: starting it again would not help
            inst.state = InstanceState.FAILED
            print(
                f"ringkv: instance {inst.id} failed to start {inst.crashes} times;"
                f" last: {inst.error}",
                file=sys.stderr,
                flush=True,
            )
    if (
        router.restart
        and inst.state == InstanceState.DOWN
        and inst.argv is not None
        and time.monotonic() - inst.proc.started > RESTART_AFTER
    ):
        inst.proc = start_process(inst.argv, inst.proc.log)
        inst.state = InstanceState.STARTING
    return True
