"""`trl-costaware compare`: reward against tokens for a baseline and a cost-aware arm, and the tokens saved.

Reads runs from
- local output dirs (``cost_aware_metrics.jsonl`` + ``cost_aware_run.json`` written by the trainer), or a folder
  holding several of them (searched recursively);
- W&B offline run folders (``wandb/offline-run-*``, a ``run-*.wandb`` file, or a ``wandb/`` folder): the ``.wandb``
  transaction log is decoded with wandb's own protobuf schema (``wandb.proto.wandb_internal_pb2.Record``);
- online W&B runs given as ``entity/project/run_id`` (or a run URL), through ``wandb.Api()`` when reachable.

Runs are grouped into arms (``--label``, ``--arm-by``, else the run's arm: ``baseline`` for ``cost_aware=False``, else
``cost_aware``), seeds of an arm are averaged on a common token grid, and for every run and arm the table gives the
final and peak value of the (smoothed) metric and the tokens needed to first reach the baseline arm's peak and 99% of
it — the paper's metric — with the saving against the baseline, and the wall time to the same targets.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import re
import struct
import sys
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .tracking import BASELINE_ARM, COST_AWARE_ARM, METRICS_FILE, RUN_FILE

NOT_REACHED = "not reached"
DEFAULT_METRIC = "reward"
DEFAULT_X = "cost_aware/policy_tokens"
DEFAULT_SMOOTH = 0.6
DEFAULT_FRACTIONS = (1.0, 0.99)
X_ALIASES = {
    "policy_tokens": "cost_aware/policy_tokens",
    "tokens": "cost_aware/policy_tokens",
    "policy_tokens_padded": "cost_aware/policy_tokens_padded",
    "generated_tokens": "cost_aware/generated_tokens",
    "rollout_tokens": "cost_aware/rollout_tokens",
    "wall": "wall_time",
    "time": "wall_time",
}
X_LABELS = {
    "cost_aware/policy_tokens": "policy-optimisation tokens",
    "cost_aware/policy_tokens_padded": "policy-optimisation tokens (with padding)",
    "cost_aware/generated_tokens": "generated (completion) tokens",
    "cost_aware/rollout_tokens": "rollout tokens (prompt + completion)",
    "num_tokens": "rollout tokens (TRL num_tokens)",
    "wall_time": "wall time (s)",
    "step": "global step",
}


class CompareError(Exception):
    """A problem with the inputs, reported as one line by the command."""


# ==================================================================================================== run histories
@dataclass
class RunHistory:
    name: str
    source: str
    kind: str  # "local", "wandb-offline", "wandb-online"
    rows: list[
        dict[str, Any]
    ]  # keys as the trainer logs them: "reward", "eval_reward", "cost_aware/policy_tokens", ...
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
    name = X_ALIASES.get(name, name)
    return canonical_key(name)


def _default_arm(info: dict) -> str:
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


# ---------------------------------------------------------------------------------------------------- W&B offline
_LOG_HEADER = struct.Struct("<4sHB")  # ":W&B", magic 0xBEE1, version
_REC_HEADER = struct.Struct("<IHB")  # crc32, length, type
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def iter_wandb_records(path: str):
    """Decoded ``wandb_internal_pb2.Record`` messages of a ``.wandb`` transaction log (LevelDB log format: 32 KiB
    blocks of CRC-checked chunks, as written by wandb-core). A truncated tail (run still going, or killed) ends the
    iteration; a chunk whose checksum fails is skipped."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as fh:
        data = fh.read()
    if len(data) < _LOG_HEADER.size:
        raise CompareError(f"{path}: empty or not a W&B run file")
    ident, magic, _version = _LOG_HEADER.unpack_from(data)
    if ident != b":W&B" or magic != 0xBEE1:
        raise CompareError(f"{path}: not a W&B run file (bad header)")
    pos, pending = _LOG_HEADER.size, None
    while pos + _REC_HEADER.size <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _REC_HEADER.size:  # block trailer padding
            pos += left
            continue
        crc, length, kind = _REC_HEADER.unpack_from(data, pos)
        start, end = pos + _REC_HEADER.size, pos + _REC_HEADER.size + length
        if end > len(data):
            break
        pos = end
        if kind == 0 and length == 0:  # zero padding written up to the end of a block
            pos += (-pos) % _BLOCK
            continue
        payload = data[start:end]
        if zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            pending = None
            continue
        if kind == _FULL:
            chunk = payload
        elif kind == _FIRST:
            pending = payload
            continue
        elif kind == _MIDDLE:
            pending = None if pending is None else pending + payload
            continue
        elif kind == _LAST and pending is not None:
            chunk, pending = pending + payload, None
        else:
            continue
        record = pb.Record()
        try:
            record.ParseFromString(chunk)
        except Exception:  # noqa: BLE001, S112 - a record this protobuf version cannot read is skipped
            continue
        yield record


