"""A tiny randomly initialised Llama-shaped causal LM, saved like a hub checkpoint."""

from __future__ import annotations

import os
import shutil

from . import shipped
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


def write_model_dir(
    out: str, weights: str | os.PathLike | None = None, *, seed: int = 0, trained: bool = False
) -> None:
    """Save the tiny model's config, generation config and tokenizer to `out`, with `build_tiny_model(seed)`'s weights
    or, given `weights`, that ``model.safetensors`` copied byte for byte. `trained`: the config a warm-up's
    ``save_pretrained`` writes (``use_cache`` false, as the SFT trainer leaves it), so a shipped warm model's
    directory matches the one its warm-up saved."""
    model, tokenizer = build_tiny_model(seed)
    if trained:
        model.config.use_cache = False
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    if weights is not None:
        shutil.copyfile(weights, os.path.join(out, "model.safetensors"))


def shipped_model_path(root, name: str, *, trained: bool) -> str:
    """The cache entry ``root/<name>-shipped-<sha>`` holding the packaged weights `name` (`shipped.SHIPPED`), checked
    against their SHA-256 on every call (an entry that does not match is rebuilt from the package)."""
    entry = shipped.cache_name(name)

    def build(out: str) -> None:
        write_model_dir(out, shipped.weights_path(name), trained=trained)

    path = cached_build(root, entry, build)
    if not shipped.cached_entry_matches(path, name):
        shutil.rmtree(path, ignore_errors=True)
        path = cached_build(root, entry, build)
        if not shipped.cached_entry_matches(path, name):
            raise shipped.ShippedWeightsError(f"{path} does not hold the shipped weights {name!r}")
    return path


def tiny_model_path(cache_dir: str | os.PathLike | None = None, *, seed: int = 0, rebuild: bool | None = None) -> str:
    """Directory of a tiny random causal LM + character tokenizer; loads with `AutoModelForCausalLM`/`AutoTokenizer`.

    Seed 0 is the packaged initial weights (`shipped.py`), the same on every machine; other seeds, and seed 0 with
    `rebuild` (default ``$TRL_COSTAWARE_REBUILD``), are `build_tiny_model(seed)` on this machine. Cached under
    `cache_dir`, else ``$TRL_COSTAWARE_CACHE``, else ``~/.cache/trl_costaware``.
    """
    root = cache_root(cache_dir)
    if seed == 0 and not shipped.rebuild_requested(rebuild):
        return shipped_model_path(root, "tiny", trained=False)

    def build(out: str) -> None:
        write_model_dir(out, seed=seed)

    return cached_build(root, f"tiny-llama-{MODEL_VERSION}-seed{seed}", build)
