#!/usr/bin/env bash
# The wheels scripts/gpu_check.py needs on the GPU machine (docs/gpu.md) that it does not have: Python 3.12,
# torch 2.11 + CUDA 13, transformers, peft, psutil, nvidia-ml-py and tensorboard are there; no network.
#
#   scripts/gpu_wheels.sh [FOLDER]      # default: gpu-wheels/ (ignored by git); prints each wheel's size
#
# - torchao: fp8 training (torchao.float8), QLoRA's NF4 base, int8 / int4 weight-only quantization, 2:4 sparsity.
#   0.18.0 is the release the test suite runs, and it loads its C++ extensions on torch >= 2.11 (none of the checked
#   paths needs one: float8 uses torch._scaled_mm, int4 torch's tinygemm ops, 2:4 torch's cuSPARSELt / CUTLASS).
#   Its wheel is tagged manylinux_2_24/2_28, so manylinux2014 alone would not find it: both platforms are asked.
# - rich (+ markdown-it-py, mdurl, pygments): a scaletrain dependency (plan tables, the progress bar) that
#   transformers does not pull in. tokenizers, safetensors, numpy and psutil come with transformers / the list.
# Installed with --no-index --no-deps --target into a folder put on PYTHONPATH, so nothing already on the machine
# is replaced or resolved again (docs/gpu.md has the command).
set -euo pipefail
DEST="${1:-gpu-wheels}"
mkdir -p "$DEST"
WHEELS=(torchao==0.18.0 rich==14.2.0 markdown-it-py==4.0.0 mdurl==0.1.2 pygments==2.19.2)
python3 -m pip download --quiet --dest "$DEST" --python-version 3.12 --only-binary=:all: \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any --no-deps "${WHEELS[@]}"
du -k "$DEST"/*.whl | sort -k2 | awk '{printf "%8.1f KiB  %s\n", $1, $2; total += $1} END {printf "%8.1f KiB  total\n", total}'
