"""Local Hugging Face checkpoints of other architectures: those the runner implements compute what
transformers computes; the rest are refused with a clear error when the app is built, never loaded
to compute something else (Gemma's, Granite's weights have Llama's names)."""
import json
import shutil

import pytest
import torch

from specdec.model import ModelArgs

SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def _config(kind: str, **extra):
    from transformers import AutoConfig
    return AutoConfig.for_model(kind, **{**SMALL, **extra})


def _checkpoint(path, kind: str, **extra):
    """A random-init checkpoint of `kind` with the tiny tokenizer at `path`."""
    from tiny_models import tiny_tokenizer
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(kind, **extra))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)  # biases and norms too: a skipped one shows
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("kind, extra", [
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("llama", {"tie_word_embeddings": True, "head_dim": 32}),
    ("mistral", {"sliding_window": None}),
    ("qwen2", {}),
    ("qwen3", {"head_dim": 32}),
], ids=["llama-rope-llama3", "llama-tied-head-dim", "mistral", "qwen2-biases", "qwen3-qk-norm"])
def test_supported_architectures_match_transformers(tmp_path, kind, extra):
    from specdec.loader import load_hf_model, load_model
    path = _checkpoint(tmp_path, kind, **extra)
    hf, model = load_hf_model(path), load_model(path)
    ids = list(range(3, 40))
    model.setup_cache(1, 64)
    with torch.inference_mode():
        logits, _ = model(torch.tensor([ids]), torch.tensor([0]), torch.tensor([0]), n_logits=len(ids))
        ref = hf(torch.tensor([ids])).logits[0]
    assert torch.allclose(logits[0], ref, atol=1e-4), (logits[0] - ref).abs().max()


@pytest.mark.parametrize("kind, extra, match", [
    ("gemma", {}, "model_type 'gemma' is not supported"),
    ("granite", {}, "model_type 'granite' is not supported"),
    ("gpt2", {}, "model_type 'gpt2' is not supported"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
])
def test_unsupported_architectures_are_refused(kind, extra, match):
    with pytest.raises(ValueError, match=match):
        ModelArgs.from_hf_config(_config(kind, **extra))


def test_an_unsupported_target_or_draft_fails_the_build(tmp_path, tiny_dir, monkeypatch):
    from serve_app.args import AppArgs
    gemma = _checkpoint(tmp_path / "gemma", "gemma")
    with pytest.raises(ValueError, match=f"target {gemma}: model_type 'gemma' is not supported"):
        AppArgs(target=str(gemma), proposer="ngram", dtype="float32").validate_models()
    with pytest.raises(ValueError, match=f"draft {gemma}: model_type 'gemma' is not supported"):
        AppArgs(target=str(tiny_dir), proposer="draft", draft=str(gemma), dtype="float32",
                max_model_len=128).validate_models()
    # the engine alone (specdec-bench, LLMEngine) refuses it from its config too, naming the checkpoint,
    # before its weights load (it loaded them all, then failed without saying which model)
    from specdec import loader

    def no_weights(*a, **kw):
        raise AssertionError("weights loaded before the architecture was checked")
    monkeypatch.setattr(loader, "load_hf_model", no_weights)
    with pytest.raises(loader.ModelLoadError, match=f"{gemma}: model_type 'gemma' is not supported"):
        loader.load_model(gemma)


def test_a_draft_with_fewer_positions_caps_or_refuses_max_model_len(tmp_path, tiny_dir):
    from serve_app.args import AppArgs
    from tiny_models import make_tiny_checkpoint
    short = make_tiny_checkpoint(tmp_path / "short", seed=1, layers=1, max_pos=64)
    with pytest.raises(ValueError, match="handles 64 positions"):
        AppArgs(target=str(tiny_dir), proposer="draft", draft=str(short), dtype="float32",
                max_model_len=128).validate_models()
    AppArgs(target=str(tiny_dir), proposer="draft", draft=str(short), dtype="float32",
            max_model_len=64).validate_models()
    derived = AppArgs(target=str(tiny_dir), proposer="draft", draft=str(short), dtype="float32")
    derived.validate_models()  # max_model_len not given: the draft's limit caps the derived value
    assert derived.max_model_len == 64


def test_sliding_window_attention_bounds_max_model_len(tmp_path):
    """The runner attends over whole contexts: exact for a sliding-window model only while a
    context fits in one window."""
    from serve_app.args import AppArgs
    from specdec.loader import load_model
    from specdec.target_worker import TargetWorker
    path = _checkpoint(tmp_path, "mistral", sliding_window=32)
    args = AppArgs(target=str(path), proposer="ngram", dtype="float32")
    args.validate_models()
    assert args.max_model_len == 32  # derived: capped at the window
    with pytest.raises(ValueError, match="sliding-window span"):
        AppArgs(target=str(path), proposer="ngram", dtype="float32", max_model_len=64).validate_models()
    with pytest.raises(ValueError, match="sliding-window span"):
        TargetWorker(load_model(path), 1, 64)
    assert ModelArgs.from_hf_config(_config("qwen2", use_sliding_window=False, sliding_window=32)).sliding_window is None


def test_weights_the_runner_would_not_use_are_an_error(tiny_dir):
    """A checkpoint with tensors the runner does not map (a feature it does not implement) fails
    to load instead of running without them."""
    from specdec.loader import load_hf_model
    from specdec.model import Transformer
    hf = load_hf_model(tiny_dir)
    hf.model.layers[0].mlp.down_proj.bias = torch.nn.Parameter(torch.zeros(64))
    with pytest.raises(ValueError, match="does not use"):
        Transformer.from_hf(hf)


def test_generation_config_eos_ids_end_generation(tmp_path):
    """EOS ids a checkpoint lists in generation_config.json (e.g. Llama 3.1's <|eom_id|>) stop
    generation like the tokenizer's own."""
    from specdec.engine import eos_ids_of
    from specdec.loader import load_tokenizer
    from tiny_models import make_tiny_checkpoint
    path = make_tiny_checkpoint(tmp_path, seed=0, layers=1)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 108]}))
    assert {0, 108} <= set(eos_ids_of(load_tokenizer(path)))


