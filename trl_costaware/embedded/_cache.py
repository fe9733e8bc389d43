"""Build-once, atomic, process-safe cache directories."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

ENV_VAR = "TRL_COSTAWARE_CACHE"
_COMPLETE = "config.json"  # every cached entry is a saved model directory


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir`, else ``$TRL_COSTAWARE_CACHE``, else ``~/.cache/trl_costaware``."""
    root = cache_dir or os.environ.get(ENV_VAR) or Path.home() / ".cache" / "trl_costaware"
    return Path(root).expanduser()


@contextlib.contextmanager
def _file_lock(path: Path):
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: rely on the atomic rename alone
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def cached_build(root: Path, name: str, build: Callable[[str], None]) -> str:
    """Return ``root/name``, calling ``build(tmp_dir)`` first if it does not exist yet.

    The entry is written into a temporary sibling and renamed into place, so a reader never sees a half-written
    directory; a lock file makes concurrent processes wait for one build instead of all building. Temporary
    siblings of `name` left by a build that was killed (``.{name}.tmp-*``; 517 MB for SmolLM2) are removed under the
    lock, where no build of `name` can be running.
    """
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    if (final / _COMPLETE).exists():
        return str(final)
    with _file_lock(root / f".{name}.lock"):
        for stale in root.glob(f".{name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if (final / _COMPLETE).exists():  # built by another process while we waited
            return str(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
        try:
            build(str(tmp))
            if final.exists():  # a stale, incomplete entry
                shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        except OSError:
            if not (final / _COMPLETE).exists():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(final)
