#!/usr/bin/env bash
# One prepared run on a CUDA machine: the engine's CUDA path and GPU timings of the demo pair.
#
#   bash bench/gpu_check.sh [OUTDIR]
#
# What the machine needs, and how each step runs: bench/gpu_env.sh.
. "$(dirname "$0")/gpu_env.sh" "$@"

step env 60 bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__)"'
step convert 180 python3 -c "from specdec.loader import load_model; m = load_model('smollm2'); print(m.args)"
step gpu_tests 180 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py
# plain vs n-gram / EAGLE / hybrid, batch 1 and 8, chat and code; "same output" = greedy identity
step engine_bf16 300 python3 -m specdec_tools.bench --device cuda --dtype bfloat16 --draft smollm2-eagle \
  --no-hf --no-self --ks 2,3 --batches 1,8 --prompts 3 --max-tokens 64
step engine_fp32 240 python3 -m specdec_tools.bench --device cuda --dtype float32 --draft smollm2-eagle \
  --no-hf --no-self --ks 3 --batches 1,8 --prompts 3 --max-tokens 64