def _item_value(item):
    which = item.WhichOneof("value") if any(o.name == "value" for o in item.DESCRIPTOR.oneofs) else None
    if which and which not in ("none", "json"):
        return getattr(item, which)
    if which == "none":
        return None
    text = item.json if which == "json" else item.value_json
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


def _item_key(item) -> str:
    return item.key or "/".join(item.nested_key)


def read_wandb_offline(path: str) -> RunHistory:
    """A W&B run folder (``offline-run-*`` / ``run-*``) or its ``.wandb`` file."""
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if f.endswith(".wandb"))
        if not files:
            raise CompareError(f"{path}: no .wandb file in this folder")
        file = os.path.join(path, files[0])
    else:
        file = path
    rows, config, metrics = [], {}, []
    run, finished = {}, False
    for record in iter_wandb_records(file):
        kind = record.WhichOneof("record_type")
        if kind == "exit":
            finished = True
        elif kind == "history":
            row = {}
            for item in record.history.item:
                value = _item_value(item)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    row[canonical_key(_item_key(item))] = value
            if row:
                rows.append(row)
        elif kind == "run":
            r = record.run
            run.update(
                {
                    "id": r.run_id,
                    "entity": r.entity,
                    "project": r.project,
                    "group": r.run_group or None,
                    "job_type": r.job_type or None,
                    "display_name": r.display_name or None,
                    "tags": list(r.tags),
                }
            )
            for item in r.config.update:
                config[_item_key(item)] = _item_value(item)
        elif kind == "config":
            for item in record.config.update:
                config[_item_key(item)] = _item_value(item)
            for item in record.config.remove:
                config.pop(_item_key(item), None)
        elif kind == "metric":
            m = record.metric
            metrics.append(
                {"name": m.name or None, "glob_name": m.glob_name or None, "step_metric": m.step_metric or None}
            )
    config.pop("_wandb", None)
    info = _wandb_info(run, config)
    info["wandb_metrics"] = metrics
    info["finished"] = finished  # False: still running, killed, or not flushed yet (wandb-core writes asynchronously)
    name = run.get("display_name") or run.get("id") or os.path.basename(os.path.dirname(file))
    return RunHistory(name=name, source=os.path.dirname(file), kind="wandb-offline", rows=rows, info=info)


def _wandb_info(run: dict, config: dict) -> dict:
    job_type = run.get("job_type")
    info = {
        "run_name": run.get("display_name"),
        "group": run.get("group") or config.get("cost_aware_run_group"),
        "seed": config.get("seed"),
        "cost_aware": config.get("cost_aware"),
        "loss_type": config.get("loss_type"),
        "kept_fraction": config.get("cost_aware_kept_fraction") if config.get("cost_aware") else 1.0,
        "model": config.get("_name_or_path"),
        "wandb": run,
        "config": config,
    }
    info["arm"] = job_type if job_type in (BASELINE_ARM, COST_AWARE_ARM) else _default_arm(info)
    return info


# ---------------------------------------------------------------------------------------------------- W&B online
_RUN_PATH = re.compile(r"^(?:https?://[^/]+/)?([^/\s]+)/([^/\s]+)/(?:runs/)?([^/\s?#]+)/?(?:[?#].*)?$")


def looks_like_wandb_path(arg: str) -> bool:
    return not os.path.exists(arg) and bool(_RUN_PATH.match(arg))


def read_wandb_online(arg: str) -> RunHistory:
    entity, project, run_id = _RUN_PATH.match(arg).groups()
    path = f"{entity}/{project}/{run_id}"
    if os.environ.get("WANDB_MODE") in ("offline", "disabled"):
        raise CompareError(
            f"{arg}: no such local path, and WANDB_MODE={os.environ['WANDB_MODE']} forbids reading it as a W&B run "
            "online; pass a run folder"
        )
    try:
        import wandb
    except ImportError as err:
        raise CompareError(f"{arg}: reading W&B runs needs the wandb package (`pip install wandb`)") from err
    try:
        api_run = wandb.Api(timeout=20).run(path)
        rows = []
        for raw in api_run.scan_history():
            row = {
                canonical_key(k): v
                for k, v in raw.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None
            }
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
        config = {k: v for k, v in dict(api_run.config).items() if not k.startswith("_")}
    except CompareError:
        raise
    except Exception as err:  # network, auth and not-found errors all end here
        raise CompareError(
            f"{arg}: no such local path, and cannot read it as a W&B run online ({type(err).__name__}: {err}). "
            "Check the path, or the network and "
            "`wandb login`, or pass the run's local folder (wandb/offline-run-... or wandb/run-...)."
        ) from err
    return RunHistory(
        name=api_run.name or run_id, source=path, kind="wandb-online", rows=rows, info=_wandb_info(run, config)
    )


