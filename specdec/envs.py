"""Engine settings read from the environment, in one place."""
import os

# Where converted checkpoints (GGUF -> safetensors) are cached.
CACHE_DIR = os.environ.get("SPECDEC_CACHE_DIR", os.path.expanduser("~/.cache/specdec"))
# torch intra-op threads for model work; 0 = leave torch's default.
NUM_THREADS = int(os.environ.get("SPECDEC_NUM_THREADS", "0"))
# Multiply CPU linear layers with oneDNN's prepacked weights (specdec.model.PackedWeight); 0 = plain
# F.linear (and no second copy of the weights).
PACK_WEIGHTS = os.environ.get("SPECDEC_PACK_WEIGHTS", "1") not in ("0", "false", "False", "")
# Positions per forward when a row feeds many tokens (a prompt): chunked prefill (specdec.runner).
PREFILL_CHUNK = int(os.environ.get("SPECDEC_PREFILL_CHUNK", "128"))
