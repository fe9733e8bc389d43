"""Reading runs for `trl-costaware compare`: a run's local record, or W&B runs through the W&B API.

- Local: a run's ``output_dir`` (``cost_aware_metrics.jsonl`` + ``cost_aware_run.json``, written by every run,
  baseline included, W&B or not), the JSONL file itself, or a folder holding several run dirs (searched).
- Online W&B: ``entity/project/run_id`` (or a run URL), or a whole group, ``entity/project/groups/NAME`` (or the
  group's URL), through ``wandb.Api()``. An offline W&B run becomes readable this way after ``wandb sync``.

W&B's binary ``.wandb`` files are not read: the JSONL record holds the same rows, in the run's output dir, and
decoding W&B's internal format would break whenever W&B changes it.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from .._extras import require
from ..names import BASELINE_ARM, COST_AWARE_ARM, METRICS_FILE, RUN_FILE

X_ALIASES = {
    "policy_tokens": "cost_aware/policy_tokens",
    "tokens": "cost_aware/policy_tokens",
    "policy_tokens_padded": "cost_aware/policy_tokens_padded",
    "generated_tokens": "cost_aware/generated_tokens",
    "rollout_tokens": "cost_aware/rollout_tokens",
    "wall": "wall_time",
    "time": "wall_time",
}


WANDB_HINT = (
    f"; W&B offline run files are not read: pass the run's output dir (its {METRICS_FILE} holds the same rows), "
    "or `wandb sync` the run and pass entity/project/run_id"
)


class CompareError(Exception):
    """A problem with the inputs, reported as one line by the command."""


@dataclass
class RunHistory:
    name: str
    source: str
    kind: str  # "local", "wandb-online"
    rows: list[dict[str, Any]]  # keys as the trainer logs them: "reward", "eval_reward", "cost_aware/policy_tokens"
    info: dict[str, Any] = field(default_factory=dict)  # run_name, group, arm, seed, cost_aware, config, ...
    label: str | None = None


def canonical_key(key: str) -> str:
    """A metric name as the trainer logs it, from a W&B key (``train/reward`` -> ``reward``, ``eval/reward`` ->
    ``eval_reward``, ``train/global_step`` -> ``step``, ``_runtime`` -> ``wall_time``) or a trainer key (unchanged)."""
    special = {"train/global_step": "step", "train/epoch": "epoch", "_runtime": "wall_time", "_timestamp": "time"}
    if key in special:
        return special[key]
    for prefix, repl in (("train/", ""), ("eval/", "eval_"), ("test/", "test_")):
        if key.startswith(prefix):
            return repl + key[len(prefix) :]
    return key


def canonical_x(name: str) -> str:
    return canonical_key(X_ALIASES.get(name, name))


def default_arm(info: dict) -> str:
    """The run's arm: its recorded ``arm``, else ``cost_aware`` when it ran with ``cost_aware=True``, else
    ``baseline``."""
    arm = info.get("arm")
    if arm in (BASELINE_ARM, COST_AWARE_ARM):
        return arm
    cost_aware = info.get("cost_aware")
    if cost_aware is None:
        cost_aware = (info.get("config") or {}).get("cost_aware")
    return COST_AWARE_ARM if cost_aware else BASELINE_ARM


# ---------------------------------------------------------------------------------------------------- local dirs
def read_local_run(path: str) -> RunHistory:
    """A run dir with ``cost_aware_metrics.jsonl`` (or the file itself)."""
    folder = os.path.dirname(path) if os.path.isfile(path) else path
    metrics_path = path if os.path.isfile(path) else os.path.join(folder, METRICS_FILE)
    rows = []
    with open(metrics_path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                if line_no == 1 or fh.read(1):  # a torn last line (run still writing / killed) is skipped quietly
                    raise CompareError(f"{metrics_path}:{line_no}: not JSON ({err})") from err
    info = {}
    info_path = os.path.join(folder, RUN_FILE)
    if os.path.exists(info_path):
        with open(info_path, encoding="utf-8") as fh:
            info = json.load(fh)
    name = os.path.basename(os.path.normpath(folder)) or info.get("run_name") or folder
    return RunHistory(name=name, source=folder, kind="local", rows=rows, info=info)


_BOOKKEEPING = frozenset({"step", "epoch", "wall_time", "time", "split", "_step"})


def _row_split(row: dict) -> str:
    """A row's split: its ``split`` (local record), else from its keys (W&B rows carry none)."""
    if row.get("split"):
        return row["split"]
    if "train_runtime" in row:
        return "summary"
    return "eval" if any(k.startswith("eval_") for k in row) else "train"


