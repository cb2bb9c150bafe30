"""``compile_decode="auto"`` (the default): whether this rank's stage runs compiled, decided once
per machine, and the compiled artifacts kept for the next start.

**The key** (``cache_key``). One directory per key under ``$RINGKV_CACHE`` (default
``~/.cache/ringkv``, as ``kernels/native.py``'s builds) ``/compile/<key>``; the key hashes the
model's architecture (``ModelConfig``, the digest of its fields), the dtype and device, the rank's
stage (its layers, first/last), which kernel runs the graphs' linears, the torch version, the CPU
(``native.default_isa()`` and ``/proc/cpuinfo``'s model and flags), torch's thread count, ringkv's
version and a hash of its source files (``source_digest``). Another checkpoint of the same
architecture shares the directory: the CPU packages hold no weights (the live model's tensors are
loaded into them, ``compiled.py``), and on CUDA inductor keys a weight by its metadata only and
takes its values from the live model.

**The verdict** (``decide``). ``"auto"`` compiles the stage (into the artifact cache), then times a
decode step of each row count in ``check_rows`` compiled and eager on dummy inputs (attention
answering zeros: it runs eagerly either way), interleaved, medians (``timings``: the seam the
tests replace). The compiled step wins when the summed medians are at most ``WIN`` times eager's.
The verdict is stored in ``verdict.json`` in the key's directory, per row counts, and read back by
later starts (an eager verdict: no compile at all). ``RINGKV_COMPILE_DECODE``: ``1`` makes
``"auto"`` compile without the check, ``0`` makes it eager (the test suite sets ``0``); an explicit
``compile_decode=True``/``False`` ignores it. Every rank of a mesh posts its verdict and all take
the same decision (compile only when every rank's verdict is to compile: ``launch.py``), so ranks
never disagree on it.

**The artifacts** (``ArtifactCache``). On the CPU, the stage's AOTInductor packages
(``inductor/aoti/*.pt2``, ``compiled.py``): a later start loads them, nothing is traced or
compiled. On CUDA (``torch.compile``), ``TORCHINDUCTOR_CACHE_DIR`` points at the key's
``inductor/`` while a stage compiles: inductor's FX-graph cache (generated code, compiled ``.so``
s) and AOTAutograd's cache land there, and a later start finds them (``fxgraph_cache_hit``). After a
successful compile a ``manifest.json`` records every file's size and SHA-256; a start first checks
them: a file that does not match (changed, or not listed) is deleted before inductor looks, so
inductor builds that entry again and never loads it; with no manifest (a compile that did not
finish) the whole directory is. (A listed file that is missing is simply built again.) A file
lock serialises ranks sharing a key (SP ranks of one stage): the first compiles, the others start
warm.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import torch

log = logging.getLogger(__name__)

SWITCH = "RINGKV_COMPILE_DECODE"  # 1: auto compiles, 0: auto runs eager (no check)
WIN = 0.95  # compiled wins when its summed step medians are at most this fraction of eager's
CHECK_ROWS = (4, 16, 64)  # decode rows timed (those within the engine's range, and its largest)


def root() -> Path:
    return Path(os.environ.get("RINGKV_CACHE") or Path.home() / ".cache" / "ringkv") / "compile"


@contextlib.contextmanager
def inductor_dir(path):
    """``TORCHINDUCTOR_CACHE_DIR`` at ``path`` inside the block (inductor's generated code and C++
    builds land there), as it was after."""
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


def cache_key(cfg, dtype, device, stage: Sequence[int], first: bool, last: bool, linear: str):
    """``(key, parts)``: the directory name of this stage's artifacts and verdicts, and what it
    hashes (plain data, shown by ``kv_cache_info()``)."""
    from importlib.metadata import PackageNotFoundError, version

    from ..kernels import native

    try:
        ours = version("ringkv")
    except PackageNotFoundError:  # a checkout on sys.path, not installed
        ours = "unknown"

    arch = json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str)
    parts = dict(
        model=hashlib.sha256(arch.encode()).hexdigest()[:16],
        dtype=str(dtype).replace("torch.", ""),
        device=torch.device(device).type,
        stage=f"layers {min(stage, default=0)}-{max(stage, default=-1)}"
        f"{' first' if first else ''}{' last' if last else ''}",
        linear=linear,
        torch=torch.__version__,
        isa=native.default_isa(),
        cpu=hashlib.sha256(native._cpu_id().encode()).hexdigest()[:12],
        threads=torch.get_num_threads(),
        ringkv=ours,
        source=source_digest(),
    )
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]
    return key, parts


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    """A hash of ringkv's own source files (Python and C): a checkout or an editable install whose
    code changed (the model's layers, the graphs, the kernels) starts cold rather than load
    packages traced from other code under the same version number."""
    pkg = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for f in sorted(pkg.rglob("*")):
        if f.suffix in (".py", ".c", ".h"):
            h.update(str(f.relative_to(pkg)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def check_rows(largest: int, min_rows: int) -> Tuple[int, ...]:
    """The decode row counts the check times: ``CHECK_ROWS`` within ``[min_rows, largest]``, and
    ``largest`` (the engine's ``max_num_seqs``) itself."""
    return tuple(sorted({r for r in CHECK_ROWS if min_rows <= r <= largest} | {largest}))


def timings(
    compiled: Callable[[int], object],
    eager: Callable[[int], object],
    rows: Sequence[int],
    *,
    budget_s: float = 0.5,
    min_rounds: int = 3,
    max_rounds: int = 15,
) -> List[Tuple[int, float, float]]:
    """``[(rows, compiled seconds, eager seconds)]``: medians of a step of each row count,
    interleaved (the order alternates each round) after a warm-up call each. The seam the tests
    replace."""
    out = []
    for b in rows:
        fns = (compiled, eager)
        for f in fns:
            f(b)
        times = ([], [])
        stop = time.perf_counter() + budget_s
        for r in range(max_rounds):
            for i in (0, 1) if r % 2 == 0 else (1, 0):
                t = time.perf_counter()
                fns[i](b)
                times[i].append(time.perf_counter() - t)
            if r + 1 >= min_rounds and time.perf_counter() > stop:
                break
        out.append((b, statistics.median(times[0]), statistics.median(times[1])))
    return out


def verdict_of(measured: Sequence[Tuple[int, float, float]]) -> dict:
    """The verdict of ``timings``' medians: ``compile`` when compiled <= ``WIN`` x eager summed."""
    c = sum(m[1] for m in measured)
    e = sum(m[2] for m in measured)
    return dict(
        compile=bool(c <= WIN * e),
        rows=[m[0] for m in measured],
        compiled_ms=[round(m[1] * 1e3, 3) for m in measured],
        eager_ms=[round(m[2] * 1e3, 3) for m in measured],
        measured=time.strftime("%Y-%m-%d %H:%M:%S"),
        load=round(os.getloadavg()[0], 2),  # a busy machine's verdict may be noise
    )


def _read(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: Path, value: dict) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(value, f, indent=1)
    os.replace(tmp, path)


class ArtifactCache:
    """One key's directory: inductor's caches (``inductor/``), their ``manifest.json`` and the
    auto verdicts (``verdict.json``)."""

    def __init__(self, key: str, parts: dict, base: Optional[Path] = None):
        self.key, self.parts = key, parts
        self.dir = (base or root()) / key
        self.inductor = self.dir / "inductor"
        self.packages = self.inductor / "aoti"  # CPU: AOTInductor packages (compiled.py)
        self.manifest = self.dir / "manifest.json"
        self.verdicts = self.dir / "verdict.json"
        self.state = ""  # how the last compile found the cache: cold, warm, rebuilt (<why>)

    @contextlib.contextmanager
    def _lock(self):
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _files(self) -> List[Path]:
        if not self.inductor.is_dir():
            return []
        return sorted(
            p for p in self.inductor.rglob("*") if p.is_file() and not p.name.endswith(".lock")
        )

    @staticmethod
    def _hash(p: Path) -> str:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()

    def check(self) -> Tuple[List[str], str]:
        """``(damaged, why)``: the files not to load (relative to ``inductor/``: changed or
        unlisted; every file when there is no manifest) and why, or ``([], "")``."""
        files = self._files()
        if not files:
            return [], ""
        listed = _read(self.manifest).get("files")
        names = [str(p.relative_to(self.inductor)) for p in files]
        if not isinstance(listed, dict):
            return names, "no manifest (a compile that did not finish)"
        damaged, why = [], []
        for name in names:
            p, entry = self.inductor / name, listed.get(name)
            if entry is None:
                damaged.append(name)
                why.append(f"{name} is not in the manifest")
            elif p.stat().st_size != entry[0] or self._hash(p) != entry[1]:
                damaged.append(name)
                why.append(f"{name} does not match its manifest")
        return damaged, "; ".join(why[:3]) + (f" (and {len(why) - 3} more)" if len(why) > 3 else "")

    def _record(self) -> None:
        files = {
            str(p.relative_to(self.inductor)): (p.stat().st_size, self._hash(p))
            for p in self._files()
        }
        _write(self.manifest, dict(parts=self.parts, files=files))

    @contextlib.contextmanager
    def compiling(self, what: str = "this model's steps"):
        """Compile inside: inductor's caches in this key's directory (checked first: a damaged
        one is deleted), the manifest written when the body succeeds."""
        with self._lock():
            damaged, why = self.check()
            if damaged:  # deleted, never loaded: inductor builds them again
                log.warning("ringkv: compile cache %s: %s; rebuilding those", self.dir, why)
                for name in damaged:
                    (self.inductor / name).unlink(missing_ok=True)
            if not _read(self.manifest).get("files"):
                shutil.rmtree(self.inductor, ignore_errors=True)
            had = bool(self._files())
            self.state = f"rebuilt ({why})" if damaged else "warm" if had else "cold"
            if not had:
                log.warning(
                    "ringkv: compiling %s for this machine (the first start, a minute or more; "
                    "cached in %s for the next)",
                    what,
                    self.dir,
                )
            with inductor_dir(self.inductor):
                yield self
            self._record()

    def verdict(self, rows: Sequence[int]) -> Optional[dict]:
        """The stored auto verdict for these row counts, or None."""
        found = _read(self.verdicts).get(",".join(map(str, rows)))
        return found if isinstance(found, dict) and "compile" in found else None

    def store_verdict(self, verdict: dict) -> None:
        with self._lock():
            table = _read(self.verdicts)
            table[",".join(map(str, verdict["rows"]))] = verdict
            _write(self.verdicts, table)
