"""Tiny random-init checkpoints for tests: a real Hugging Face directory (config, safetensors,
tokenizer) built in about a second, so tests exercise the same loading path as real models.

The tokenizer is a byte-level BPE trained on a slice of the standard library's source with a
ChatML template; its small vocabulary keeps the models tiny. Weights are drawn with a larger init
scale than training would use so that logits are peaked (random models otherwise produce
near-ties that make "greedy output" ill-defined at float32 resolution).
"""
from __future__ import annotations

import functools
import inspect
import json
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    import json as json_mod
    import textwrap
    corpus = [inspect.getsource(m) for m in (json_mod, textwrap, functools)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return tok.to_str()


def tiny_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    t = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
                                eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    t.chat_template = CHAT_TEMPLATE
    return t


def tiny_config(vocab_size: int = 512, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                intermediate: int = 128, max_pos: int = 1024):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=max_pos, rope_theta=10000.0, tie_word_embeddings=False,
                       bos_token_id=None, eos_token_id=0, pad_token_id=0)


def make_tiny_checkpoint(path: str | Path, seed: int = 0, init_scale: float = 0.15, vocab_size: int = 512,
                         **cfg) -> Path:
    """Write a random-init Llama checkpoint with the tiny tokenizer to `path`; returns it."""
    from transformers import LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").is_file():
        return path
    tok = tiny_tokenizer(vocab_size)
    config = tiny_config(vocab_size=len(tok), **cfg)
    config.eos_token_id = tok.eos_token_id
    config.pad_token_id = tok.pad_token_id
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, init_scale)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "specdec_tiny.json").write_text(json.dumps({"seed": seed, "init_scale": init_scale, **cfg}))
    return path
