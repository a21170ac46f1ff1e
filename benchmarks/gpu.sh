#!/usr/bin/env bash
# One prepared accelerator run (about 6 minutes on an H100): scoring and merging at Qwen3-4B,
# Llama-3-8B and Llama-3-70B shapes against the device's bandwidth floor, and the training-step
# and evaluation throughput of CLIP ViT-B/32 and a Qwen3-4B-shaped decoder in bf16. Writes
# ${OUT:-benchmarks/results}/gpu_<device>.json (see benchmarks/gpu.py for every field).
# Extra arguments go to gpu.py (e.g. --budget-s 200 --merge-methods ta).
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${OUT:-benchmarks/results}"
mkdir -p "$dest"
kind=$(python -c 'import jax; print(jax.devices()[0].device_kind.replace(" ", "_"))')
exec python benchmarks/gpu.py --out "$dest/gpu_${kind}.json" "$@"
