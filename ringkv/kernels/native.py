"""Building and loading ringkv's C kernels (``csrc/*.c``: plain C and OpenMP, no torch headers),
one build per target ISA, and the self-check that decides whether a kernel replaces its torch path.

**Builds.** A kernel is compiled on first use with the system's C compiler (``$CC``, else
``cc``/``gcc``) into ``$RINGKV_CACHE`` (default ``~/.cache/ringkv``)``/kernels``, keyed by the
source, the flags and the CPU, and loaded with ``ctypes``; OpenMP resolves to the runtime torch
already loaded, so the kernels share torch's threads (``torch.get_num_threads()``). A build goes to
a temp file that is renamed into place, so ranks that build at once do not collide. Each build is
for one target ISA (``ISAS``): ``"native"`` (``-march=native``, the default), ``"x86-64-v4"``
(AVX-512), ``"x86-64-v3"`` (AVX2 + FMA) or ``"generic"`` (the compiler's default target: portable,
slow). The C files choose their register tiles from the target's macros (``__AVX512F__``,
``__AVX2__`` + ``__FMA__``, else 128-bit vectors). ``RINGKV_KERNEL_ISA`` sets the default target
for the process (``x86-64-v3`` on an AVX-512 machine builds and runs what an AVX2-only CPU would);
a target this CPU cannot run (``supported_isas()``) is refused with a warning, never loaded.

**Self-check** (``self_check``). Before a kernel becomes the default here it is timed against the
torch path it replaces, on a representative call (interleaved, medians; well under a second), and
the faster one is kept. The verdict is cached beside the built kernel (``<name>-<key>.json``, the
``.so``'s own key: CPU, source, flags), per torch version and thread count, so later processes
read it instead of timing again. The kernel's switch (``RINGKV_NATIVE_LINEAR``/``_FLASH``/
``_PAGED``): ``1`` turns it on without the self-check, ``0`` turns it off, unset lets the
self-check decide.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional, Tuple

CSRC = Path(__file__).with_name("csrc")
BASE_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-Wno-psabi", "-shared", "-fPIC"]
ISAS = ("native", "x86-64-v4", "x86-64-v3", "generic")
MARCH = {
    "native": ["-march=native"],
    "x86-64-v4": ["-march=x86-64-v4", "-mtune=generic"],
    "x86-64-v3": ["-march=x86-64-v3", "-mtune=generic"],
    "generic": [],
}
# what each x86-64 level needs from /proc/cpuinfo's flags (the psABI's levels; abm is lzcnt)
V3_FLAGS = ("avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm")
V4_FLAGS = V3_FLAGS + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")


def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def _cpu_id() -> str:
    """What ``-march=native`` compiles for: the CPU model and flags."""
    lines = [ln for ln in _cpuinfo().splitlines() if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(lines) if lines else (platform.processor() or platform.machine())


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    for ln in _cpuinfo().splitlines():
        if ln.startswith("model name") and ln.split(":", 1)[1].strip():
            return ln.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def supported_isas() -> Tuple[str, ...]:
    """The named targets (of ``"x86-64-v4"``, ``"x86-64-v3"``, ``"generic"``) whose builds this CPU
    runs, from ``/proc/cpuinfo``'s flags; ``"generic"`` always (``"native"`` too, not listed)."""
    flags = set()
    for ln in _cpuinfo().splitlines():
        if ln.startswith("flags"):
            flags = set(ln.split(":", 1)[1].split())
            break
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    levels = (("x86-64-v4", V4_FLAGS), ("x86-64-v3", V3_FLAGS))
    return tuple(isa for isa, need in levels if x86 and flags >= set(need)) + ("generic",)


def default_isa() -> str:
    """The target the kernels are built for in this process: ``$RINGKV_KERNEL_ISA``, else
    ``"native"``."""
    isa = os.environ.get("RINGKV_KERNEL_ISA") or "native"
    if isa not in ISAS:
        raise ValueError(f"RINGKV_KERNEL_ISA={isa!r}: choose one of {', '.join(ISAS)}")
    return isa


