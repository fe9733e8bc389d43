#!/usr/bin/env bash
# Run on a machine WITH PyPI access, in the repo root, before a GPU session on a machine WITHOUT it (the device
# machines lent here have Python 3.12, CUDA torch, accelerate, tokenizers, safetensors, numpy, pandas, but not TRL).
# Downloads the pure-Python wheels the package needs into .whl/ (ignored by git), about 20 MB; pyarrow (~45 MB) is
# left out unless WITH_PYARROW=1: `benchmarks/gpu/run_on_device.sh` says when the machine's pyarrow is too old.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
PKGS=(
    trl==1.16.0 transformers==5.24.0 datasets==5.2.0 huggingface_hub==2.4.0 peft==0.21.2
    dill==0.4.1 multiprocess==0.70.19 fsspec==2026.9.0 httpx2==2.16.2 httpcore2==2.16.2 click==8.5.1
    regex==2026.11.19 typer==0.29.2 hf-xet==1.8.0
    math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
)
[[ "${WITH_PYARROW:-0}" == 1 ]] && PKGS+=(pyarrow==26.0.1)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${PKGS[@]}"
du -sh .whl
