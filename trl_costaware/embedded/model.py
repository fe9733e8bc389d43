"""A tiny randomly initialised Llama-shaped causal LM, saved like a hub checkpoint."""

from __future__ import annotations

import os

from ._cache import cache_root, cached_build
from .tokenizer import build_tokenizer

# Bump when the architecture or tokenizer changes, so stale cache entries are not reused.
MODEL_VERSION = "v1"

MODEL_KWARGS = dict(
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=256,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)


def build_tiny_model(seed: int = 0):
    """(model, tokenizer) built in memory; the weights depend only on `seed`."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **MODEL_KWARGS,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    return model, tokenizer


def tiny_model_path(cache_dir: str | os.PathLike | None = None, *, seed: int = 0) -> str:
    """Directory of a tiny random causal LM + character tokenizer; loads with `AutoModelForCausalLM`/`AutoTokenizer`.

    Built once per `seed` and cached under `cache_dir`, else ``$TRL_COSTAWARE_CACHE``, else ``~/.cache/trl_costaware``.
    """

    def build(out: str) -> None:
        model, tokenizer = build_tiny_model(seed)
        tokenizer.save_pretrained(out)
        model.save_pretrained(out)

    return cached_build(cache_root(cache_dir), f"tiny-llama-{MODEL_VERSION}-seed{seed}", build)