def duplicated_steps(rows: list[dict[str, Any]]) -> dict[str, int] | None:
    """How many train steps a record logged more than once: ``{"steps": repeated steps, "train_steps": distinct
    train steps, "max_copies": the most rows one step has}``, or None when every train step is logged once.

    A run logs each step's train row once (a resume drops the rows after its checkpoint before logging them again);
    eval and summary rows may share a train row's step. Repeated train steps mean several writers: a duplicated
    launch (``WORLD_SIZE`` processes each training a world of 1, `trl_costaware.tracking.launch`) or two runs
    sharing one output dir."""
    counts: dict[Any, int] = {}
    for row in rows:
        step = row.get("step")
        has_metric = any(k not in _BOOKKEEPING for k in row)  # not e.g. a W&B row of a completions table alone
        if isinstance(step, (int, float)) and has_metric and _row_split(row) == "train":
            counts[step] = counts.get(step, 0) + 1
    repeated = [n for n in counts.values() if n > 1]
    if not repeated:
        return None
    return {"steps": len(repeated), "train_steps": len(counts), "max_copies": max(repeated)}


# ---------------------------------------------------------------------------------------------------- W&B online
_HOST = r"^(?:https?://[^/]+/)?([^/\s]+)/([^/\s]+)/"
_TAIL = r"/?(?:[?#].*)?$"
_PAGE = r"(?:/(?:workspace|overview|logs|files|table|charts))?"  # a run's or group's page in the W&B app
_RUN_PATH = re.compile(_HOST + r"(?:runs/)?([^/\s?#]+)" + _PAGE + _TAIL)
_GROUP_PATH = re.compile(_HOST + r"groups/([^/\s?#]+)" + _PAGE + _TAIL)


def looks_like_wandb_path(arg: str) -> bool:
    return not os.path.exists(arg) and bool(_GROUP_PATH.match(arg) or _RUN_PATH.match(arg))


def _wandb_api(arg: str):
    if os.environ.get("WANDB_MODE") in ("offline", "disabled"):
        raise CompareError(
            f"{arg}: no such local path, and WANDB_MODE={os.environ['WANDB_MODE']} forbids reading it as a W&B run "
            "online; pass the run's output dir"
        )
    try:
        wandb = require("wandb", "reading W&B runs", "pass the run's output dir")
    except ImportError as err:
        raise CompareError(f"{arg}: {err}") from err
    return wandb.Api(timeout=20)