def test_a_checkpoint_lacking_weights_fails_to_load(tmp_path, tiny_dir):
    """transformers fills weights a checkpoint lacks with random values and only warns: the loader
    refuses (an untied model without its head, a lost tensor, weights saved under another prefix)."""
    from safetensors.torch import load_file, save_file
    from specdec.loader import ModelLoadError, load_model
    state = load_file(str(tiny_dir / "model.safetensors"))
    for name, keep in (("nohead", lambda k: k != "lm_head.weight"),
                       ("nolayer", lambda k: k != "model.layers.1.mlp.down_proj.weight")):
        out = tmp_path / name
        out.mkdir()
        for f in tiny_dir.iterdir():
            if f.name != "model.safetensors":
                (out / f.name).write_bytes(f.read_bytes())
        save_file({k: v for k, v in state.items() if keep(k)}, str(out / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ModelLoadError, match="lacks 1 of the model's weights"):
            load_model(out)
    load_model(tiny_dir)


def test_longrope_is_capped_at_its_original_length(tmp_path):
    """The runner's rotary frequencies are fixed at load: LongRoPE's long factors (used by
    transformers past the original length) never apply, so the context stops there."""
    from serve_app.args import AppArgs
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
            "original_max_position_embeddings": 64}
    assert ModelArgs.from_hf_config(_config("llama", rope_scaling=rope)).max_position_embeddings == 64
    path = _checkpoint(tmp_path, "llama", rope_scaling=rope)
    args = AppArgs(target=str(path), proposer="ngram", dtype="float32", lookup_corpus=None)
    args.validate_models()
    assert args.max_model_len == 64
    with pytest.raises(ValueError, match="exceeds the target's 64 positions"):
        AppArgs(target=str(path), proposer="ngram", dtype="float32", max_model_len=128).validate_models()
    # the engine on its own refuses it too (it computed logits 0.012 off transformers' past 64)
    from specdec.loader import load_model
    from specdec.target_worker import TargetWorker
    with pytest.raises(ValueError, match="exceeds the 64 positions the target computes exactly"):
        TargetWorker(load_model(path), 1, 128)
    # the legacy spelling (Phi-3's): `rope_scaling` with `type` and a top-level original length, for
    # which AutoConfig alone reports the whole max_position_embeddings (the app built, then every
    # Target replica refused its max_model_len)
    legacy = tmp_path / "legacy"
    shutil.copytree(path, legacy)
    cfg = json.loads((legacy / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(rope_theta=10000.0, original_max_position_embeddings=64,
               rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8})
    (legacy / "config.json").write_text(json.dumps(cfg))
    args = AppArgs(target=str(legacy), proposer="ngram", dtype="float32", lookup_corpus=None)
    args.validate_models()
    assert args.max_model_len == 64
    TargetWorker(load_model(legacy), 1, args.max_model_len)


def test_partial_rotary_with_a_scaled_rope_is_refused_at_load(tmp_path):
    """Rotary frequencies over half the head (partial_rotary_factor with a non-default rope type)
    loaded and then failed at the first forward; refused when loading instead."""
    from specdec.loader import load_model
    path = _checkpoint(tmp_path, "llama", partial_rotary_factor=0.5, rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="partial rotary embeddings are not implemented"):
        load_model(path)


def test_vocabularies_are_checked_at_build(tmp_path, tiny_dir):
    """A tokenizer with more tokens than the embeddings, a draft that cannot embed every token or
    proposes ids the target cannot embed, a target without a tokenizer: refused when the app is
    built (before: an IndexError failed every request batched with such a token)."""
    from serve_app.args import AppArgs
    from tiny_models import make_tiny_checkpoint
    small = make_tiny_checkpoint(tmp_path / "small", seed=0, layers=1)
    cfg = json.loads((small / "config.json").read_text())
    n_tok = cfg["vocab_size"]
    (small / "config.json").write_text(json.dumps({**cfg, "vocab_size": n_tok - 8}))
    from safetensors.torch import load_file, save_file
    state = load_file(str(small / "model.safetensors"))
    save_file({k: v[: n_tok - 8] if k in ("model.embed_tokens.weight", "lm_head.weight") else v
               for k, v in state.items()}, str(small / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"tokenizer has {n_tok} tokens, more than its {n_tok - 8} embeddings"):
        AppArgs(target=str(small), proposer="ngram", dtype="float32", lookup_corpus=None).validate_models()
    with pytest.raises(ValueError, match=f"has {n_tok - 8} embeddings: it must embed every token"):
        AppArgs(target=str(tiny_dir), proposer="draft", draft=str(small), dtype="float32",
                max_model_len=128).validate_models()
    notok = tmp_path / "notok"
    notok.mkdir()
    for name in ("config.json", "model.safetensors"):
        (notok / name).write_bytes((tiny_dir / name).read_bytes())
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        AppArgs(target=str(notok), proposer="ngram", dtype="float32", lookup_corpus=None).validate_models()


def test_the_engine_checks_a_pair_without_the_service(tiny_dir, tiny_draft_dir, tiny_eagle_dir):
    """`specdec.check_models` (no Ray, no serve_app): what each draft's cache needs per position,
    and the refusals the service's build reports come from it."""
    from specdec import check_models
    from transformers import AutoConfig
    target = ModelArgs.from_hf_config(AutoConfig.from_pretrained(tiny_dir))
    draft = ModelArgs.from_hf_config(AutoConfig.from_pretrained(tiny_draft_dir))
    eagle = json.loads((tiny_eagle_dir / "config.json").read_text())
    assert check_models(str(tiny_dir)).draft_kv_bytes == 0
    fit = check_models(str(tiny_dir), str(tiny_eagle_dir), "hybrid", dtype="bfloat16")
    assert fit.target == target and fit.draft_positions is None
    assert fit.draft_kv_bytes == eagle["num_hidden_layers"] * 2 * eagle["num_key_value_heads"] * eagle["head_dim"] * 2
    fit = check_models(str(tiny_dir), str(tiny_draft_dir), "draft")
    assert (fit.draft_kv_bytes, fit.draft_positions) == (draft.kv_bytes_per_token(4), draft.max_position_embeddings)
    assert check_models(str(tiny_dir), proposer="self", self_draft_layers=1).draft_kv_bytes == target.kv_bytes_per_token(4) // 2
    with pytest.raises(ValueError, match="self_draft_layers=2 must be below the target's 2 layers"):
        check_models(str(tiny_dir), proposer="self", self_draft_layers=2)
    with pytest.raises(ValueError, match=f"tp=3 cannot shard target {tiny_dir}"):
        check_models(str(tiny_dir), tp=3)
    with pytest.raises(ValueError, match="needs an EAGLE-style draft"):
        check_models(str(tiny_dir), str(tiny_draft_dir), "eagle")
    with pytest.raises(ValueError, match="needs draft=PATH"):
        check_models(str(tiny_dir), None, "hybrid")
    with pytest.raises(ValueError, match="does not fit target"):  # trained for another hidden size
        check_models(str(tiny_draft_dir), str(tiny_eagle_dir), "eagle")


def test_max_model_len_is_checked_at_the_exact_boundaries(tiny_dir):
    """One position past a sliding window, or past the positions a model computes exactly, is
    refused; exactly at them is fine."""
    import dataclasses

    from specdec.loader import load_model
    from specdec.target_worker import TargetWorker
    target = load_model(tiny_dir)
    limit = target.args.max_position_embeddings
    TargetWorker(target, 1, limit)
    with pytest.raises(ValueError, match="computes exactly"):
        TargetWorker(target, 1, limit + 1)
    target.args = dataclasses.replace(target.args, sliding_window=32)
    TargetWorker(target, 1, 32)
    with pytest.raises(ValueError, match="sliding-window span"):
        TargetWorker(target, 1, 33)
