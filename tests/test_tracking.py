"""Tracking: the local metrics record and the W&B group / token x-axis, on a real offline W&B run of the trainer."""

from __future__ import annotations

import json
import os
import sys
import types

import pytest
from transformers import TrainerState

from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer
from trl_costaware.embedded.arithmetic import arithmetic_dataset, arithmetic_reward
from trl_costaware.embedded.model import tiny_model_path
from trl_costaware.tracking.callbacks import (
    METRICS_FILE,
    RUN_FILE,
    WANDB_TOKEN_AXIS,
    MetricsRecorderCallback,
    WandbTokenAxisCallback,
    attach_tracking,
    tracking_callbacks,
    validate_report_to,
)
from trl_costaware.tracking.compare.readers import canonical_key

GROUP = "tracking-test-group"


def ensure_tracking(trainer):
    """Attach the tracking callbacks unless the trainer already does it itself."""
    if not any(isinstance(cb, MetricsRecorderCallback) for cb in trainer.callback_handler.callbacks):
        attach_tracking(trainer)


def tiny_args(output_dir, **overrides):
    kwargs = {
        "output_dir": str(output_dir),
        "use_cpu": True,
        "report_to": "none",
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 16,
        "max_steps": 4,
        "logging_steps": 1,
        "bf16": False,
        "save_strategy": "no",
        "eval_strategy": "steps",
        "eval_steps": 2,
        "per_device_eval_batch_size": 8,
        "disable_tqdm": True,
    }
    kwargs.update(overrides)
    return CostAwareGRPOConfig(**kwargs)


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory):
    """One real 4-step cost-aware run logging to an offline W&B run; returns the trainer, its output dir, the W&B run's
    group / job type / config / folder, and what was logged to and defined on the W&B run."""
    wandb = pytest.importorskip("wandb")
    root = tmp_path_factory.mktemp("wandb_run")
    env = {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(root),
        "WANDB_PROJECT": "trl-costaware-tests",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "OMP_NUM_THREADS": "1",
    }
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        mp.delenv("WANDB_RUN_GROUP", raising=False)
        mp.delenv("WANDB_JOB_TYPE", raising=False)
        wandb.teardown()  # wandb reads its environment once per process (at setup): start afresh with this one
        # What the trainer hands to W&B, seen at the W&B run's own methods (transformers logs through wandb.log,
        # which is the run's bound `log` once it exists); the originals still run.
        from wandb.sdk.wandb_run import Run

        logged, defined = [], {}
        original_log, original_define = Run.log, Run.define_metric

        def log(self, data, *args, **kwargs):
            logged.append({canonical_key(k): v for k, v in data.items()})
            return original_log(self, data, *args, **kwargs)

        def define_metric(self, name, *args, **kwargs):
            defined[name] = kwargs.get("step_metric")
            return original_define(self, name, *args, **kwargs)

        mp.setattr(Run, "log", log)
        mp.setattr(Run, "define_metric", define_metric)
        out = root / "out"
        args = tiny_args(out, report_to=["wandb"], cost_aware_run_group=GROUP, run_name="ca-tracking")
        validate_report_to(args)
        trainer = CostAwareGRPOTrainer(
            tiny_model_path(),
            [arithmetic_reward],
            args=args,
            train_dataset=arithmetic_dataset(64, seed=0),
            eval_dataset=arithmetic_dataset(8, seed=1),
        )
        ensure_tracking(trainer)
        trainer.train()
        run = wandb.run
        seen = {"group": run.group, "job_type": run.job_type, "config": dict(run.config), "dir": run.dir}
        wandb.finish()
        wandb.teardown()  # waits until the service has written the run; the next wandb user re-reads the env
    return types.SimpleNamespace(trainer=trainer, out=out, run=seen, logged=logged, defined=defined)


def read_jsonl(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh]


