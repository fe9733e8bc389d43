"""The embedded models' weights, shipped with the package so that every machine gets the same bytes.

The warm-ups in `warmup.py` are the recipes that made these files. Rebuilt on another machine they need not give the
same model: float kernels round differently from one CPU to another (AVX-512 or AVX2 or plain vector code, MKL's
code path for the CPU), the long recipe amplifies a one-ulp difference into a different testbed, and even the random
initialisation differs in the last bit where torch's normal sampler takes another code path (docs/embedded.md).
So the testbeds load these files, each checked against the SHA-256 below,
and the recipe is run only when asked: ``rebuild=True`` in `warmed_up_model_path` / `tiny_model_path`, or
``TRL_COSTAWARE_REBUILD=1`` in the environment.

The files are exactly what ``save_pretrained`` wrote on an AMD EPYC with AVX-512 (torch 2.13.0+cpu, transformers
5.24.0, trl 1.16.0, one thread), where these recipes rebuild bit for bit: `tiny` is `build_tiny_model(0)`, `default`
and `long` are the `WARMUP_RECIPES` of those names at seed 0 and their default step counts, built from `tiny`. On an
AVX2-only CPU the long recipe gives another testbed (docs/embedded.md); the default one gives the same bits.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

REBUILD_ENV = "TRL_COSTAWARE_REBUILD"
WEIGHTS_DIR = "weights"


@dataclass(frozen=True)
class ShippedWeights:
    """One packaged ``model.safetensors``: its file name under ``embedded/weights/`` and its SHA-256."""

    file: str
    sha256: str


SHIPPED = {
    "tiny": ShippedWeights(
        "tiny-llama-v1-seed0.safetensors", "330c8f90ff66bcf428175cac57d48f5862c495b8d45d20deb0cb584bd8b5e3dd"
    ),
    "default": ShippedWeights(
        "warm-v1v2-default-seed0-steps1000.safetensors",
        "661a649f99b8f232a6733efacba584ae39cdaf0839ff5ae0053a7ba01210db3b",
    ),
    "long": ShippedWeights(
        "warm-v1v2-long-seed0-steps1200.safetensors",
        "b7dfebc69709845d9662dc8b4167bb38ef96a2de6d54f809e1899745fcc466df",
    ),
}


class ShippedWeightsError(RuntimeError):
    """A packaged weights file is missing or does not match its recorded checksum (a broken install)."""


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes, as hex."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def rebuild_requested(rebuild: bool | None = None) -> bool:
    """`rebuild` if given, else whether ``$TRL_COSTAWARE_REBUILD`` is set to 1/true/yes."""
    if rebuild is not None:
        return bool(rebuild)
    return os.environ.get(REBUILD_ENV, "").strip().lower() in ("1", "true", "yes")


def weights_path(name: str) -> Path:
    """The packaged weights file of `name` (a `SHIPPED` key), after checking its SHA-256."""
    if name not in SHIPPED:
        raise ValueError(f"shipped weights are one of {sorted(SHIPPED)}, got {name!r}")
    path = Path(__file__).resolve().parent / WEIGHTS_DIR / SHIPPED[name].file
    if not path.is_file():
        raise ShippedWeightsError(
            f"{path} is missing: the package was installed without its data files (reinstall trl-costaware, or set "
            f"{REBUILD_ENV}=1 to build the embedded models from their recipes)"
        )
    got = file_sha256(path)
    if got != SHIPPED[name].sha256:
        raise ShippedWeightsError(f"{path} has SHA-256 {got}, expected {SHIPPED[name].sha256}: a corrupted install")
    return path


def cache_name(name: str) -> str:
    """The cache directory of the shipped `name`: its own name (never a rebuild's) with the checksum in it, so an
    entry built from other weights, or by an older version's recipe, is never taken for it."""
    return f"{Path(SHIPPED[name].file).stem}-shipped-{SHIPPED[name].sha256[:12]}"


def cached_entry_matches(directory: str | os.PathLike, name: str) -> bool:
    """Whether a cache entry holds exactly the shipped weights of `name`."""
    path = Path(directory) / "model.safetensors"
    return path.is_file() and file_sha256(path) == SHIPPED[name].sha256