# ---------------------------------------------------------------------------------------------------- discovery
def discover(sources: list[str], max_depth: int = 4) -> list[tuple[str, str]]:
    """(kind, path) for every run under the arguments: a local run dir (with the JSONL), a W&B run folder, or an
    online W&B path. Folders without either are searched (not below a run dir, not through symlinks)."""
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
            if src.endswith(".wandb"):
                add("wandb-offline", src)
            elif src.endswith(".jsonl"):
                add("local", src)
            else:
                raise CompareError(f"{src}: expected a run folder, a {METRICS_FILE} or a .wandb file")
            continue
        before = len(found)
        base_depth = src.rstrip(os.sep).count(os.sep)
        for root, dirs, files in os.walk(src, followlinks=False):
            if METRICS_FILE in files:
                add("local", root)
                dirs[:] = []
                continue
            if any(f.endswith(".wandb") for f in files):
                add("wandb-offline", root)
                dirs[:] = []
                continue
            dirs[:] = sorted(
                d for d in dirs if not os.path.islink(os.path.join(root, d)) and not d.startswith("checkpoint-")
            )
            if root.count(os.sep) - base_depth >= max_depth:
                dirs[:] = []
        if len(found) == before:
            raise CompareError(f"{src}: no run found (no {METRICS_FILE}, no .wandb file within {max_depth} levels)")
    return found


def load_runs(sources: list[str], progress: bool | None = None) -> list[RunHistory]:
    """Read every run under `sources`; a progress bar shows when there are several (on a terminal)."""
    specs = discover(sources)
    readers = {"local": read_local_run, "wandb-offline": read_wandb_offline, "wandb-online": read_wandb_online}
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    iterator = specs
    if tqdm is not None and progress is not False:
        disable = None if progress is None and len(specs) > 1 else not progress
        iterator = tqdm(specs, desc="reading runs", unit="run", disable=disable, leave=False, file=sys.stderr)
    runs = [readers[kind](path) for kind, path in iterator]
    names = {}
    for run in runs:  # unique names
        n = names.get(run.name, 0)
        names[run.name] = n + 1
        if n:
            run.name = f"{run.name}#{n + 1}"
    return runs


# ==================================================================================================== curves
def smooth(values: np.ndarray, spec: float) -> np.ndarray:
    """``spec`` = 0: none; 0 < spec < 1: debiased exponential moving average with weight `spec` on the past (as
    TensorBoard/W&B's smoothing slider); spec >= 1: trailing rolling mean over `int(spec)` points."""
    values = np.asarray(values, dtype=float)
    if spec <= 0 or len(values) == 0:
        return values.copy()
    if spec < 1:
        out, last = np.empty_like(values), 0.0
        for i, v in enumerate(values):
            last = last * spec + (1 - spec) * v
            out[i] = last / (1 - spec ** (i + 1))
        return out
    window = int(spec)
    csum = np.concatenate([[0.0], np.cumsum(values)])
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(0, idx - window)
    return (csum[idx] - csum[lo]) / (idx - lo)


