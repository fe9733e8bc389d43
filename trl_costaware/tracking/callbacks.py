"""Token-efficiency tracking: a local metrics record for every run, and W&B charts against policy tokens.

Two callbacks, both acting on the main process only:

- [`MetricsRecorderCallback`] writes ``<output_dir>/cost_aware_metrics.jsonl`` (one JSON object per log row: ``step``,
  ``epoch``, ``wall_time`` in seconds since training started, ``split`` and every numeric metric of the row under the
  trainer's own key, e.g. ``reward``, ``eval_reward``, ``cost_aware/policy_tokens``) and a sidecar
  ``<output_dir>/cost_aware_run.json`` (run name, group, arm, seed, loss type, kept fraction, model, full config).
  No W&B needed; `trl-costaware compare` reads both.
- [`WandbTokenAxisCallback`] (when ``"wandb"`` is in ``report_to``) puts the run in the W&B group
  ``cost_aware_run_group`` with job type = arm, and declares ``train/cost_aware/policy_tokens`` as the x-axis
  (``define_metric(..., step_metric=...)``) of the reward, eval and ``cost_aware/`` charts.

Both record, beside the config's fields as given, what the trainer resolved from them at construction
([`resolved_config`]: ``cost_aware_layout``, the micro-batch layout that runs): in the sidecar's ``config`` and in
the W&B run's config.

Wire them with [`attach_tracking`] after ``Trainer.__init__`` (it places the W&B callback before transformers'
``WandbCallback``, so that the run is created with its group), and call [`validate_report_to`] before
``Trainer.__init__``, so that a missing ``wandb`` is reported before the model is loaded.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import time
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

from ._extras import require
from .names import BASELINE_ARM, COST_AWARE_ARM, METRICS_FILE, RECORD_VERSION, RUN_FILE  # noqa: F401

TOKEN_AXIS = "cost_aware/policy_tokens"
# transformers' WandbCallback renames every key that does not start with eval_/test_ to "train/<key>"; the trainer puts
# the cumulative counters (un-prefixed) on eval rows too, so eval rows carry the same x-axis key.
WANDB_TOKEN_AXIS = f"train/{TOKEN_AXIS}"
# Charts drawn against policy tokens, as W&B keys (after transformers' rewrite). Globs end in "*" (W&B's only form).
WANDB_TOKEN_AXIS_GLOBS = ("train/reward*", "train/rewards/*", "train/cost_aware/*", "eval/*")


# ---------------------------------------------------------------------------------------------------- report_to checks
def _report_to(args) -> list[str]:
    report_to = getattr(args, "report_to", None)
    if report_to is None:
        return []
    if isinstance(report_to, str):
        report_to = [report_to]
    return [str(r) for r in report_to]


def wandb_requested(args) -> bool:
    """Whether ``args.report_to`` names W&B (``"all"`` is resolved by `TrainingArguments` to what is installed)."""
    return "wandb" in _report_to(args)


def validate_report_to(args) -> None:
    """Raise a clear error when ``report_to`` asks for W&B but ``wandb`` cannot be imported.

    Call it before ``Trainer.__init__`` (it then runs before the model is loaded). Nothing happens when W&B is not
    requested, and ``wandb`` is only imported when it is.
    """
    if not wandb_requested(args):
        return
    require(
        "wandb",
        "report_to including 'wandb'",
        "pip install wandb, or remove 'wandb' from report_to (the local record "
        "<output_dir>/cost_aware_metrics.jsonl is written either way)",
    )


# ---------------------------------------------------------------------------------------------------- run identity
def run_group(args) -> str | None:
    """The comparison group: ``cost_aware_run_group``, else ``$WANDB_RUN_GROUP``, else None."""
    return getattr(args, "cost_aware_run_group", None) or os.environ.get("WANDB_RUN_GROUP") or None


def run_arm(args) -> str:
    """``"cost_aware"`` or ``"baseline"`` (``cost_aware=False``, or a config without the field)."""
    return COST_AWARE_ARM if getattr(args, "cost_aware", False) else BASELINE_ARM


def _jsonable(value):
    try:
        json.dumps(value, allow_nan=False)
        return value
    except (TypeError, ValueError):
        if isinstance(value, float):
            return None
        if isinstance(value, dict):
            return {str(k): _jsonable(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [_jsonable(v) for v in value]
        return str(value)


def resolved_config(trainer) -> dict[str, Any]:
    """What the trainer resolved at construction, recorded beside the user's fields: ``cost_aware_layout``, the
    layout that runs (``trainer._cost_aware.layout``, "packed" or "even"). Empty for a trainer without one (plain
    GRPOTrainer)."""
    state = getattr(trainer, "_cost_aware", None)
    return {} if state is None else {"cost_aware_layout": state.layout}


def run_info(args, model=None) -> dict[str, Any]:
    """The sidecar record of a run: identity, arm, the fields that define it, and the whole config."""
    try:
        config = args.to_dict()
    except Exception:  # noqa: BLE001 - a config that cannot serialise itself still gets a record
        config = {}
    model_name = None
    if model is not None:
        model_name = getattr(getattr(model, "config", None), "_name_or_path", None)
    try:
        import transformers
        import trl

        versions = {"trl": trl.__version__, "transformers": transformers.__version__}
    except ImportError:  # pragma: no cover
        versions = {}
    try:
        from .._version import __version__ as pkg_version

        versions["trl_costaware"] = pkg_version
    except ImportError:  # pragma: no cover
        pass
    info = {
        "record_version": RECORD_VERSION,
        "run_name": getattr(args, "run_name", None),
        "group": run_group(args),
        "arm": run_arm(args),
        "cost_aware": bool(getattr(args, "cost_aware", False)),
        "seed": getattr(args, "seed", None),
        "loss_type": getattr(args, "loss_type", None),
        "kept_fraction": getattr(args, "cost_aware_kept_fraction", None)
        if getattr(args, "cost_aware", False)
        else 1.0,
        "token_budget": getattr(args, "cost_aware_token_budget", None),
        "proxy": getattr(args, "cost_aware_proxy", None),
        "model": model_name,
        "output_dir": os.path.abspath(args.output_dir) if getattr(args, "output_dir", None) else None,
        "world_size": getattr(args, "world_size", None),
        "report_to": _report_to(args),
        "versions": versions,
        "config": config,
    }
    return _jsonable(info)


# ---------------------------------------------------------------------------------------------------- local record
def _numeric(value):
    """A JSON-safe number, or None for anything that is not one (strings, tensors of several values, NaN/inf)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Number):
        value = float(value) if not isinstance(value, int) else value
        return value if not isinstance(value, float) or math.isfinite(value) else None
    item = getattr(value, "item", None)  # 0-d tensors / numpy scalars
    if callable(item):
        try:
            return _numeric(item())
        except (TypeError, ValueError, RuntimeError):
            return None
    return None


