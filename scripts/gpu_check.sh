#!/usr/bin/env bash
# Everything that needs a GPU, in one run (about 6 minutes on an H200): the CUDA tests (Triton tree
# kernels, the fused TTT attention, a whole TTT unroll against the CPU's), the kernel and TTT-step
# benchmarks, the smoke pipeline end to end on the GPU, and its head served by vLLM where it is
# installed. Logs go to $OUT (default gpu_check/).
#   bash scripts/gpu_check.sh
set -uo pipefail
OUT=${OUT:-gpu_check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled
PY=${PYTHON:-python3}
status=0

step() {  # step <name> <timeout seconds> <command...>: runs it, logs it, remembers a failure
    local name=$1 limit=$2
    shift 2
    echo "=== $name"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.log"
    echo "=== $name: rc $rc, $((SECONDS - t0)) s"
    [ $rc -eq 0 ] || status=1
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
step tests 300 $PY -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_ttt.py tests/test_train_pack.py \
    tests/test_verify.py tests/test_tree.py
step bench_kernels 120 $PY benchmarks/verify.py --batches 1,8,64 --nodes 8,32,64 --vocab 32000
step bench_ttt_smollm2 150 $PY benchmarks/ttt.py --device cuda --scale smollm2 --seq 2048 --repeats 3
step bench_ttt_llama8b 200 $PY benchmarks/ttt.py --device cuda --scale llama8b --seq 4096 --repeats 3
step smoke_pipeline 200 $PY train.py +exp=smoke run_root="$OUT/runs"
grep -h "tau\|speedup\|lossless" "$OUT/runs/smoke/eval/summary.md" 2>/dev/null | head -8
# The smoke head served by the CUDA vLLM build (where this machine has one): its counters beside our chain's.
if $PY -c "import vllm" 2>/dev/null; then
    step engine_vllm 300 $PY commands/engine.py head="$OUT/runs/smoke/ckpt/best" target=random limit=2 max_new_tokens=16 \
        eval.engine.python="$(command -v $PY)" out="$OUT/engine"
else
    echo "=== engine_vllm: skipped, vllm is not importable here"
fi
exit $status
