#!/usr/bin/env bash
# One short GPU loan (issue #15 item 7), under 8 minutes on one GPU:
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]                     (default results/gpu)
#   GPU_CHECK_SMOKE=1 bash benchmarks/gpu_check.sh OUT_DIR     (CPU, tiny sizes: every command and flag runs)
#
# Steps, each under its own timeout (their sum plus kill grace stays under 8 minutes) and
# logging into OUT_DIR/NAME.log; a failing or timed-out step is recorded and the next runs:
#   pytest_cuda   the CUDA tests (pytest -m cuda, one fixed tile config per kernel; among them
#                 tests/test_hf_train.py: checkpoints offloaded to pinned host memory, and Liger's
#                 fused loss when liger-kernel is installed)
#   kernels       benchmarks/kernel_backends.py --device cuda: every registry backend against raw
#                 flash_attn_func and every torch SDPA backend; paged decode GB/s against a
#                 device-to-device copy
#   ring_fwd      benchmarks/long_ctx.py --virtual 8, 128K tokens, bf16, causal zigzag, against
#   ring_fwd_bwd  raw flash_attn_func on the whole sequence (efficiency = T_flash / T_8 ranks,
#                 i.e. per rank against T_flash / 8); ringkv.attention when flash-attn is missing
#   engine        benchmarks/engine.py: ringkv.LLM on SmolLM2 in bf16 against transformers generate
# OUT_DIR gets one JSON per benchmark, steps.tsv and summary.md (benchmarks/gpu_summary.py).
# Our Triton kernels run with one fixed tile config (RINGKV_TRITON_AUTOTUNE=0): autotuning compiles
# five configs per shape, which would eat most of the budget; export RINGKV_TRITON_AUTOTUNE=1 on
# a longer loan to measure tuned tiles.
# Exit status: 0 when every step passed, 1 otherwise.
set -u
OUT_DIR="$(mkdir -p "${1:-results/gpu}" && cd "${1:-results/gpu}" && pwd)"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
SMOKE="${GPU_CHECK_SMOKE:-0}"
export RINGKV_TRITON_AUTOTUNE="${RINGKV_TRITON_AUTOTUNE:-0}"
STEPS="$OUT_DIR/steps.tsv"
printf 'step\tverdict\tseconds\tlimit_s\n' > "$STEPS"
status=0

step() {  # step NAME SECONDS COMMAND...
    local name="$1" secs="$2"; shift 2
    local t0=$SECONDS verdict=ok
    echo "== $name (limit ${secs}s): $*"
    timeout --kill-after=5 "$secs" "$@" > "$OUT_DIR/$name.log" 2>&1
    local rc=$?
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then verdict="timeout"; elif [ $rc -ne 0 ]; then verdict="failed rc=$rc"; fi
    [ $rc -ne 0 ] && status=1
    printf '%s\t%s\t%s\t%s\n' "$name" "$verdict" "$((SECONDS - t0))" "$secs" >> "$STEPS"
    echo "   $verdict ($((SECONDS - t0))s); last lines of $OUT_DIR/$name.log:"
    tail -n 3 "$OUT_DIR/$name.log" | sed 's/^/   | /'
}

{
    echo "date: $(date -u +%FT%TZ)"
    echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -n 4
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" 2>&1
    "$PY" -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>&1 | tail -n 1
} > "$OUT_DIR/env.txt"
cat "$OUT_DIR/env.txt"

if "$PY" -c "import flash_attn" > /dev/null 2>&1; then BASE=flash_attn; else BASE=ringkv; fi
if [ "$SMOKE" = 1 ]; then  # the same commands on a CPU with tiny sizes (proves the flags exist)
    DEV=(--device cpu)
    KERNELS=(--quick --head-dims 32 --heads 2 --seqlens 256 --cache-lens 256 --seqs 2 --iters 1 --warmup 0 --copy-mib 8)
    RING=(--seq 1024 --heads 2 --kv-heads 1 --head-dim 32 --iters 1 --warmup 0)
    ENGINE=(--requests 2 --max-tokens 4 --min-prompt 8 --max-prompt 16 --hf-single-max 2)
else
    DEV=(--device cuda)
    KERNELS=(--quick)  # D 128, S 4096, causal and full; paged decode at 4K and 32K tokens
    RING=(--seq 131072 --iters 3 --warmup 1)  # 32 heads, 8 kv heads, D 128
    ENGINE=(--requests 16 64 --max-tokens 64)
fi

# test_autotuned_configs_match_reference covers the tuned path
step pytest_cuda 100 "$PY" -m pytest -m cuda -q -p no:cacheprovider \
    --junitxml="$OUT_DIR/pytest_cuda.xml"
step kernels 80 "$PY" benchmarks/kernel_backends.py "${DEV[@]}" "${KERNELS[@]}" --json "$OUT_DIR/kernels.json"
step ring_fwd 70 "$PY" benchmarks/long_ctx.py --virtual 8 "${RING[@]}" --dtype bf16 --layout zigzag --causal \
    --baseline-impl "$BASE" --quiet --json "$OUT_DIR/ring_fwd.json"
step ring_fwd_bwd 90 "$PY" benchmarks/long_ctx.py --virtual 8 "${RING[@]}" --dtype bf16 --layout zigzag --causal \
    --backward --baseline-impl "$BASE" --quiet --json "$OUT_DIR/ring_fwd_bwd.json"
step engine 90 "$PY" benchmarks/engine.py "${DEV[@]}" --dtype bf16 "${ENGINE[@]}" --json "$OUT_DIR/engine.json"

"$PY" benchmarks/gpu_summary.py "$OUT_DIR" || status=1
echo "exit status: $status" | tee -a "$OUT_DIR/summary.md"
exit $status
