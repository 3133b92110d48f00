"""Prompt encoding shared by the engine's benchmark and the service: chat templates and plain text."""
from __future__ import annotations


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` through the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def encode_text(tokenizer, text: str) -> list[int]:
    return tokenizer(text).input_ids
