"""Service settings read from the environment, in one place."""
from __future__ import annotations

import os

# API keys: comma-separated in SPECDEC_API_KEYS, or one per line in the file SPECDEC_API_KEYS_FILE.
API_KEYS_ENV = "SPECDEC_API_KEYS"
API_KEYS_FILE_ENV = "SPECDEC_API_KEYS_FILE"
# Log prompts and completions (off by default: request logs never contain them).
DEBUG_LOG_PROMPTS = os.environ.get("SPECDEC_DEBUG_LOG_PROMPTS", "0") == "1"
# proposer=auto: what the demo target gets with its shipped draft (the fastest measured, see
# BENCHMARKS.md); other targets get prompt lookup, which needs no weights.
AUTO_PROPOSER_WITH_DRAFT = os.environ.get("SPECDEC_AUTO_PROPOSER", "hybrid")
AUTO_PROPOSER_WITHOUT_DRAFT = "ngram"
# How long a Router replica that Serve stops (a redeploy, a scale-in) may take to finish the streams
# it serves before it is killed (Serve's default, 20 s, cut every longer answer without an end).
ROUTER_DRAIN_S = float(os.environ.get("SPECDEC_ROUTER_DRAIN_S", "300"))


def load_api_keys(*files: str | None) -> list[str]:
    """Keys from SPECDEC_API_KEYS, SPECDEC_API_KEYS_FILE and `files` (one key per line, '#' comments)."""
    keys = [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
    for path in (os.environ.get(API_KEYS_FILE_ENV), *files):
        if path:
            with open(path, encoding="utf-8") as f:
                keys += [k for line in f if (k := line.strip()) and not k.startswith("#")]
    return keys