def first_crossing(x, y, target: float, *others) -> tuple[float | None, ...]:
    """x at which the curve ``y(x)`` first reaches ``target`` (linear interpolation between logged points), and each
    of `others` (curves on the same points, e.g. wall time) at the same place; Nones if it never does."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    tol = 1e-9 * max(1.0, abs(target))
    hits = np.nonzero(y >= target - tol)[0]
    if len(hits) == 0:
        return (None,) * (1 + len(others))
    j = int(hits[0])
    if j == 0 or y[j] - y[j - 1] <= 0:
        return (float(x[j]), *(float(np.asarray(o, float)[j]) for o in others))
    t = float(np.clip((target - y[j - 1]) / (y[j] - y[j - 1]), 0.0, 1.0))

    def at(c):
        c = np.asarray(c, float)
        return float(c[j - 1] + t * (c[j] - c[j - 1]))

    return (at(x), *(at(o) for o in others))


@dataclass
class Curve:
    x: np.ndarray
    y: np.ndarray  # smoothed
    raw: np.ndarray
    wall: np.ndarray  # wall time at each point (NaN where unknown)
    lo: np.ndarray | None = None  # band (arms)
    hi: np.ndarray | None = None
    n: int = 1


def smoothing_window(spec: float) -> int:
    """Points a smoother averages over once it is warmed up: the window, or about 1/(1 − w) for an EMA."""
    if spec <= 0:
        return 1
    if spec < 1:
        return max(1, round(1.0 / (1.0 - spec)))
    return int(spec)


def run_curve(
    run: RunHistory, metric: str, x_key: str, smoothing: float, min_points: int | None = None
) -> Curve | None:
    """The run's (x, smoothed metric) points, sorted by x. The first ``min_points − 1`` smoothed points (default: the
    smoother's window) are dropped: there the average rests on a few noisy values, and an early spike would count as
    reaching a target. A run with fewer points keeps its last one."""
    pts = []
    for i, row in enumerate(run.rows):
        xv, yv = row.get(x_key), row.get(metric)
        if isinstance(xv, (int, float)) and isinstance(yv, (int, float)) and math.isfinite(xv) and math.isfinite(yv):
            wall = row.get("wall_time")
            pts.append((float(xv), i, float(yv), float(wall) if isinstance(wall, (int, float)) else math.nan))
    if not pts:
        return None
    pts.sort()  # by x, then log order (a cumulative counter: already in order)
    x = np.array([p[0] for p in pts])
    raw = np.array([p[2] for p in pts])
    wall = np.array([p[3] for p in pts])
    y = smooth(raw, smoothing)
    skip = min((smoothing_window(smoothing) if min_points is None else max(1, min_points)) - 1, len(x) - 1)
    return Curve(x=x[skip:], y=y[skip:], raw=raw[skip:], wall=wall[skip:])


def _interp(x_new, x, y):
    y_new = np.interp(x_new, x, y)
    y_new[(x_new < x[0]) | (x_new > x[-1])] = np.nan
    return y_new


def aggregate(curves: list[Curve], band: str = "minmax") -> Curve:
    """Mean over seeds on a common grid: the union of the runs' x values inside the range every run covers (the
    union of ranges if they do not overlap), each run linearly interpolated. Band: ``minmax``, ``std`` or ``none``."""
    if len(curves) == 1:
        c = curves[0]
        return Curve(x=c.x, y=c.y, raw=c.raw, wall=c.wall, lo=c.y, hi=c.y, n=1)
    lo = max(c.x[0] for c in curves)
    hi = min(c.x[-1] for c in curves)
    grid = np.unique(np.concatenate([c.x for c in curves]))
    if lo < hi:
        grid = grid[(grid >= lo) & (grid <= hi)]
    ys = np.vstack([_interp(grid, c.x, c.y) for c in curves])
    raws = np.vstack([_interp(grid, c.x, c.raw) for c in curves])
    walls = np.vstack([_interp(grid, c.x, c.wall) if np.isfinite(c.wall).all() else grid * np.nan for c in curves])
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns (outside a run's range)
        mean = np.nanmean(ys, axis=0)
        if band == "std":
            sd = np.nanstd(ys, axis=0)
            band_lo, band_hi = mean - sd, mean + sd
        elif band == "none":
            band_lo = band_hi = mean
        else:
            band_lo, band_hi = np.nanmin(ys, axis=0), np.nanmax(ys, axis=0)
        raw = np.nanmean(raws, axis=0)
        wall = np.nanmean(walls, axis=0)
    return Curve(x=grid, y=mean, raw=raw, wall=wall, lo=band_lo, hi=band_hi, n=len(curves))


# ==================================================================================================== the comparison
@dataclass
class Target:
    fraction: float
    value: float  # in the metric's units (sign as logged)
    baseline_x: float | None
    baseline_wall: float | None


@dataclass
class Result:
    metric: str
    x_key: str
    smoothing: float
    min_points: int
    minimize: bool
    baseline: str
    baseline_peak: float
    targets: list[Target]
    runs: list[dict]
    arms: list[dict]
    curves: dict  # name -> Curve (runs) ; arm label -> Curve (arms)
    arm_members: dict  # arm label -> [run names]

    def to_json(self) -> dict:
        return {
            "metric": self.metric,
            "x": self.x_key,
            "smoothing": self.smoothing,
            "min_points": self.min_points,
            "minimize": self.minimize,
            "baseline": self.baseline,
            "baseline_peak": self.baseline_peak,
            "targets": [t.__dict__ for t in self.targets],
            "arms": self.arms,
            "runs": self.runs,
        }


def assign_labels(runs: list[RunHistory], labels: list[str] | None = None, arm_by: list[str] | None = None) -> None:
    """``labels``: ``PATTERN=LABEL`` globs matched against a run's name, source and group (first match wins);
    ``arm_by``: info/config fields whose values name the arm; else the run's arm (baseline / cost_aware)."""
    rules = []
    for spec in labels or []:
        if "=" not in spec:
            raise CompareError(f"--label {spec!r}: expected PATTERN=LABEL, e.g. '*baseline*=baseline'")
        pattern, label = spec.rsplit("=", 1)
        rules.append((pattern, label))
    for run in runs:
        run.label = None
        for pattern, label in rules:
            names = [run.name, run.source, os.path.basename(run.source), str(run.info.get("group") or "")]
            if any(fnmatch.fnmatch(n, pattern) for n in names):
                run.label = label
                break
        if run.label is None and arm_by:
            parts = []
            for fld in arm_by:
                value = run.info.get(fld, (run.info.get("config") or {}).get(fld))
                parts.append(f"{fld}={value}")
            run.label = ",".join(parts)
        if run.label is None:
            if rules:
                raise CompareError(f"run {run.name} ({run.source}) matches no --label pattern")
            run.label = _default_arm(run.info)


def _choose_baseline(runs: list[RunHistory], arms: dict[str, list], baseline: str | None) -> str:
    if baseline is not None:
        if baseline not in arms:
            raise CompareError(f"--baseline {baseline!r} is not an arm; arms: {', '.join(arms)}")
        return baseline
    if BASELINE_ARM in arms:
        return BASELINE_ARM
    off = [a for a, members in arms.items() if all(not _is_cost_aware(r) for r in members)]
    if len(off) == 1:
        return off[0]
    raise CompareError(
        f"cannot tell which arm is the baseline (arms: {', '.join(arms)}); name it with --baseline, or run it "
        "with cost_aware=False"
    )


def _is_cost_aware(run: RunHistory) -> bool:
    return _default_arm(run.info) == COST_AWARE_ARM


def _target_value(peak: float, start: float, fraction: float, minimize: bool) -> float:
    """``fraction`` of the peak for a positive peak of a maximised metric (the paper's "99% of peak"); else
    ``fraction`` of the way from the baseline's first value to its peak."""
    if fraction == 1.0:
        return peak
    if not minimize and peak > 0:
        return fraction * peak
    return start + fraction * (peak - start)


def compare_runs(
    runs: list[RunHistory],
    metric: str = DEFAULT_METRIC,
    x: str = DEFAULT_X,
    smoothing: float = DEFAULT_SMOOTH,
    min_points: int | None = None,
    fractions=DEFAULT_FRACTIONS,
    baseline: str | None = None,
    labels: list[str] | None = None,
    arm_by: list[str] | None = None,
    band: str = "minmax",
    minimize: bool = False,
) -> Result:
    metric, x_key = canonical_key(metric), canonical_x(x)
    if not runs:
        raise CompareError("no runs to compare")
    assign_labels(runs, labels, arm_by)
    sign = -1.0 if minimize else 1.0
    curves, usable = {}, []
    for run in runs:
        c = run_curve(run, metric, x_key, smoothing, min_points)
        if c is None:
            have = sorted({k for r in run.rows for k in r})
            hint = [k for k in have if metric in k or k.endswith(metric.split("_")[-1])][:6]
            raise CompareError(
                f"run {run.name} ({run.source}) has no rows with both {metric!r} and {x_key!r}"
                + (f"; similar keys: {', '.join(hint)}" if hint else "")
                + (f"; x-axis candidates: {', '.join(k for k in have if _is_axis_key(k))}")
            )
        c.y, c.raw = sign * c.y, sign * c.raw  # internally always maximised
        curves[run.name] = c
        usable.append(run)
    arms: dict[str, list[RunHistory]] = {}
    for run in usable:
        arms.setdefault(run.label, []).append(run)
    base_label = _choose_baseline(usable, arms, baseline)
    arm_curves = {label: aggregate([curves[r.name] for r in members], band) for label, members in arms.items()}
    base = arm_curves[base_label]
    peak = float(np.nanmax(base.y))
    start = float(base.y[np.isfinite(base.y)][0])
    targets = []
    for f in fractions:
        value = _target_value(peak, start, f, minimize=False)
        bx, bw = first_crossing(base.x, base.y, value, base.wall)
        targets.append(Target(fraction=f, value=sign * value, baseline_x=bx, baseline_wall=_finite(bw)))

    def stats(c: Curve) -> dict:
        finite = np.isfinite(c.y)
        ys, xs = c.y[finite], c.x[finite]
        i_peak = int(np.argmax(ys))
        out = {
            "final": sign * float(ys[-1]),
            "peak": sign * float(ys[i_peak]),
            "x_at_peak": float(xs[i_peak]),
            "x_total": float(xs[-1]),
            "wall_total": _finite(c.wall[finite][-1]),
            "points": int(finite.sum()),
            "targets": [],
        }
        for t in targets:
            tx, tw = first_crossing(xs, ys, sign * t.value, c.wall[finite])
            saving = None
            if tx is not None and t.baseline_x:
                saving = 100.0 * (1.0 - tx / t.baseline_x)
            wall_saving = None
            tw = _finite(tw)
            if tw is not None and t.baseline_wall:
                wall_saving = 100.0 * (1.0 - tw / t.baseline_wall)
            out["targets"].append(
                {"fraction": t.fraction, "x": tx, "saving_pct": saving, "wall": tw, "wall_saving_pct": wall_saving}
            )
        return out

    run_rows = []
    for run in usable:
        s = stats(curves[run.name])
        s.update({"name": run.name, "arm": run.label, "seed": run.info.get("seed"), "source": run.source})
        s["kind"] = run.kind
        run_rows.append(s)
    base_final = stats(base)["final"]
    arm_rows = []
    for label, members in arms.items():
        s = stats(arm_curves[label])
        s.update({"arm": label, "runs": len(members), "seeds": sorted({str(r.info.get("seed")) for r in members})})
        s["final_vs_baseline"] = s["final"] - base_final
        arm_rows.append(s)
    arm_rows.sort(key=lambda r: (r["arm"] != base_label, r["arm"]))
    run_rows.sort(key=lambda r: (r["arm"] != base_label, r["arm"], str(r["seed"]), r["name"]))
    for c in list(curves.values()) + list(arm_curves.values()):  # back to the metric's sign for plotting
        c.y, c.raw = sign * c.y, sign * c.raw
        if c.lo is not None:
            c.lo, c.hi = (sign * c.lo, sign * c.hi) if sign > 0 else (sign * c.hi, sign * c.lo)
    return Result(
        metric=metric,
        x_key=x_key,
        smoothing=smoothing,
        min_points=smoothing_window(smoothing) if min_points is None else max(1, min_points),
        minimize=minimize,
        baseline=base_label,
        baseline_peak=sign * peak,
        targets=targets,
        runs=run_rows,
        arms=arm_rows,
        curves={"runs": curves, "arms": arm_curves},
        arm_members={label: [r.name for r in members] for label, members in arms.items()},
    )


def _is_axis_key(key: str) -> bool:
    return key.endswith(("tokens", "tokens_padded")) or key in ("wall_time", "step")


def _finite(v):
    return None if v is None or not math.isfinite(v) else float(v)


# ==================================================================================================== output
def fmt_num(v, digits: int = 4) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, str):
        return v
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.3g}"
    return f"{v:.{digits}g}"


def fmt_tokens(v) -> str:
    if v is None:
        return NOT_REACHED
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.3g}{unit}"
    return f"{v:.0f}" if float(v).is_integer() else f"{v:.1f}"


def fmt_x(v, x_key: str) -> str:
    if v is None:
        return NOT_REACHED
    if x_key == "wall_time":
        return fmt_seconds(v)
    return fmt_tokens(v) if "token" in x_key else fmt_num(v)


def fmt_seconds(v) -> str:
    if v is None:
        return "n/a"
    if v >= 3600:
        return f"{v / 3600:.2f} h"
    if v >= 120:
        return f"{v / 60:.1f} min"
    return f"{v:.1f} s"


def fmt_pct(v) -> str:
    return "n/a" if v is None else f"{v:+.1f}%"


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(line(r) for r in rows)])


def _target_name(f: float) -> str:
    return "peak" if f == 1.0 else f"{100 * f:g}% peak"


def format_report(result: Result) -> str:
    """The comparison as markdown: targets, then a table per arm (seeds averaged) and per run."""
    xk, fr = result.x_key, result.targets
    smooth_txt = (
        "none"
        if result.smoothing <= 0
        else (f"EMA {result.smoothing:g}" if result.smoothing < 1 else f"rolling mean of {int(result.smoothing)}")
    )
    lines = [
        (
            f"Metric `{result.metric}` ({'lower' if result.minimize else 'higher'} is better) against "
            f"`{xk}`; smoothing: {smooth_txt}"
            + (f"; first {result.min_points - 1} point(s) of each run dropped" if result.min_points > 1 else "")
            + f". Baseline arm: `{result.baseline}`."
        ),
        "Targets: "
        + "; ".join(
            f"{_target_name(t.fraction)} = {fmt_num(t.value)} (baseline reaches it at {fmt_x(t.baseline_x, xk)})"
            for t in fr
        )
        + ".",
        "",
    ]
    x_word = "tokens" if "token" in xk else xk
    target_columns = [c for t in fr for c in (f"{x_word} to {_target_name(t.fraction)}", "saving")]
    target_columns += [f"wall to {_target_name(t.fraction)}" for t in fr] + [f"{x_word} total", "wall total"]
    head = ["arm", "runs", "final", "Δ final", "peak", *target_columns]
    rows = []
    for a in result.arms:
        r = [a["arm"], str(a["runs"]), fmt_num(a["final"]), f"{a['final_vs_baseline']:+.3g}", fmt_num(a["peak"])]
        for t in a["targets"]:
            r += [fmt_x(t["x"], xk), fmt_pct(t["saving_pct"])]
        for t in a["targets"]:
            r += [fmt_seconds(t["wall"]) if t["x"] is not None else NOT_REACHED]
        r += [fmt_x(a["x_total"], xk), fmt_seconds(a["wall_total"])]
        rows.append(r)
    lines += ["Arms (seeds averaged on a common grid):", "", _markdown(head, rows), ""]
    head = ["run", "arm", "seed", "final", "peak", *target_columns]
    rows = []
    for run in result.runs:
        r = [run["name"], run["arm"], str(run["seed"]), fmt_num(run["final"]), fmt_num(run["peak"])]
        for t in run["targets"]:
            r += [fmt_x(t["x"], xk), fmt_pct(t["saving_pct"])]
        for t in run["targets"]:
            r += [fmt_seconds(t["wall"]) if t["x"] is not None else NOT_REACHED]
        r += [fmt_x(run["x_total"], xk), fmt_seconds(run["wall_total"])]
        rows.append(r)
    lines += ["Runs:", "", _markdown(head, rows)]
    lines += [
        "",
        f"saving = 1 − {x_word} to the target / the baseline arm's {x_word} to it (positive: fewer {x_word}).",
    ]
    return "\n".join(lines)


