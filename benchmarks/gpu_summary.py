"""The summary table of a ``benchmarks/gpu_check.sh`` run: reads ``OUT_DIR`` (``steps.tsv``, the
JSON of each benchmark, the pytest junit XML) and writes ``OUT_DIR/summary.md``.

    python benchmarks/gpu_summary.py results/gpu
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + [
        "| "
        + " | ".join(
            "-" if c is None else f"{c:.3g}" if isinstance(c, float) else str(c) for c in r
        )
        + " |"
        for r in rows
    ]


def main(out_dir: str) -> int:
    d = Path(out_dir)
    md = [f"# GPU check ({d})", ""]
    if (d / "env.txt").exists():
        md += ["```", (d / "env.txt").read_text().strip(), "```", ""]
    steps = (
        [line.split("\t") for line in (d / "steps.tsv").read_text().splitlines()[1:]]
        if (d / "steps.tsv").exists()
        else []
    )
    md += table(["step", "verdict", "seconds", "limit s"], steps) + [""]

    if (d / "pytest_cuda.xml").exists():
        suites = ET.parse(d / "pytest_cuda.xml").getroot()
        s = suites if suites.tag == "testsuite" else suites.find("testsuite")
        md += (
            ["## pytest -m cuda", ""]
            + table(
                ["tests", "failures", "errors", "skipped", "seconds"],
                [[s.get(k) for k in ("tests", "failures", "errors", "skipped", "time")]],
            )
            + [""]
        )

    k = load(d / "kernels.json")
    if k:
        att = k.get("attention", [])
        flash = {
            (r["seqlen"], r["head_dim"], r["causal"], r["mode"]): r["ms"]
            for r in att
            if r["impl"] == "flash_attn-package" and r.get("ms")
        }
        md += (
            [f"## attention kernels ({k.get('device_name')}, {k.get('dtype')})", ""]
            + table(
                ["impl", "mode", "mask", "S", "D", "ms", "TFLOP/s", "flash_attn ms / ms"],
                [
                    [
                        r["impl"],
                        r["mode"],
                        "causal" if r["causal"] else "full",
                        r["seqlen"],
                        r["head_dim"],
                        r.get("ms"),
                        r.get("tflops"),
                        (flash.get((r["seqlen"], r["head_dim"], r["causal"], r["mode"])) / r["ms"])
                        if r.get("ms")
                        and (r["seqlen"], r["head_dim"], r["causal"], r["mode"]) in flash
                        else None,
                    ]
                    for r in att
                ],
            )
            + [""]
        )
        md += (
            [f"## paged decode (device copy: {k.get('copy_gbps', 0):.1f} GB/s)", ""]
            + table(
                ["impl", "seqs", "cache len", "ms", "GB/s", "fraction of copy"],
                [
                    [
                        r["impl"],
                        r["seqs"],
                        r["cache_len"],
                        r.get("ms"),
                        r.get("gbps"),
                        r.get("fraction_of_copy"),
                    ]
                    for r in k.get("paged", [])
                ],
            )
            + [""]
        )

    ring = [(name, load(d / f"{name}.json")) for name in ("ring_fwd", "ring_fwd_bwd")]
    if any(r for _, r in ring):
        md += (
            ["## ring, 8 virtual ranks on one device, against one worker on the whole sequence", ""]
            + table(
                [
                    "run",
                    "seq",
                    "layout",
                    "mask",
                    "8 ranks s",
                    "baseline s",
                    "baseline",
                    "efficiency",
                    "TFLOP/s",
                ],
                [
                    [
                        name,
                        res["args"]["seq"],
                        r["layout"],
                        "causal" if r["causal"] else "full",
                        r["time_s"],
                        r.get("baseline_s"),
                        r.get("baseline"),
                        r.get("efficiency"),
                        r.get("tflops_per_rank"),
                    ]
                    for name, res in ring
                    if res
                    for r in res["rows"]
                ],
            )
            + [""]
        )

    e = load(d / "engine.json")
    if e:
        md += (
            [
                f"## engine: {e.get('model')} {e.get('dtype')} on {e.get('device')}, output "
                "tokens/s",
                "",
            ]
            + table(
                [
                    "requests",
                    "outputs",
                    "ringkv tok/s",
                    "HF batched tok/s",
                    "speedup",
                    "HF one by one tok/s",
                    "greedy agreement",
                ],
                [
                    [
                        r["requests"],
                        r["output_lengths"],
                        r["ringkv_tok_s"],
                        r["hf_batched_tok_s"],
                        r["speedup_vs_hf_batched"],
                        r.get("hf_single_tok_s"),
                        r["greedy_agreement_vs_hf_batched"],
                    ]
                    for r in e["rows"]
                ],
            )
            + [""]
        )
    (d / "summary.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "results/gpu"))
