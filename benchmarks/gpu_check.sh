#!/usr/bin/env bash
# One short GPU loan: CUDA tests, kernel benchmarks, the long-context ring benchmark.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]      (default results/gpu)
#
# Every step has its own timeout (about 7.5 minutes in all) and logs into OUT_DIR; a failing
# step is recorded in OUT_DIR/summary.txt and the script goes on. Exit status: 0 when every
# step that ran passed, 1 otherwise.
set -u
OUT_DIR="${1:-results/gpu}"
mkdir -p "$OUT_DIR"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"
status=0

step() {  # step NAME SECONDS COMMAND...
    local name="$1" secs="$2"; shift 2
    local t0=$SECONDS
    echo "== $name: $*" | tee -a "$SUMMARY"
    timeout --kill-after=10 "$secs" "$@" > "$OUT_DIR/$name.log" 2>&1
    local rc=$?
    local verdict=ok
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && verdict="TIMEOUT after ${secs}s"
    [ $rc -ne 0 ] && [ "$verdict" = ok ] && verdict="FAILED rc=$rc"
    [ $rc -ne 0 ] && status=1
    echo "   $verdict ($((SECONDS - t0))s), log: $OUT_DIR/$name.log" | tee -a "$SUMMARY"
    tail -n 3 "$OUT_DIR/$name.log" | sed 's/^/   | /' | tee -a "$SUMMARY"
}

{
    echo "date: $(date -u +%FT%TZ)"
    echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -n 4
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" 2>&1
} > "$OUT_DIR/env.txt"
cat "$OUT_DIR/env.txt" >> "$SUMMARY"

# one fixed tile config per kernel while testing (autotuning every drawn shape would mostly
# measure compile time); test_autotuned_configs_match_reference covers the tuned path
step pytest_cuda 200 env RINGKV_TRITON_AUTOTUNE=0 "$PY" -m pytest -m cuda -q -p no:cacheprovider --junitxml="$OUT_DIR/pytest_cuda.xml"
if [ -f benchmarks/kernels.py ]; then
    step kernels 150 "$PY" benchmarks/kernels.py --device cuda --json "$OUT_DIR/kernels.json"
else
    echo "== kernels: benchmarks/kernels.py not present, skipped" | tee -a "$SUMMARY"
fi
if [ -f benchmarks/long_ctx.py ]; then
    step long_ctx 90 "$PY" -m torch.distributed.run --nproc-per-node 1 benchmarks/long_ctx.py \
        --virtual 8 --json "$OUT_DIR/long_ctx.json"
else
    echo "== long_ctx: benchmarks/long_ctx.py not present, skipped" | tee -a "$SUMMARY"
fi
echo "exit status: $status" | tee -a "$SUMMARY"
exit $status