def flags(isa: str) -> list:
    """The compiler flags of a build for ``isa``."""
    if isa not in ISAS:
        raise ValueError(f"unknown kernel ISA {isa!r}; choose one of {', '.join(ISAS)}")
    return [*BASE_FLAGS[:1], *MARCH[isa], *BASE_FLAGS[1:]]


def compiler() -> Optional[str]:
    """The C compiler the kernels are built with: ``$CC``, else ``cc`` or ``gcc`` on the path."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def cache_dir() -> Path:
    return Path(os.environ.get("RINGKV_CACHE") or Path.home() / ".cache" / "ringkv") / "kernels"


@dataclass(frozen=True)
class Build:
    """One kernel compiled for one target: the loaded library, its ``.so`` and its key."""

    name: str
    isa: str
    path: Path
    lib: ctypes.CDLL

    @property
    def tiles(self) -> str:
        """The build's register tiles, as its C file describes them (``ringkv_<name>_tiles``)."""
        fn = getattr(self.lib, f"ringkv_{self.name}_tiles", None)
        if fn is None:
            return ""
        fn.restype = ctypes.c_char_p
        return fn().decode()


def build(name: str, isa: Optional[str] = None) -> Optional[Build]:
    """``csrc/<name>.c`` compiled for ``isa`` (default: ``default_isa()``) and loaded, built on
    first use (once per process); None off Linux, for a target this CPU cannot run, or when no
    compiler builds it (each with a warning saying why: the caller's torch path takes over)."""
    isa = isa or default_isa()
    flags(isa)  # a known name
    if isa != "native" and isa not in supported_isas():
        warnings.warn(
            f"ringkv: this CPU cannot run {isa} code (supported: {', '.join(supported_isas())}); "
            f"the {name} kernel for it is off (the torch path runs)"
        )
        return None
    return _build(name, isa)


