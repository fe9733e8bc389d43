#!/usr/bin/env bash
# The one prepared GPU check (run on the device machine from the repo root, with .whl carried; see
# benchmarks/gpu/prepare_wheels.sh). Writes everything under $OUT (default: benchmarks/results/gpu):
#   versions.txt   device, driver, torch/CUDA/transformers/TRL versions
#   test_gpu.log   `pytest -m gpu tests/test_gpu.py` (bf16 runs, CUDA Monte Carlo)
#   step_profile.* benchmarks/step_profile.py on Qwen2.5-0.5B shapes (random weights), GRPO vs Cost-Aware GRPO
# Each part has its own time limit, so one hang cannot eat the whole lease. Total well under 10 minutes.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled \
    TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 - <<'PY'
import importlib.metadata as md
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
for name in ("transformers", "trl", "accelerate", "peft", "datasets", "pyarrow", "huggingface_hub", "math-verify"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "MISSING")
import trl_costaware  # noqa: F401  (fails here, with the reason, if a dependency is missing or too old)
print("trl_costaware imports")
PY
} 2>&1 | tee "$OUT/versions.txt"
[[ ${PIPESTATUS[0]} -eq 0 ]] || { echo "setup failed: see versions.txt"; exit 1; }
timeout 300 python3 -m pytest -p no:cacheprovider -p no:xdist -m gpu -rs -q tests/test_gpu.py 2>&1 | tee "$OUT/test_gpu.log"
if [[ -f benchmarks/step_profile.py ]]; then
    timeout 200 python3 benchmarks/step_profile.py --config qwen2.5-0.5b --bf16 --out "$OUT/step_profile" 2>&1 \
        | tee "$OUT/step_profile.log"
fi
