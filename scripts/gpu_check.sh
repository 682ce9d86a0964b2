#!/usr/bin/env bash
# The checks that need a GPU, as one run on a lent CUDA machine (its own python3 with torch and
# transformers; nothing is installed). Writes logs under $OUT (or ./gpu-out).
#   1. tests/worker/test_cuda.py: greedy tokens against HF transformers on CUDA (paged, radix,
#      float32 and bfloat16, preemption), skipped on machines without a GPU.
#   2. `inferplane bench engine --tinyllama`: a 1.1B random Llama in bfloat16, our engine against
#      HF generate_batch and generate, with the fraction of the memory-bandwidth bound reached.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1
nvidia-smi -L | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$out/gpu.txt"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -s -p no:cacheprovider -o addopts="" tests/worker/test_cuda.py \
    2>&1 | tee "$out/cuda_tests.log"
timeout "${BENCH_TIMEOUT:-300}" python3 -m inferplane.cli bench engine --tinyllama --hf-batch-size 64 \
    2>&1 | tee "$out/bench_engine.log"