# ---------------------------------------------------------------------------------------------------- local record
def test_local_record_rows(wandb_run):
    rows = read_jsonl(wandb_run.out / METRICS_FILE)
    train = [r for r in rows if r["split"] == "train"]
    evals = [r for r in rows if r["split"] == "eval"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert [r["step"] for r in evals] == [2, 4]
    assert rows[-1]["split"] == "summary"
    for r in train:
        for key in (
            "reward",
            "cost_aware/policy_tokens",
            "cost_aware/generated_tokens",
            "cost_aware/kept_row_fraction",
        ):
            assert isinstance(r[key], (int, float)), key
        assert r["epoch"] > 0
    for r in evals:
        assert "eval_reward" in r and "cost_aware/policy_tokens" in r
    tokens = [r["cost_aware/policy_tokens"] for r in rows]
    walls = [r["wall_time"] for r in rows]
    assert tokens == sorted(tokens) and tokens[0] > 0
    assert walls == sorted(walls) and walls[0] >= 0


def test_local_record_matches_log_history(wandb_run):
    rows = read_jsonl(wandb_run.out / METRICS_FILE)
    history = wandb_run.trainer.state.log_history
    assert len(rows) == len(history)
    for row, logged in zip(rows, history, strict=True):
        assert row["step"] == logged["step"]
        for key, value in logged.items():
            # total_flos: transformers' ProgressCallback pops it from the row before later callbacks see it
            if isinstance(value, (int, float)) and key not in ("step", "total_flos"):
                assert row[key] == pytest.approx(value), key


def test_run_sidecar(wandb_run):
    info = json.loads((wandb_run.out / RUN_FILE).read_text())
    assert info["group"] == GROUP
    assert info["arm"] == "cost_aware" and info["cost_aware"] is True
    assert info["seed"] == 42
    assert info["loss_type"] == wandb_run.trainer.args.loss_type
    assert info["kept_fraction"] == wandb_run.trainer.args.cost_aware_kept_fraction
    assert info["model"] and "tiny-llama" in info["model"]
    assert info["status"] == "finished" and info["global_step"] == 4
    assert info["wandb"]["id"] and info["wandb"]["offline"] is True
    assert info["config"]["cost_aware_run_group"] == GROUP


# ---------------------------------------------------------------------------------------------------- W&B run
def test_wandb_run_gets_group_arm_and_metrics(wandb_run):
    assert wandb_run.run["group"] == GROUP  # the W&B run's own group, not the config field
    assert wandb_run.run["job_type"] == "cost_aware"
    assert wandb_run.run["config"]["cost_aware"] is True
    assert os.path.isdir(wandb_run.run["dir"])  # an offline run folder was written
    train = [r for r in wandb_run.logged if "reward" in r]
    evals = [r for r in wandb_run.logged if "eval_reward" in r]
    assert len(train) == 4 and len(evals) == 2
    for r in train:
        assert {"cost_aware/policy_tokens", "cost_aware/kept_row_fraction", "cost_aware/j_ratio_ideal"} <= set(r)
    assert all("cost_aware/policy_tokens" in r for r in evals)
    local = [r for r in read_jsonl(wandb_run.out / METRICS_FILE) if r["split"] == "train"]
    assert [r["cost_aware/policy_tokens"] for r in train] == [r["cost_aware/policy_tokens"] for r in local]
    assert [r["reward"] for r in train] == pytest.approx([r["reward"] for r in local])


def test_wandb_run_gets_token_axis(wandb_run):
    defined = wandb_run.defined
    assert WANDB_TOKEN_AXIS == "train/cost_aware/policy_tokens"
    assert WANDB_TOKEN_AXIS in defined and defined[WANDB_TOKEN_AXIS] is None  # the x-axis itself is defined
    for glob in ("train/reward*", "eval/*", "train/cost_aware/*"):
        assert defined[glob] == WANDB_TOKEN_AXIS
    # exact names beat transformers' "*" -> train/global_step glob
    for name in ("train/reward", "train/reward_std", "eval/reward", "train/cost_aware/kept_row_fraction"):
        assert defined[name] == WANDB_TOKEN_AXIS, name
    assert defined["*"] == "train/global_step"


def test_resolved_layout_is_recorded(wandb_run):
    """The layout the trainer chose (not a config field) is recorded as `cost_aware_layout` in the W&B config and in
    the local run record."""
    layout = wandb_run.trainer._cost_aware.layout
    assert layout == "packed" and not hasattr(wandb_run.trainer.args, "cost_aware_layout")
    assert wandb_run.run["config"]["cost_aware_layout"] == layout
    info = json.loads((wandb_run.out / RUN_FILE).read_text())
    assert info["config"]["cost_aware_layout"] == layout


# ---------------------------------------------------------------------------------------------------- units
def test_validate_report_to_missing_wandb(monkeypatch, tmp_path):
    args = types.SimpleNamespace(report_to=["wandb"])
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ImportError, match="pip install wandb"):
        validate_report_to(args)
    validate_report_to(types.SimpleNamespace(report_to=[]))  # not requested: nothing imported, no error
    validate_report_to(types.SimpleNamespace(report_to="none"))
    assert [type(cb) for cb in tracking_callbacks(types.SimpleNamespace(report_to=[]))] == [MetricsRecorderCallback]


def test_tracking_callbacks_with_wandb():
    args = types.SimpleNamespace(report_to=["wandb"], cost_aware_run_group="g", cost_aware=False)
    callbacks = tracking_callbacks(args)
    assert [type(cb) for cb in callbacks] == [MetricsRecorderCallback, WandbTokenAxisCallback]
    assert callbacks[1].group == "g" and callbacks[1].job_type == "baseline"


def _state(step=0, zero=True):
    state = TrainerState()
    state.global_step = step
    state.epoch = 0.5
    state.is_world_process_zero = zero
    return state


