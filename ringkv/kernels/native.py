"""Building and loading ringkv's C kernels (``csrc/*.c``: plain C and OpenMP, no torch headers).

A kernel is compiled on first use with the system's C compiler (``$CC``, else ``cc``/``gcc``)
into ``$RINGKV_CACHE`` (default ``~/.cache/ringkv``)``/kernels``, keyed by the source, the flags
and the CPU, and loaded with ``ctypes``; OpenMP resolves to the runtime torch already loaded, so
the kernels share torch's threads (``torch.get_num_threads()``). A build goes to a temp file that
is renamed into place, so ranks that build at once do not collide.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Optional

CSRC = Path(__file__).with_name("csrc")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC"]


def _cpu_id() -> str:
    """What ``-march=native`` compiles for: the CPU model and flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def compiler() -> Optional[str]:
    """The C compiler the kernels are built with: ``$CC``, else ``cc`` or ``gcc`` on the path."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@lru_cache(maxsize=None)
def load(name: str, switch: str) -> Optional[ctypes.CDLL]:
    """``csrc/<name>.c`` compiled and loaded, built on first use; None when the environment
    variable ``switch`` is ``0``, off Linux, or when no compiler builds it (with a warning saying
    why: the caller's torch path takes over)."""
    if os.environ.get(switch, "1") == "0" or platform.system() != "Linux":
        return None
    source = CSRC / f"{name}.c"
    cc = compiler()
    if cc is None:
        warnings.warn(f"ringkv: no C compiler found; the {name} kernel is off (the torch path runs)")
        return None
    key = hashlib.sha256(b"\0".join([source.read_bytes(), " ".join([cc, *FLAGS]).encode(),
                                     _cpu_id().encode()])).hexdigest()[:16]
    root = Path(os.environ.get("RINGKV_CACHE") or Path.home() / ".cache" / "ringkv") / "kernels"
    path = root / f"{name}-{key}.so"
    try:
        if not path.exists():
            root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=root)  # several ranks may build at once
            os.close(fd)
            try:
                subprocess.run([cc, *FLAGS, str(source), "-o", tmp, "-lm"], check=True, capture_output=True,
                               timeout=120)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        warnings.warn(f"ringkv: building the {name} kernel failed ({e}; "
                      f"{detail.decode(errors='replace')[-500:]}); the torch path runs")
        return None
