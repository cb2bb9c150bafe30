#!/usr/bin/env bash
# Re-measure every CPU input of benchmarks/plan_validate.py on the current code, one run after the
# other, into OUT (default results/plan_data), with uptime's load averages before and after each run
# in OUT/load.log. Then: cp OUT/*.json OUT/load.log benchmarks/data/plan/ && python benchmarks/plan_validate.py
#
#     bash benchmarks/plan_data.sh [OUT]          # about 30 minutes on the 2-core VM
#
# What each file feeds (docs/performance.md, "Planner validation"):
#   long_ctx_16k.json    attention rate (zigzag row); the striped row is predicted from it
#   long_ctx_128k.json   predicted (1 head, zigzag)
#   collective_latency.json   loopback latency and bandwidth (a rates file)
#   decode_gemm.json     weight bytes/s of decode matmuls by threads and rows (a rates file)
#   prefill_*.json, threshold_*.json, the engine_*.json baselines   the one-process fit
#   the sp = 2 rows of prefill_*.json and the parallel rows of engine_*.json   predicted
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/plan_data}
PY=${PYTHON:-python}
mkdir -p "$OUT/pair"
: > "$OUT/load.log"

run() {  # run NAME CMD...: the command, with the load before and after it in load.log
  local name=$1; shift
  local before; before=$(cut -d' ' -f1-3 /proc/loadavg)
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1 || { echo "$name failed, see $OUT/$name.log" >&2; exit 1; }
  echo "$name: load $before -> $(cut -d' ' -f1-3 /proc/loadavg), $((SECONDS - t0)) s" | tee -a "$OUT/load.log"
}

TR="$PY -m torch.distributed.run --nproc-per-node 2"
run long_ctx_16k $TR benchmarks/long_ctx.py --seq 16384 --heads 8 --kv-heads 8 --head-dim 64 --layout zigzag,striped \
  --iters 3 --no-baseline --json "$OUT/long_ctx_16k.json"
run long_ctx_128k $TR benchmarks/long_ctx.py --seq 131072 --heads 1 --kv-heads 1 --head-dim 64 --layout zigzag \
  --iters 2 --no-baseline --json "$OUT/long_ctx_128k.json"
run collective_latency $PY benchmarks/collective_latency.py --model llama-120m --tp 2 --rows 16 64 \
  --json "$OUT/collective_latency.json"
run decode_gemm $PY benchmarks/decode_gemm.py --model llama-120m --rows 1 4 8 16 32 64 128 --threads 1 2 --rounds 3 \
  --json "$OUT/decode_gemm.json"
run engine_tp2modelllama120m $PY benchmarks/engine.py --tp 2 --model llama-120m --requests 16 64 --repeats 3 \
  --json "$OUT/engine_tp2modelllama120m.json"
run engine_pp2modelllama120m $PY benchmarks/engine.py --pp 2 --model llama-120m --requests 16 64 --repeats 3 \
  --json "$OUT/engine_pp2modelllama120m.json"
run engine_pp2modelsmollm2 $PY benchmarks/engine.py --pp 2 --model smollm2 --requests 16 64 --repeats 3 \
  --json "$OUT/engine_pp2modelsmollm2.json"
run prefill_8k $PY benchmarks/long_prefill.py --model smollm2 --seq 8192 --sp 1 2 --repeats 3 --json "$OUT/prefill_8k.json"
run prefill_32k $PY benchmarks/long_prefill.py --model tiny-long --seq 32768 --sp 1 2 --repeats 3 \
  --json "$OUT/prefill_32k.json"
# thread scaling: one thread against two on the same 2K prompt, three alternating rounds (a short
# run moves by 20-30% with the load: a single pair gave anything from 1.5x to 1.9x), merged below
for i in 1 2 3; do
  for t in 1 2; do
    run prefill_2k_${t}t_$i $PY benchmarks/long_prefill.py --model smollm2 --seq 2048 --sp 1 --threads $t \
      --json "$OUT/pair/prefill_2k_${t}t_$i.json"
  done
done
$PY - "$OUT" <<'PYEOF'
import glob, json, sys
out = sys.argv[1]
for t, name in ((1, "prefill_2k_1thread"), (2, "prefill_2k_2threads")):
    docs = [json.load(open(p)) for p in sorted(glob.glob(f"{out}/pair/prefill_2k_{t}t_*.json"))]
    row = dict(docs[0]["rows"][0])
    row["times"] = [x for d in docs for x in d["rows"][0]["times"]]
    row["cpu_s"] = [x for d in docs for x in d["rows"][0]["cpu_s"]]
    row["ttft_s"] = min(row["times"])
    json.dump(dict(docs[0], rows=[row], rounds=len(docs)), open(f"{out}/{name}.json", "w"), indent=2)
PYEOF
run threshold_smollm2_short $PY benchmarks/long_prefill.py --model smollm2 --sweep 4 8 16 32 \
  --json "$OUT/threshold_smollm2_short.json"
run threshold_smollm2 $PY benchmarks/long_prefill.py --model smollm2 --sweep 64 128 256 512 1024 2048 4096 \
  --json "$OUT/threshold_smollm2.json"
run threshold_tiny $PY benchmarks/long_prefill.py --model tiny-long --sweep 64 256 1024 4096 \
  --json "$OUT/threshold_tiny.json"
echo "done: $OUT (git $(git rev-parse --short HEAD))" | tee -a "$OUT/load.log"