def test_recorder_main_process_only(tmp_path):
    args = tiny_args(tmp_path)
    cb = MetricsRecorderCallback()
    state = _state(zero=False)
    cb.on_train_begin(args, state, None)
    cb.on_log(args, state, None, logs={"reward": 1.0})
    cb.on_train_end(args, state, None)
    assert not (tmp_path / METRICS_FILE).exists() and not (tmp_path / RUN_FILE).exists()


def test_recorder_resume_keeps_rows_up_to_checkpoint(tmp_path):
    args = tiny_args(tmp_path)
    rows = [{"step": s, "wall_time": float(s), "split": "train", "reward": s / 10} for s in (1, 2, 3, 4)]
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    cb = MetricsRecorderCallback()
    state = _state(step=2)
    cb.on_train_begin(args, state, None)
    state.global_step = 3
    cb.on_log(args, state, None, logs={"reward": 0.9, "bad": float("nan"), "text": "x"})
    out = read_jsonl(tmp_path / METRICS_FILE)
    assert [r["step"] for r in out] == [1, 2, 3]
    assert out[-1]["reward"] == 0.9 and out[-1]["bad"] is None and "text" not in out[-1]
    assert out[-1]["wall_time"] >= 2.0  # continues the earlier wall clock
    assert json.loads((tmp_path / RUN_FILE).read_text())["resumed_from_step"] == 2


class _FakeRun:
    def __init__(self, group=None):
        self.group = group
        self.tags = ()
        self.defined = {}

    def define_metric(self, name, step_metric=None, **kwargs):
        self.defined[name] = step_metric


def test_wandb_callback_before_and_after_wandb_init(monkeypatch, tmp_path):
    fake = types.SimpleNamespace(run=None, warnings=[], inits=[])
    fake.termwarn = lambda msg, **k: fake.warnings.append(msg)

    def init(**kwargs):
        fake.inits.append(kwargs)
        fake.run = _FakeRun(group=kwargs.get("group"))
        return fake.run

    fake.init = init
    monkeypatch.setattr(WandbTokenAxisCallback, "_wandb", staticmethod(lambda: fake))
    monkeypatch.setenv("WANDB_PROJECT", "proj")
    monkeypatch.delenv("WANDB_JOB_TYPE", raising=False)
    args, state = tiny_args(tmp_path, run_name="r1"), _state()

    # Before WandbCallback: the run is made here, with the group and job type (WandbCallback then reuses it).
    cb = WandbTokenAxisCallback(group="g1", job_type="cost_aware")
    cb.on_train_begin(args, state, None)
    assert fake.inits == [{"project": "proj", "name": "r1", "group": "g1", "job_type": "cost_aware"}]
    cb.on_log(args, state, None, logs={"reward": 0.1, "eval_reward": 0.2, "loss": 0.0, "cost_aware/policy_tokens": 9})
    assert fake.run.defined["train/reward"] == WANDB_TOKEN_AXIS
    assert fake.run.defined["eval/reward"] == WANDB_TOKEN_AXIS
    assert "train/loss" not in fake.run.defined
    assert fake.run.defined[WANDB_TOKEN_AXIS] is None
    assert fake.run.tags == ("cost_aware",) and not fake.warnings

    # After WandbCallback (run already made without the group): metrics still defined, a warning about the group.
    fake.run, fake.inits = _FakeRun(group=None), []
    cb = WandbTokenAxisCallback(group="g2", job_type="baseline")
    cb.on_train_begin(args, state, None)
    assert not fake.inits
    assert fake.run.defined["train/reward*"] == WANDB_TOKEN_AXIS and fake.warnings

    # Non-zero ranks do nothing.
    fake.run = None
    cb = WandbTokenAxisCallback(group="g3")
    cb.on_train_begin(args, _state(zero=False), None)
    cb.on_log(args, _state(zero=False), None, logs={"reward": 1.0})
    assert fake.run is None and not fake.inits


def test_evaluate_before_train_row_is_kept(tmp_path):
    args = tiny_args(tmp_path)
    cb = MetricsRecorderCallback()
    state = _state(step=0)
    cb.on_log(args, state, None, logs={"eval_reward": 0.25})  # trainer.evaluate() before train()
    cb.on_train_begin(args, state, None)
    state.global_step = 1
    cb.on_log(args, state, None, logs={"reward": 0.5})
    rows = read_jsonl(tmp_path / METRICS_FILE)
    assert [(r["split"], r["step"]) for r in rows] == [("eval", 0), ("train", 1)]


def test_attach_tracking_is_idempotent(tmp_path):
    trainer = types.SimpleNamespace(args=tiny_args(tmp_path), callback_handler=types.SimpleNamespace(callbacks=[]))
    trainer.add_callback = trainer.callback_handler.callbacks.append
    first = attach_tracking(trainer)
    assert attach_tracking(trainer) == first and len(trainer.callback_handler.callbacks) == 1