def _split(logs: dict) -> str:
    if "train_runtime" in logs:
        return "summary"
    if any(k.startswith("eval_") for k in logs):
        return "eval"
    if any(k.startswith("test_") for k in logs):
        return "test"
    return "train"


class MetricsRecorderCallback(TrainerCallback):
    """Writes every log row to ``<output_dir>/cost_aware_metrics.jsonl`` and the run's identity to
    ``<output_dir>/cost_aware_run.json``. Main process only.

    Each line is a JSON object: ``step`` (global step), ``epoch``, ``wall_time`` (seconds since training started,
    continued across a resume), ``time`` (Unix time), ``split`` (``train``/``eval``/``summary``) and every numeric
    value of the row under the trainer's key. Non-finite values are written as ``null``. On a resume the rows logged
    after the checkpoint's step are dropped (they are logged again).
    """

    def __init__(self, output_dir: str | None = None, resolved: Callable[[], dict] | None = None):
        self.output_dir = output_dir
        self.resolved = resolved  # [`resolved_config`] of the trainer, read at train begin (added to the config)
        self._start = None
        self._offset = 0.0
        self._path = None
        self._info_path = None
        self._info = None

    # Paths are resolved at train begin: args.output_dir is final by then.
    def _paths(self, args):
        out = self.output_dir or args.output_dir
        return os.path.join(out, METRICS_FILE), os.path.join(out, RUN_FILE)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero:
            return
        self._path, info_path = self._paths(args)
        os.makedirs(os.path.dirname(self._path) or ".", exist_ok=True)
        # A resume (global_step > 0), or a record this callback already started (e.g. trainer.evaluate() before
        # train()): keep the rows up to the current step. A fresh run starts a new file.
        kept, self._offset = self._resume_rows(state.global_step, continuing=self._start is not None)
        with open(self._path, "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r, allow_nan=False) + "\n" for r in kept)
        self._info = run_info(args, model)
        if self.resolved is not None:
            self._info["config"].update(_jsonable(self.resolved()))
        self._info.update(
            {
                "status": "running",
                "start_time": time.time(),
                "resumed_from_step": state.global_step or None,
                "metrics_file": METRICS_FILE,
                "wandb": _wandb_run_ref(),
            }
        )
        self._write_info(info_path)
        self._start = time.time()

    def _resume_rows(self, global_step: int, continuing: bool = False):
        """Rows of a previous record up to ``global_step`` (a resume), and the wall time they end at."""
        if not (global_step or continuing) or not os.path.exists(self._path):
            return [], 0.0
        kept = []
        with open(self._path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if row.get("step", 0) <= global_step and row.get("split") != "summary":
                    kept.append(row)
        return kept, max((r.get("wall_time") or 0.0 for r in kept), default=0.0)

    def _write_info(self, info_path=None):
        self._info_path = info_path or self._info_path
        tmp = self._info_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(self._info, fh, indent=2, allow_nan=False)
        os.replace(tmp, self._info_path)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if self._start is None:  # logging outside train() (e.g. trainer.evaluate() alone): start the record here
            self.on_train_begin(args, state, control, model=kwargs.get("model"))
        now = time.time()
        row = {
            "step": state.global_step,
            "epoch": _numeric(state.epoch),
            "wall_time": round(now - self._start + self._offset, 4),
            "time": round(now, 3),
            "split": _split(logs),
        }
        for key, value in logs.items():
            if key in row:
                continue
            number = _numeric(value)
            if number is not None or isinstance(value, float):
                row[key] = number
        with open(self._path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row, allow_nan=False) + "\n")
        if self._info is not None and self._info.get("wandb") is None and (ref := _wandb_run_ref()):
            self._info["wandb"] = ref
            self._write_info()

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or self._info is None:
            return
        self._info.update(
            {
                "status": "finished",
                "end_time": time.time(),
                "global_step": state.global_step,
                "wall_time": round(time.time() - self._start + self._offset, 4),
                "wandb": self._info.get("wandb") or _wandb_run_ref(),
            }
        )
        self._write_info()


def _wandb_run_ref() -> dict | None:
    """Id, path and local folder of the active W&B run, if wandb is imported and a run is active."""
    import sys

    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    if run is None:
        return None
    try:
        return {
            "id": run.id,
            "path": "/".join(p for p in (run.entity, run.project, run.id) if p),
            "dir": os.path.dirname(run.dir) if run.dir else None,
            "group": run.group or None,
            "offline": bool(run.settings._offline),
        }
    except Exception:  # noqa: BLE001 - a reference is a convenience, never worth failing a run
        return None


# ---------------------------------------------------------------------------------------------------- W&B
def _wandb_key(key: str) -> str:
    """The W&B key transformers' WandbCallback logs `key` under."""
    for prefix in ("eval_", "test_"):
        if key.startswith(prefix):
            return f"{prefix[:-1]}/{key[len(prefix) :]}"
    return f"train/{key}"


class WandbTokenAxisCallback(TrainerCallback):
    """Group and x-axis for W&B runs: ``cost_aware_run_group`` as the run group, the arm as the job type, and
    ``train/cost_aware/policy_tokens`` as the step metric of the reward, eval and ``cost_aware/`` charts.

    Placed before transformers' ``WandbCallback`` (see [`attach_tracking`]), it makes the ``wandb.init`` call that
    callback would make (project ``$WANDB_PROJECT`` or ``"huggingface"``, name ``run_name``) with ``group=`` and
    ``job_type=`` added; ``WandbCallback`` then finds the run and adds the config and its own definitions, as it does
    for a run made by hand. (Environment variables cannot carry the group: wandb reads them once per process, so a
    second run in the same process would keep the first one's.) Placed after it, the run exists already: only the
    metric definitions are made, and a group that differs gets a warning. Every logged key matching the chart
    patterns is also defined by its exact name, which takes precedence over the ``"*"`` glob transformers defines
    with ``train/global_step`` as x-axis. ``resolved`` ([`resolved_config`] of the trainer) is added to the run's
    config. Main process only; hyperparameter searches are left to ``WandbCallback``.
    """

    def __init__(
        self,
        group: str | None = None,
        job_type: str | None = None,
        step_metric: str = WANDB_TOKEN_AXIS,
        resolved: Callable[[], dict] | None = None,
    ):
        self.group = group
        self.job_type = job_type
        self.step_metric = step_metric
        self.resolved = resolved
        self._run = None
        self._defined: set[str] = set()

    @staticmethod
    def _wandb():
        return require("wandb", "the W&B token axis (report_to including 'wandb')")

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        wandb = self._wandb()
        if wandb.run is None and not state.is_hyper_param_search:
            init_args = {"project": os.getenv("WANDB_PROJECT", "huggingface")}
            if args.run_name is not None:
                init_args["name"] = args.run_name
            if self.group:
                init_args["group"] = self.group
            if self.job_type and not os.environ.get("WANDB_JOB_TYPE"):
                init_args["job_type"] = self.job_type
            wandb.init(**init_args)
        self._ensure(state)

    def _ensure(self, state) -> bool:
        """Set up the current run once (again after a hyperparameter-search trial made a new one)."""
        if not state.is_world_process_zero:
            return False
        run = self._wandb().run
        if run is None:
            return False
        if run is not self._run:
            self._defined = set()
            self._setup(run)
        return True

    def _setup(self, run):
        self._run = run
        if self.group and (run.group or None) != self.group:
            self._wandb().termwarn(
                f"cost_aware_run_group={self.group!r} could not be applied: the W&B run already existed (group "
                f"{run.group or None!r}), made by wandb.init or by transformers' WandbCallback running first. Add "
                "the callbacks with trl_costaware.tracking.callbacks.attach_tracking(trainer), or call "
                "wandb.init(group=...).",
                repeat=False,
            )
        if self.resolved is not None and (entries := self.resolved()):
            run.config.update(entries, allow_val_change=True)
        run.define_metric(self.step_metric, summary="max")
        for glob in WANDB_TOKEN_AXIS_GLOBS:
            run.define_metric(glob, step_metric=self.step_metric)
        if self.job_type:
            with contextlib.suppress(Exception):  # tags are cosmetic
                run.tags = tuple(dict.fromkeys((*(run.tags or ()), self.job_type)))

    def _charted(self, wandb_key: str) -> bool:
        # W&B globs are prefix globs ("prefix*").
        return wandb_key != self.step_metric and any(wandb_key.startswith(g[:-1]) for g in WANDB_TOKEN_AXIS_GLOBS)

    def on_epoch_begin(self, args, state, control, **kwargs):
        self._ensure(state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self._ensure(state) or not logs:
            return
        for key in logs:
            wkey = _wandb_key(key)
            if wkey not in self._defined and self._charted(wkey):
                self._run.define_metric(wkey, step_metric=self.step_metric)
                self._defined.add(wkey)


def tracking_callbacks(args, resolved: Callable[[], dict] | None = None) -> list[TrainerCallback]:
    """The tracking callbacks for a run: the local record always, the W&B axis/group when W&B is requested.
    ``resolved``: called at train begin for the entries to add to the recorded config ([`resolved_config`])."""
    callbacks: list[TrainerCallback] = [MetricsRecorderCallback(resolved=resolved)]
    if wandb_requested(args):
        callbacks.append(WandbTokenAxisCallback(group=run_group(args), job_type=run_arm(args), resolved=resolved))
    return callbacks


def attach_tracking(trainer) -> list[TrainerCallback]:
    """Add [`tracking_callbacks`] to a constructed trainer; the W&B one goes just before transformers'
    ``WandbCallback``, so that it creates the run (with its group) before that callback would. Idempotent: returns
    the tracking callbacks the trainer has. The trainer's [`resolved_config`] is read at train begin (the trainer
    resolves its layout after attaching them)."""
    handler = trainer.callback_handler
    present = [cb for cb in handler.callbacks if isinstance(cb, (MetricsRecorderCallback, WandbTokenAxisCallback))]
    if present:  # already attached (e.g. by the trainer itself): idempotent
        return present
    callbacks = tracking_callbacks(trainer.args, resolved=lambda: resolved_config(trainer))
    for cb in callbacks:
        if isinstance(cb, WandbTokenAxisCallback):
            names = [type(c).__name__ for c in handler.callbacks]
            if "WandbCallback" in names:
                handler.callbacks.insert(names.index("WandbCallback"), cb)
                continue
        trainer.add_callback(cb)
    return callbacks
