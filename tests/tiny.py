"""Tiny random-weight Hugging Face models with a real tokenizer, built in code (no download)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A KV cache stores keys and values of past tokens so decoding does not recompute them.",
    "Jetson Orin boards share memory between the CPU and the GPU.",
    "Hello! How are you today? I am fine, thank you. What is the capital of France? Paris.",
] * 20


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "<|im_end|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<s>", unk_token="<unk>"
    )
    fast.chat_template = CHATML
    return fast


def tiny_config(family: str, **overrides):
    common = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        eos_token_id=2,
        bos_token_id=1,
        tie_word_embeddings=True,
    )
    common.update(overrides)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**{**common, "tie_word_embeddings": overrides.get("tie_word_embeddings", False)})
    if family == "mistral":
        return MistralConfig(**{**common, "sliding_window": None})
    raise ValueError(family)


def make_tiny_model(folder: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a random-weight model of `family` plus tokenizer into `folder`; return it."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    with torch.no_grad():  # random init is small; widen it so logits are far from uniform
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else None
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder
