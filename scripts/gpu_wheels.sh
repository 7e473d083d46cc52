#!/usr/bin/env bash
# Wheels for running `python3 -m scripts.gpu_checks` on a GPU machine that has torch and
# transformers but no network and none of our other packages (Python 3.12, x86-64 Linux).
# Run it where pip can reach the package index; it fills .whl/ (ignored by git). There:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site python3 -m scripts.gpu_checks
# megatron-core (the megatron_tp part) is a few MB; pyzmq, msgpack, omegaconf and cryptography
# (with cffi, pycparser) let the project's other modules import. vLLM's CUDA build is far too large to carry this way: the vllm_sync
# and grpo parts need a machine where it is installed (`make setup` with network).
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}
mkdir -p .whl
for pkg in megatron-core==0.16.1 pyzmq msgpack omegaconf cryptography cffi pycparser; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$pkg"
done
ls -l .whl
