#!/usr/bin/env bash
# The checks that need a GPU, as one run on a lent CUDA machine (its own python3 with torch, Triton
# and transformers; nothing is installed). Writes logs under $OUT (or ./gpu-out).
#   1. tests/worker/test_cuda.py: the Triton paged decode kernel against attention by hand, and
#      greedy tokens against HF and between graphs and eager (paged, radix, float32 and bfloat16,
#      preemption and chunked prefill, Gemma 2/3 and Qwen3 shapes);
#   2. `inferplane bench engine --tinyllama --compare-eager`: a 1.1B random Llama in bfloat16, our
#      engine with CUDA graphs at batches 1, 16 and 256 (fraction of the memory-bandwidth bound at
#      each), the same without graphs, and HF generate_batch;
#   3. scripts/profile_engine.py at batch 256, eager then with graphs, and at batch 1 with graphs:
#      where a step's time goes.
# Each part has its own timeout (seconds, from the environment) so that one stuck part leaves the rest.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1
nvidia-smi -L | tee "$out/gpu.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -s -p no:cacheprovider -o addopts="" --timeout 120 \
    tests/worker/test_cuda.py 2>&1 | tee "$out/cuda_tests.log"
timeout "${BENCH_TIMEOUT:-240}" python3 -m inferplane.cli bench engine --tinyllama --compare-eager --skip generate \
    2>&1 | tee "$out/bench_engine.log"
for run in "256 --enforce-eager" "256" "1"; do
    set -- $run
    timeout "${PROFILE_TIMEOUT:-60}" python3 scripts/profile_engine.py --tinyllama --steps 4 --batch "$@" \
        2>&1 | tee -a "$out/profile.log"
done
