"""Engine settings read from the environment, in one place."""
import os

# Where converted checkpoints (GGUF -> safetensors) are cached.
CACHE_DIR = os.environ.get("SPECDEC_CACHE_DIR", os.path.expanduser("~/.cache/specdec"))
# torch intra-op threads for model work; 0 = leave torch's default.
NUM_THREADS = int(os.environ.get("SPECDEC_NUM_THREADS", "0"))
