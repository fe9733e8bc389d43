"""The suite's shared factories and helpers: one tiny-run config, one trainer factory, the rewards and the readers of
a run's logs. Imported by tests here and under benchmarks/tests (``from testing_utils import ...``; pytest puts
tests/ on the import path). The package is imported lazily, so pure-function tests can use these without the trainer.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trl_costaware.rows import plan as plan_module

# The suite's tiny run: 8 rows per rank (2 groups of 4), one micro-batch per optimizer step, 2 optimizer steps on CPU.
TINY_RUN = dict(
    use_cpu=True,
    report_to="none",
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=12,
    max_steps=2,
    logging_steps=1,
    save_strategy="no",
    bf16=False,
    seed=0,
    learning_rate=1e-3,
)

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")


def loss_settings(loss_type: str) -> dict:
    """The config fields a loss type needs besides `loss_type` (luspo is defined on sequence-level ratios)."""
    extra = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
    return {"loss_type": loss_type, **extra}


def make_config(tmp_path: Path | str | None = None, cls=None, **overrides):
    """A `CostAwareGRPOConfig` (or `cls`, e.g. `trl.GRPOConfig` for the baseline) of the tiny run, with `overrides`.
    Its output_dir is ``tmp_path/out`` (``"unused"`` without a `tmp_path`: for configs that never train)."""
    if cls is None:
        from trl_costaware import CostAwareGRPOConfig as cls
    output_dir = str(Path(tmp_path) / "out") if tmp_path is not None else "unused"
    return cls(**{"output_dir": output_dir, **TINY_RUN, **overrides})


def length_reward(completions, **kwargs):
    """Reward with within-group variance for an untrained model: completion length mod 4."""
    return [float(len(c) % 4) for c in completions]


def constant_reward(completions, **kwargs):
    """The same reward for every completion: every advantage is 0."""
    return [1.0 for _ in completions]


def tiny_dataset(n: int = 64, seed: int = 0, **kwargs):
    """The embedded arithmetic prompts the suite trains on."""
    from trl_costaware.embedded.arithmetic import arithmetic_dataset

    return arithmetic_dataset(n, seed=seed, **kwargs)


def make_trainer(
    model,
    tmp_path: Path | str | None = None,
    *,
    rewards=(length_reward,),
    dataset=None,
    eval_dataset=None,
    cls=None,
    args=None,
    layout: str | None = None,
    **overrides,
):
    """`cls` (default `CostAwareGRPOTrainer`) on `model` (a path or a model) with `make_config(tmp_path, **overrides)`
    (or the given `args`), `rewards`, `dataset` (default `tiny_dataset()`) and `eval_dataset`. `layout="even"` forces
    the even layout, which the trainer otherwise runs only with an entropy bonus or a router aux loss
    (`force_layout`)."""
    if cls is None:
        from trl_costaware import CostAwareGRPOTrainer as cls
    if args is None:
        config_cls = None
        if not _is_cost_aware_trainer(cls):
            from trl import GRPOConfig as config_cls
        args = make_config(tmp_path, cls=config_cls, **overrides)
    elif overrides:
        raise TypeError("pass either args or config overrides")
    train = tiny_dataset() if dataset is None else dataset
    trainer = cls(model, list(rewards), args=args, train_dataset=train, eval_dataset=eval_dataset)
    if layout is not None:
        force_layout(trainer, layout)
    return trainer


def _is_cost_aware_trainer(cls) -> bool:
    from trl_costaware import CostAwareGRPOTrainer

    return issubclass(cls, CostAwareGRPOTrainer)


def force_layout(trainer, layout: str):
    """Make a constructed trainer run `layout` ("even" or "packed"). The trainer chooses it at construction
    (`rows.layout.layout_for`) and reads `_layout` only when it draws and lays out a generation batch, so setting it
    before training is the same as a config that chose it."""
    assert layout in ("even", "packed"), layout
    assert trainer._cost_aware.layout in ("even", "packed"), (
        trainer._cost_aware.layout
    )  # the attribute the trainer reads
    trainer._cost_aware.layout = layout
    return trainer


def weights_of(model) -> torch.Tensor:
    """Every parameter, flattened into one float32 vector (a copy)."""
    return torch.cat([p.detach().flatten().float().clone() for p in model.parameters()])


def logged(trainer, key: str, after: int = 0) -> list:
    """Every logged value of `key`, from the log rows after step `after` (a resumed run's log_history starts with the
    checkpoint's)."""
    return [row[key] for row in trainer.state.log_history if key in row and row.get("step", 0) > after]


def last_metric(trainer, key: str):
    """The last logged value of `key` (fails if it was never logged)."""
    values = [row[key] for row in trainer.state.log_history if key in row]
    assert values, f"{key} never logged"
    return values[-1]


def record_draws(trainer) -> list:
    """Wrap the trainer's `_draw_kept_rows`: returns the list it fills with, per generation batch, (the batch as the
    sampler saw it, the kept indices, their factors)."""
    seen = []
    original = trainer._draw_kept_rows

    def recorded(batch):
        plan = original(batch)
        seen.append(({k: v for k, v in batch.items()}, plan.indices.clone(), plan.factors.clone()))
        return plan

    trainer._draw_kept_rows = recorded
    return seen


def fixed_batch(batch: dict):
    """A stand-in for `GRPOTrainer._generate_and_score_completions` returning one fixed batch (cloned each call)."""
    import copy

    def generate_and_score(trainer, inputs):
        return {k: (v.clone() if isinstance(v, torch.Tensor) else copy.copy(v)) for k, v in batch.items()}

    return generate_and_score


def recorded_draws(monkeypatch) -> list:
    """The draws `plan.plan_batch` makes from now on (it calls `draw_systematic` through its module global), appended
    to the returned list."""
    seen = []
    original = plan_module.draw_systematic

    def recorded(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append(out)
        return out

    monkeypatch.setattr(plan_module, "draw_systematic", recorded)
    return seen