def plot(result: Result, path: str, show_runs: bool = True, title: str | None = None) -> str:
    """PNG of the smoothed metric against the x-axis: one line per arm (mean over seeds, band), thin lines for the
    runs of arms with several seeds, the targets and where each arm first reaches them. Uses the Agg canvas only."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.5, 5.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colors = ["tab:gray", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink"]
    order = [a["arm"] for a in result.arms]
    for i, label in enumerate(order):
        color = colors[i % len(colors)]  # the baseline comes first: gray
        c = result.curves["arms"][label]
        members = result.arm_members[label]
        if show_runs and len(members) > 1:
            for name in members:
                rc = result.curves["runs"][name]
                ax.plot(rc.x, rc.y, color=color, alpha=0.25, linewidth=0.8)
        if c.n > 1 and c.lo is not None:
            ax.fill_between(c.x, c.lo, c.hi, color=color, alpha=0.18, linewidth=0)
        n_txt = f" ({c.n} runs)" if c.n > 1 else ""
        ax.plot(c.x, c.y, color=color, linewidth=2.0, label=f"{label}{n_txt}")
        arm = next(a for a in result.arms if a["arm"] == label)
        for t, at in zip(result.targets, arm["targets"], strict=True):
            if at["x"] is not None:
                ax.plot([at["x"]], [t.value], marker="o" if t.fraction == 1.0 else "v", color=color, markersize=6)
    span = float(np.nanmax([np.nanmax(np.abs(c.y)) for c in result.curves["arms"].values()]) or 1.0)
    labelled = []
    for t in result.targets:
        ax.axhline(t.value, color="black", linestyle="--" if t.fraction == 1.0 else ":", linewidth=0.8, alpha=0.7)
        near = [lab for lab in labelled if abs(lab[0] - t.value) <= 0.02 * span]
        if near:  # targets on top of each other (a flat or tiny peak): one label
            near[0][1].set_text(near[0][1].get_text() + f" = {_target_name(t.fraction)}")
            continue
        text = ax.annotate(
            f"baseline {_target_name(t.fraction)}",
            xy=(1.0, t.value),
            xycoords=("axes fraction", "data"),
            ha="right",
            va="bottom" if t.fraction == 1.0 else "top",
            fontsize=8,
            alpha=0.8,
        )
        labelled.append((t.value, text))
    ax.set_xlabel(X_LABELS.get(result.x_key, result.x_key))
    smooth_txt = "" if result.smoothing <= 0 else f" (smoothed {result.smoothing:g})"
    ax.set_ylabel(f"{result.metric}{smooth_txt}")
    savings = []
    for a in result.arms:
        if a["arm"] != result.baseline:
            s = a["targets"][0]["saving_pct"]
            savings.append(f"{a['arm']}: {fmt_pct(s) if s is not None else NOT_REACHED}")
    ax.set_title(title or f"{result.metric} vs {X_LABELS.get(result.x_key, result.x_key)}", fontsize=11)
    if savings:
        ax.text(
            0.01,
            0.01,
            "tokens to baseline peak vs baseline — " + "; ".join(savings),
            transform=ax.transAxes,
            fontsize=8,
            va="bottom",
        )
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    return path


# ==================================================================================================== command line
def build_parser(prog: str = "trl-costaware compare") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Compare runs by a metric against tokens: tokens the cost-aware arm needs to reach the "
        "baseline's peak (and 99% of it), saving in %, wall time; writes a PNG of metric against tokens.",
    )
    p.add_argument(
        "runs",
        nargs="+",
        metavar="RUN",
        help="run output dir (with cost_aware_metrics.jsonl), a folder of them, a W&B offline run folder / .wandb "
        "file / wandb/ folder, or entity/project/run_id (online)",
    )
    p.add_argument("--metric", default=DEFAULT_METRIC, help="metric: reward (default), eval_reward, eval/reward, ...")
    p.add_argument(
        "--x",
        default="policy_tokens",
        help="x-axis: policy_tokens (default), policy_tokens_padded, generated_tokens, rollout_tokens, num_tokens, "
        "wall_time, step, or any logged cumulative key",
    )
    p.add_argument(
        "--smooth",
        type=float,
        default=DEFAULT_SMOOTH,
        help="0: none; in (0, 1): debiased EMA weight (like W&B's slider); >= 1: rolling mean over that many "
        f"points (default {DEFAULT_SMOOTH})",
    )
    p.add_argument(
        "--min-points",
        type=int,
        default=None,
        help="drop each run's first N-1 smoothed points, where the average rests on a few noisy values "
        "(default: the smoothing window, about 1/(1-w) for an EMA; 1 keeps every point)",
    )
    p.add_argument(
        "--fractions",
        default=",".join(f"{f:g}" for f in DEFAULT_FRACTIONS),
        help="targets as fractions of the baseline peak (default 1,0.99)",
    )
    p.add_argument("--baseline", help="label of the baseline arm (default: the arm with cost_aware=False)")
    p.add_argument(
        "--label",
        action="append",
        metavar="PATTERN=LABEL",
        help="arm label for runs whose name, path or group matches the glob (repeatable; first match wins)",
    )
    p.add_argument(
        "--arm-by",
        action="append",
        metavar="FIELD",
        help="split arms by a run field or config field, e.g. --arm-by cost_aware_kept_fraction (repeatable)",
    )
    p.add_argument("--band", choices=("minmax", "std", "none"), default="minmax", help="band around the seed mean")
    p.add_argument("--minimize", action="store_true", help="lower is better (e.g. a loss)")
    p.add_argument("--out", default="cost_aware_compare.png", help="PNG path (default ./cost_aware_compare.png)")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--title", help="plot title")
    p.add_argument("--no-progress", action="store_true", help="no progress bar while reading runs")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        fractions = tuple(float(f) for f in args.fractions.split(",") if f.strip())
        if not fractions or any(not 0 < f <= 1 for f in fractions):
            raise CompareError(f"--fractions {args.fractions!r}: need numbers in (0, 1]")
        runs = load_runs(args.runs, progress=False if args.no_progress else None)
        result = compare_runs(
            runs,
            metric=args.metric,
            x=args.x,
            smoothing=args.smooth,
            min_points=args.min_points,
            fractions=fractions,
            baseline=args.baseline,
            labels=args.label,
            arm_by=args.arm_by,
            band=args.band,
            minimize=args.minimize,
        )
    except CompareError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_report(result))
    if not args.no_plot:
        plot(result, args.out, title=args.title)
        print(f"\nplot: {args.out}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result.to_json(), fh, indent=2)
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