def _online_history(api_run, entity: str, project: str) -> RunHistory:
    rows = []
    for raw in api_run.scan_history():
        row = {canonical_key(k): v for k, v in raw.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if row:
            rows.append(row)
    run = {
        "id": api_run.id,
        "entity": entity,
        "project": project,
        "group": api_run.group,
        "job_type": api_run.job_type,
        "display_name": api_run.name,
        "tags": list(api_run.tags or []),
    }
    raw_config = dict(api_run.config)
    config = {k: v for k, v in raw_config.items() if not k.startswith("_")}
    info = {
        "run_name": api_run.name,
        "group": api_run.group or config.get("cost_aware_run_group"),
        "seed": config.get("seed"),
        "cost_aware": config.get("cost_aware"),
        "loss_type": config.get("loss_type"),
        "kept_fraction": config.get("cost_aware_kept_fraction") if config.get("cost_aware") else 1.0,
        "model": raw_config.get("_name_or_path"),
        "wandb": run,
        "config": config,
    }
    info["arm"] = api_run.job_type if api_run.job_type in (BASELINE_ARM, COST_AWARE_ARM) else default_arm(info)
    source = f"{entity}/{project}/{api_run.id}"
    return RunHistory(name=api_run.name or api_run.id, source=source, kind="wandb-online", rows=rows, info=info)


def read_wandb_online(arg: str) -> list[RunHistory]:
    """The run ``entity/project/run_id``, or every run of the group ``entity/project/groups/NAME``, read with
    ``wandb.Api()``: ``api.run(path)`` / ``api.runs(path, filters={"group": NAME})``, each run's rows from
    ``run.scan_history()`` (numeric values, keys as the trainer logs them) and its ``run.config``."""
    group = _GROUP_PATH.match(arg)
    entity, project, ident = (group or _RUN_PATH.match(arg)).groups()
    api = _wandb_api(arg)
    try:
        if group:
            runs = [_online_history(r, entity, project) for r in api.runs(f"{entity}/{project}", {"group": ident})]
        else:
            runs = [_online_history(api.run(f"{entity}/{project}/{ident}"), entity, project)]
    except Exception as err:  # network, auth and not-found errors all end here
        raise CompareError(
            f"{arg}: no such local path, and cannot read it as a W&B run online ({type(err).__name__}: {err}). "
            "Check the path, or the network and `wandb login`, or pass the run's output dir."
        ) from err
    if not runs:
        raise CompareError(f"{arg}: the W&B group {ident!r} has no runs in {entity}/{project}")
    return runs


# ---------------------------------------------------------------------------------------------------- discovery
def discover(sources: list[str], max_depth: int = 4) -> list[tuple[str, str]]:
    """(kind, path) for every run under the arguments: a local run dir (with the JSONL) or an online W&B path.
    Folders without the JSONL are searched (not below a run dir, not through symlinks)."""
    found, seen = [], set()

    def add(kind, path):
        key = os.path.realpath(path) if kind != "wandb-online" else path
        if key not in seen:
            seen.add(key)
            found.append((kind, path))

    for src in sources:
        if looks_like_wandb_path(src):
            add("wandb-online", src)
            continue
        if not os.path.exists(src):
            raise CompareError(f"{src}: no such file or folder (and not an entity/project/run_id W&B path)")
        if os.path.isfile(src):
            if not src.endswith(".jsonl"):
                hint = WANDB_HINT if src.endswith(".wandb") else ""
                raise CompareError(f"{src}: expected a run folder or a {METRICS_FILE}{hint}")
            add("local", src)
            continue
        before, wandb_only = len(found), False
        base_depth = src.rstrip(os.sep).count(os.sep)
        for root, dirs, files in os.walk(src, followlinks=False):
            if METRICS_FILE in files:
                add("local", root)
                dirs[:] = []
                continue
            wandb_only = wandb_only or any(f.endswith(".wandb") for f in files)
            dirs[:] = sorted(
                d for d in dirs if not os.path.islink(os.path.join(root, d)) and not d.startswith("checkpoint-")
            )
            if root.count(os.sep) - base_depth >= max_depth:
                dirs[:] = []
        if len(found) == before:
            hint = WANDB_HINT if wandb_only else ""
            raise CompareError(f"{src}: no run found (no {METRICS_FILE} within {max_depth} levels){hint}")
    return found


def load_runs(sources: list[str], progress: bool | None = None) -> list[RunHistory]:
    """Read every run under `sources`; a progress bar shows when there are several (on a terminal)."""
    specs = discover(sources)
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    iterator = specs
    if tqdm is not None and progress is not False:
        disable = None if progress is None and len(specs) > 1 else not progress
        iterator = tqdm(specs, desc="reading runs", unit="run", disable=disable, leave=False, file=sys.stderr)
    runs = []
    for kind, path in iterator:
        runs += [read_local_run(path)] if kind == "local" else read_wandb_online(path)
    names = {}
    for run in runs:  # unique names
        n = names.get(run.name, 0)
        names[run.name] = n + 1
        if n:
            run.name = f"{run.name}#{n + 1}"
    return runs
