#!/usr/bin/env bash
# One short run on a lent GPU machine (one H200, Python 3.12, no network), under 10 minutes:
#   1. install the wheels carried in .whl/ (tests/gpu/fetch_wheels.sh made them) next to the image's torch;
#   2. the gpu-marked test: the example trainer on CUDA executors (inductor, NCCL), loss and accuracy;
#   3. a one-executor training benchmark: the example's 300 steps on one CUDA executor, tokens/s.
# Logs go to $OUT (the device tool brings them back). The CPU suite never depends on this script.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/pathways-gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed" | tee "$OUT/summary.txt"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATHWAYS_CACHE_DIR=/tmp/pathways-cache
{
    echo "== machine"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python3 -c "import sys, torch, jax; print('python', sys.version.split()[0], 'torch', torch.__version__, 'jax', jax.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$OUT/summary.txt"
echo "== 2. gpu test" | tee -a "$OUT/summary.txt"
timeout 420 python3 -m pytest -m gpu -q -p no:cacheprovider tests/integration/test_training_gpu.py 2>&1 | tee "$OUT/gpu_test.log" \
    | tail -n 3 | tee -a "$OUT/summary.txt"
echo "== 3. one-executor benchmark (example trainer, 300 steps, cuda:0, inductor)" | tee -a "$OUT/summary.txt"
began=$(date +%s.%N)
timeout 150 python3 examples/train_transformer.py --device cuda --executors 1 --steps 300 \
    --checkpoint /tmp/pathways-ckpt > "$OUT/bench.log" 2> "$OUT/bench.err"
echo "rc=$? wall_s=$(python3 -c "print(round($(date +%s.%N) - $began, 1))")" | tee -a "$OUT/summary.txt"
grep -E "^(backend|loss|held-out)" "$OUT/bench.log" | tee -a "$OUT/summary.txt"
tr '\r' '\n' < "$OUT/bench.err" | grep -o 'tok_s=[0-9,]*' | tail -n 1 | tee -a "$OUT/summary.txt"
