#!/usr/bin/env bash
# Every GPU check in one run, each under its own time limit, logs under $OUT (or ./gpu_out):
#   bash benchmarks/gpu_checks.sh                  # all of them (about 8 minutes on an H200)
#   bash benchmarks/gpu_checks.sh test_gpu replay  # only those named
# On an H200 (torch 2.11, 2026-11-27): test_gpu 75-81 s, memory 18-22 s, replay 23-31 s, compiled_stats 19-23 s;
# compiled_gpt2, overhead and budget ran past their limits before printing a table (their sizes want cutting);
# overhead now prints each workload's row as it is measured (a compiled workload's Triton compile is most of its time).
# On a machine with torch and CUDA but no network: the package runs from src/ (PYTHONPATH).
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/tests:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # cuBLAS reproducible, for the checks under deterministic algorithms
CHOSEN=" $* "
check() {  # check NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    [[ "$CHOSEN" == "  " || "$CHOSEN" == *" $name "* ]] || return 0
    echo "=== $name (limit ${limit}s)"
    local start=$SECONDS
    timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "=== $name: exit $? after $((SECONDS - start))s"; tail -n 25 "$OUT/$name.log"
}
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
check test_gpu 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -rs
check compiled_gpt2 170 python3 benchmarks/compiled_gpt2.py --device cuda --steps 12 --deterministic
check between 90 python3 benchmarks/between_samples.py --device cuda --rounds 3 --steps 100
check overhead 240 python3 benchmarks/overhead.py --device cuda --compile --configs defaults --workloads tfm-tiny,tfm,cnn --rounds 5 --wandb-rounds 0
check budget 60 python3 benchmarks/budget.py --device cuda --workloads tfm,tfm-tiny,cnn,gpt --budgets default --steps 400 --block 25
check memory 45 python3 benchmarks/memory.py --device cuda
check replay 45 python3 benchmarks/replay.py --device cuda --rounds 3
check compiled_stats 30 python3 benchmarks/compiled_stats.py --device cuda