@lru_cache(maxsize=None)
def _build(name: str, isa: str) -> Optional[Build]:
    fl = flags(isa)
    if platform.system() != "Linux":
        return None
    source = CSRC / f"{name}.c"
    cc = compiler()
    if cc is None:
        warnings.warn(
            f"ringkv: no C compiler found; the {name} kernel is off (the torch path runs)"
        )
        return None
    key = hashlib.sha256(
        b"\0".join(
            [
                source.read_bytes(),
                *(h.read_bytes() for h in sorted(CSRC.glob("*.h"))),  # what the sources include
                " ".join([cc, *fl]).encode(),
                _cpu_id().encode(),
            ]
        )
    ).hexdigest()[:16]
    root = cache_dir()
    path = root / f"{name}-{key}.so"
    try:
        if not path.exists():
            root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=root)  # several ranks may build at once
            os.close(fd)
            try:
                subprocess.run(
                    [cc, *fl, str(source), "-o", tmp, "-lm"],
                    check=True,
                    capture_output=True,
                    timeout=180,
                )
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        return Build(name, isa, path, ctypes.CDLL(str(path)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        warnings.warn(
            f"ringkv: building the {name} kernel for {isa} failed ({e}; "
            f"{detail.decode(errors='replace')[-500:]}); the torch path runs"
        )
        return None


def load(
    name: str, switch: Optional[str] = None, isa: Optional[str] = None
) -> Optional[ctypes.CDLL]:
    """The library of ``build(name, isa)``; None when it does not build, or when the environment
    variable ``switch`` (if given) is ``0``."""
    if switch and os.environ.get(switch) == "0":
        return None
    b = build(name, isa)
    return None if b is None else b.lib


def require(lib: Optional[ctypes.CDLL], who: str, switch: str, isa: Optional[str]) -> ctypes.CDLL:
    """``lib``, or a ``RuntimeError`` saying why the kernel ``who`` asked for is off."""
    if lib is None:
        raise RuntimeError(
            f"{who}: the kernel for {isa or default_isa()} is off here "
            f"({switch}=0, no compiler, or a target this CPU cannot run)"
        )
    return lib


# ---- the self-check ---------------------------------------------------------------------------


def measure(
    kernel: Callable[[], object],
    torch_path: Callable[[], object],
    *,
    budget_s: float = 0.3,
    min_rounds: int = 5,
    max_rounds: int = 31,
) -> Tuple[float, float]:
    """Median seconds of a kernel call and of its torch counterpart, interleaved (the order
    alternates each round) after one warm-up call each: at least ``min_rounds`` rounds, more while
    ``budget_s`` lasts. (The seam the self-check's tests replace.)"""
    kernel()
    torch_path()
    times = ([], [])
    stop = time.perf_counter() + budget_s
    for r in range(max_rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            t = time.perf_counter()
            (kernel, torch_path)[i]()
            times[i].append(time.perf_counter() - t)
        if r + 1 >= min_rounds and time.perf_counter() > stop:
            break
    return statistics.median(times[0]), statistics.median(times[1])


def _context() -> str:
    """What else a timing depends on: the torch version and its thread count."""
    import torch

    return f"torch {torch.__version__}, {torch.get_num_threads()} threads"


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def self_check(
    name: str,
    switch: str,
    setup: Callable[[str], Tuple[Callable, Callable, str]],
    torch_name: str,
    variant: str = "",
) -> dict:
    """Whether the kernel ``name`` (the default build) runs instead of its torch path here.

    ``setup(isa)`` makes a representative call's inputs for the build for ``isa`` and returns
    ``(kernel call, torch call, what they compute)``; ``torch_name`` names the torch path. Returns
    plain data: ``kernel``, ``isa``, ``tiles``, ``on``, ``by`` (``"<switch>=1"``, ``"<switch>=0"``,
    ``"no build"``, ``"self-check"`` or ``"self-check (cached)"``), ``why`` ("" when on),
    ``kernel_us`` / ``torch_us`` (medians; None without a self-check), ``call``, ``versus``,
    ``context`` (torch version, threads) and ``file`` (the cached verdicts). ``variant``: a second
    kind of call timed apart (its own verdict, e.g. cpu_flash's full-mask blocks)."""
    value = os.environ.get(switch)
    out = dict(
        kernel=f"{name} ({variant})" if variant else name,
        isa=default_isa(),
        tiles="",
        on=False,
        by="",
        why="",
        kernel_us=None,
        torch_us=None,
        call="",
        versus=torch_name,
        context="",
        file="",
    )
    if value == "0":
        return {**out, "by": f"{switch}=0", "why": f"off: {switch}=0"}
    b = build(name)
    if b is None:
        return {
            **out,
            "by": "no build",
            "why": "off: no C compiler builds it here (a warning said why)",
        }
    out.update(tiles=b.tiles)
    if value == "1":
        return {**out, "on": True, "by": f"{switch}=1"}
    path, context = b.path.with_suffix(".json"), _context() + (f", {variant}" if variant else "")
    found, by = _read(path).get(context), "self-check (cached)"
    if found is None:
        found, by = _self_check(b, path, context, setup)
    on = bool(found["on"])
    why = (
        ""
        if on
        else (
            f"off: {torch_name} was faster in the self-check ({found['kernel_us']:.0f} us against "
            f"{found['torch_us']:.0f} us on {found['call']}; {switch}=1 turns it on)"
        )
    )
    return {
        **out,
        "on": on,
        "by": by,
        "why": why,
        "kernel_us": found["kernel_us"],
        "torch_us": found["torch_us"],
        "call": found["call"],
        "context": context,
        "file": str(path),
    }


def _self_check(b: Build, path, context: str, setup) -> tuple:
    """``(verdict, by)``: the verdict one process times under the build's lock (the others wait,
    then read it), stored in ``path`` under ``context``."""
    import fcntl  # (Linux: there are no builds elsewhere)

    by = "self-check (cached)"
    # one process of several times it, the rest wait
    with open(b.path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        table = _read(path)
        found = table.get(context)
        if found is None:
            kernel, torch_path, call = setup(b.isa)
            k_s, t_s = measure(kernel, torch_path)
            found = dict(
                kernel_us=round(k_s * 1e6, 1),
                torch_us=round(t_s * 1e6, 1),
                call=call,
                on=k_s < t_s,
                measured=time.strftime("%Y-%m-%d %H:%M:%S"),
                load=round(os.getloadavg()[0], 2),
            )  # a busy machine's verdict may be noise
            table[context] = found
            fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump(table, f, indent=1)
            os.replace(tmp, path)
            by = "self-check"
    return found, by
