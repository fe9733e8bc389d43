"""The "compute" rule in real runs of the trainer on the embedded tiny model (CPU, one process): what the noise scale
reads, what the plan decides from it, the measured costs, the config's refusals."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from test_trainer import length_reward
from test_trainer import make_args as trainer_args
from transformers import TrainerCallback

from trl_costaware import CostAwareGRPOTrainer
from trl_costaware import trainer as trainer_module
from trl_costaware.core.sampling import capped_kept_count, gradient_proxy
from trl_costaware.embedded.arithmetic import arithmetic_dataset
from trl_costaware.embedded.model import tiny_model_path as build_tiny_model_path
from trl_costaware.kept_count.compute_budget import cheapest_kept_count
from trl_costaware.kept_count.noise_probe import NoiseProbe
from trl_costaware.kept_count.step_signals import PARAM_GRAD, ZERO0, ZERO1, ComputeSignals, gradient_source


@pytest.fixture(scope="module")
def model_path():
    return build_tiny_model_path()


def make_args(tmp_path, **overrides):
    """test_trainer's tiny run, 2 micro-steps per generation batch, 5 steps, the "compute" rule (token model)."""
    settings = dict(gradient_accumulation_steps=2, steps_per_generation=2, max_completion_length=12, max_steps=5)
    settings.update(cost_aware_kept_fraction="compute", cost_aware_cost_model="tokens")
    return trainer_args(tmp_path, **{**settings, **overrides})


class Recording(CostAwareGRPOTrainer):
    """Keeps a copy of the gradient the noise scale reads at each optimizer step."""

    def _init_compute_signals(self):
        super()._init_compute_signals()
        self.seen = []

    def _observe_gradient(self, model, scaled=True):
        if self._observed_step != self.state.global_step:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            self.seen.append(torch.cat([g.detach().flatten().clone() for g in grads]))
        super()._observe_gradient(model, scaled=scaled)


def train(model_path, args, cls=CostAwareGRPOTrainer):
    trainer = cls(model_path, reward_funcs=length_reward, args=args, train_dataset=arithmetic_dataset(64, seed=0))
    trainer.train()
    return trainer


def step_rows(trainer):
    return [row for row in trainer.state.log_history if "cost_aware/kept_row_fraction" in row]


@pytest.mark.parametrize("max_grad_norm", [0.05, 0.0])
def test_noise_scale_reads_the_step_gradient_before_clipping(model_path, tmp_path, max_grad_norm):
    """|G_t|² is the square of the pre-clip norm the Trainer logs (clipped at 0.05: the clip changes the gradient
    after the read; 0: read in the pre-optimizer callback); G_t · G_t' pairs each step with the previous one (one
    optimizer step per generation batch here); the first step has no pair."""
    trainer = train(model_path, make_args(tmp_path, max_grad_norm=max_grad_norm), Recording)
    rows = step_rows(trainer)
    assert len(rows) == len(trainer.seen) == 5
    for row, grad in zip(rows, trainer.seen, strict=True):
        assert row["cost_aware/noise_grad_sq"] == pytest.approx(float(grad.pow(2).sum()), rel=1e-5)
        if max_grad_norm > 0:
            assert row["grad_norm"] ** 2 == pytest.approx(row["cost_aware/noise_grad_sq"], rel=1e-4)
    assert "cost_aware/noise_grad_dot" not in rows[0]
    for row, grad, previous in zip(rows[1:], trainer.seen[1:], trainer.seen[:-1], strict=True):
        assert row["cost_aware/noise_grad_dot"] == pytest.approx(float(grad @ previous), rel=1e-4, abs=1e-9)
    if max_grad_norm > 0:
        assert any(row["cost_aware/grad_clipped"] == 1.0 for row in rows)


def test_plan_keeps_the_cheapest_count_from_the_measured_signal(model_path, tmp_path, monkeypatch):
    """Every row that can carry gradient until the noise scale has an estimate; then the plan's own count is the
    rule's on the batch it saw (recomputed here from the plan's distribution and rows), capped as every rule is."""
    seen = []
    original = trainer_module.plan_batch

    def record(rows, settings, generator=None, collective=None, signal=None):
        plan = original(rows, settings, generator, collective, signal)
        seen.append((rows, settings, signal, plan))
        return plan

    monkeypatch.setattr(trainer_module, "plan_batch", record)
    train(model_path, make_args(tmp_path, max_steps=6))
    assert len(seen) == 6
    assert seen[0][2].rho is None and seen[0][3].metrics["compute_rule_fallback"] == 1.0
    k = seen[0][1].kept_multiple  # the layout's rounding of m (the packed layout: optimizer steps per batch)
    assert seen[0][3].m == capped_kept_count(16, int(seen[0][3].eligible.sum()), k)
    decided = 0
    for rows, _settings, signal, plan in seen[2:]:
        assert signal.rho is not None and plan.metrics["compute_rule_fallback"] == 0.0
        g = gradient_proxy(rows.advantages) * plan.eligible
        fixed, per_token = signal.costs(float(rows.generated_tokens.sum()))
        assert fixed == pytest.approx(1.2 * float(rows.generated_tokens.sum())) and per_token == 1.0
        tokens = rows.prompt_tokens + rows.completion_tokens
        expected = cheapest_kept_count(g, plan.p, tokens, signal.rho, fixed, per_token, k, "systematic")
        assert plan.rule_m == expected.m
        assert plan.m == capped_kept_count(expected.m, int(plan.eligible.sum()), k)
        assert plan.metrics["compute_cost_ratio"] == pytest.approx(expected.cost_ratio)
        decided += 1
    assert decided == 4


def test_time_model_prices_steps_in_measured_seconds(model_path, tmp_path):
    """The token model until the first window closes, then seconds: a fixed cost of generation, scoring and the
    optimizer step, and a price per kept policy token; both logged per window."""
    trainer = train(model_path, make_args(tmp_path, cost_aware_cost_model="time", max_steps=4))
    rows = step_rows(trainer)
    first = rows[0]
    assert first["cost_aware/cost_per_token"] == 1.0 and first["cost_aware/cost_fixed"] > 100  # tokens
    for row in rows[1:]:
        assert 0 < row["cost_aware/cost_fixed"] < 60 and 0 < row["cost_aware/cost_per_token"] < 1
        assert row["cost_aware/time_fixed_s"] > 0 and row["cost_aware/time_update_s"] > 0


def test_compute_state_round_trip(model_path, tmp_path):
    """`_compute_state` through torch.save / torch.load(weights_only=True) into a fresh trainer: the noise scale's
    and the costs' averages, the step's inflation and rows, and the window of the latest generation batch (all its
    micro-steps done here: one optimizer step per batch); not the stored gradient (the lag starts again)."""
    args = make_args(tmp_path, cost_aware_cost_model="time", max_steps=3)
    trainer = train(model_path, args)
    assert trainer._window is not None and trainer._window["tokens"] > 0
    path = tmp_path / "compute.pt"
    torch.save(trainer._compute_state(), path)
    fresh = CostAwareGRPOTrainer(
        model_path, reward_funcs=length_reward, args=args, train_dataset=arithmetic_dataset(64, seed=0)
    )
    fresh._load_compute_state(torch.load(path, weights_only=True))
    assert fresh._noise == trainer._noise and fresh._noise.ratio == trainer._noise.ratio
    assert (fresh._fixed_cost, fresh._token_cost) == (trainer._fixed_cost, trainer._token_cost)
    assert fresh._window == trainer._window and fresh._window is not trainer._window
    assert (fresh._step_inflation, fresh._step_rows) == (trainer._step_inflation, trainer._step_rows)
    assert trainer._previous_grad is not None and fresh._previous_grad is None


def test_compute_state_drops_a_window_inside_its_batch(model_path, tmp_path):
    """A checkpoint inside a generation batch (2 optimizer steps per batch, stopped after the first): the window's
    train time is partial and the resumed run generates a new batch, so the window is not saved."""
    trainer = train(model_path, make_args(tmp_path, steps_per_generation=4, max_steps=1))
    assert trainer._window is not None
    assert trainer._compute_state()["window"] is None


def test_resume_continues_the_compute_state(model_path, tmp_path):
    """A run resumed from its step-2 checkpoint (at a generation batch's end) closes as many cost windows as the
    uninterrupted run (the open window is restored: before, it was lost), continues the noise scale's averages, and
    loses one pair of steps (the stored gradient is not saved: the first step after the resume has no pair)."""
    settings = dict(cost_aware_cost_model="time", max_steps=4, save_strategy="steps", save_steps=2)
    whole = train(model_path, make_args(tmp_path / "whole", **settings))
    loaded = []

    class Loading(CostAwareGRPOTrainer):
        def _load_compute_state(self, state):
            super()._load_compute_state(state)
            loaded.append((self._window, self._noise.count, self._fixed_cost.weight))

    args = make_args(tmp_path / "resumed", **settings)
    resumed = Loading(model_path, reward_funcs=length_reward, args=args, train_dataset=arithmetic_dataset(64, seed=0))
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "out" / "checkpoint-2"))
    assert len(loaded) == 1
    window, count, weight = loaded[0]
    assert window is not None and window["tokens"] > 0 and window["train"] > 0
    assert count == 1 and weight == pytest.approx(1 - 0.9)  # 2 steps: one pair, one closed window
    assert resumed._fixed_cost.weight == pytest.approx(whole._fixed_cost.weight)  # 3 windows closed in 4 batches
    assert resumed._token_cost.weight == pytest.approx(whole._token_cost.weight)
    assert resumed._noise.count == whole._noise.count - 1 == 2
    rows = [row for row in resumed.state.log_history if row.get("step", 0) > 2 and "cost_aware/noise_grad_sq" in row]
    assert len(rows) == 2 and "cost_aware/noise_grad_dot" not in rows[0] and "cost_aware/noise_grad_dot" in rows[1]


def test_other_rules_read_no_gradient(model_path, tmp_path):
    trainer = train(model_path, make_args(tmp_path, cost_aware_kept_fraction=0.5, max_steps=2))
    assert trainer._previous_grad is None
    assert not any("cost_aware/noise_grad_sq" in row for row in trainer.state.log_history)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("cost_aware_cost_model", "flops", "cost_aware_cost_model must be one of"),
        ("cost_aware_generation_token_cost", 0.0, "cost_aware_generation_token_cost"),
        ("cost_aware_token_budget", 100, "both choose the kept row count"),
        ("cost_aware_layout", "full", "needs a fixed cost_aware_kept_fraction"),
    ],
)
def test_config_refuses(tmp_path, field, value, match):
    with pytest.raises(ValueError, match=match):
        make_args(tmp_path, **{field: value})


def test_config_parses_the_rule_from_text(tmp_path):
    assert make_args(tmp_path, cost_aware_kept_fraction="Compute").cost_aware_kept_fraction == "compute"
    with pytest.raises(ValueError, match="'auto' or 'compute'"):
        make_args(tmp_path, cost_aware_kept_fraction="cheapest")


def test_rule_sees_the_estimators_noise_scale(model_path, tmp_path):
    """The signal handed to the plan carries the noise scale's current ratio (None before the first pair of steps),
    whatever the plan then does with it."""

    class Watching(CostAwareGRPOTrainer):
        def _init_compute_signals(self):
            super()._init_compute_signals()
            self.pairs = []

        def _compute_signal(self):
            signal = super()._compute_signal()
            self.pairs.append((self._noise.ratio, signal.rho))
            return signal

    # the noise probe off: the consecutive steps' estimator (the probe's path: tests/test_noise_probe.py)
    trainer = train(model_path, make_args(tmp_path, max_steps=4, cost_aware_noise_probe_every=0), Watching)
    assert trainer.pairs[0] == (None, None)
    assert all(rho == pytest.approx(ratio) for ratio, rho in trainer.pairs[2:])
    assert len({ratio for ratio, _ in trainer.pairs[2:]}) > 1  # the estimate moves from batch to batch


@pytest.mark.parametrize("steps_per_generation,accumulation", [(2, 4), (3, 2), (2, 2)])
def test_noise_scale_is_in_rows_of_one_optimizer_step(model_path, tmp_path, steps_per_generation, accumulation):
    """`cost_aware/noise_scale` = ρ × the rows behind one optimizer step's gradient, N·G/S = per_device_batch × G on
    one process, also when G does not divide S (S = 2, G = 4: a step spans two generation batches; S = 3, G = 2: a
    generation batch spans 1.5 steps)."""
    args = make_args(
        tmp_path, steps_per_generation=steps_per_generation, gradient_accumulation_steps=accumulation, max_steps=3
    )
    trainer = train(model_path, args)
    rows = [row for row in trainer.state.log_history if "cost_aware/noise_scale" in row]
    assert rows
    for row in rows:
        expected = row["cost_aware/noise_to_signal"] * args.per_device_train_batch_size * accumulation
        assert row["cost_aware/noise_scale"] == pytest.approx(expected, rel=1e-6)


class Unscaled(TrainerCallback):
    """Copies the gradient the optimizer is about to apply (accelerate has unscaled it by then) and the scale."""

    def __init__(self, trainer):
        self.trainer, self.grads, self.scales = trainer, [], []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        grads = [p.grad for p in self.trainer.model.parameters() if p.grad is not None]
        self.grads.append(torch.cat([g.detach().flatten().clone() for g in grads]))
        self.scales.append(self.trainer.accelerator.scaler.get_scale())


def fp16_scaled_trainer(model_path, args, monkeypatch, cls=CostAwareGRPOTrainer):
    """A trainer under fp16's GradScaler on CPU (accelerate makes one on GPUs only): a real `torch.amp.GradScaler`
    whose scale doubles after every finite step, set where accelerate keeps its own, so that the loss is scaled in
    `backward`, unscaled in `clip_grad_norm_`, and the optimizer steps through it (skipping non-finite steps)."""
    trainer = cls(model_path, reward_funcs=length_reward, args=args, train_dataset=arithmetic_dataset(64, seed=0))
    accelerator = trainer.accelerator
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    accelerator.native_amp = True
    monkeypatch.setattr(type(accelerator), "mixed_precision", property(lambda self: "fp16"))
    unscaled = Unscaled(trainer)
    trainer.add_callback(unscaled)
    return trainer, unscaled


@pytest.mark.parametrize("max_grad_norm", [1e9, 0.0])
def test_noise_scale_reads_the_unscaled_gradient_under_fp16(model_path, tmp_path, monkeypatch, max_grad_norm):
    """Under the GradScaler the gradient read in `_clip_grad_norm` is scaled by s (s² on |G|², s·s' on the dot,
    with s doubling every step): the estimator's terms are those of the unscaled gradient the optimizer applies, and
    |G|² is the Trainer's own (unscaled) pre-clip norm squared. max_grad_norm 0: read after the Trainer unscaled."""
    args = make_args(tmp_path, max_grad_norm=max_grad_norm, max_steps=4)
    trainer, unscaled = fp16_scaled_trainer(model_path, args, monkeypatch)
    trainer.train()
    assert len(set(unscaled.scales)) == 4  # the scale changed at every step
    rows = step_rows(trainer)
    assert len(rows) == len(unscaled.grads) == 4
    for row, grad in zip(rows, unscaled.grads, strict=True):
        assert row["cost_aware/noise_grad_sq"] == pytest.approx(float(grad.pow(2).sum()), rel=1e-5)
        if max_grad_norm > 0:
            assert row["grad_norm"] ** 2 == pytest.approx(row["cost_aware/noise_grad_sq"], rel=1e-4)
    for row, grad, previous in zip(rows[1:], unscaled.grads[1:], unscaled.grads[:-1], strict=True):
        assert row["cost_aware/noise_grad_dot"] == pytest.approx(float(grad @ previous), rel=1e-4, abs=1e-9)


def test_noise_scale_skips_an_overflowing_fp16_step(model_path, tmp_path, monkeypatch):
    """A step whose scaled gradient is not finite (the scaler skips it): nothing counted, logged or stored; the next
    step pairs with the last finite one, each divided by its own scale."""

    class Overflowing(CostAwareGRPOTrainer):
        def _observe_gradient(self, model, scaled=True):
            if self.state.global_step == 1 and self._observed_step != 1:
                next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = math.inf
            super()._observe_gradient(model, scaled=scaled)

    args = make_args(tmp_path, max_grad_norm=1e9, max_steps=3)
    trainer, unscaled = fp16_scaled_trainer(model_path, args, monkeypatch, Overflowing)
    trainer.train()
    rows = step_rows(trainer)
    assert len(rows) == 3 and not any(k.startswith("cost_aware/noise_grad") for k in rows[1])
    assert unscaled.scales[1] == unscaled.scales[0] * 2 and unscaled.scales[2] == unscaled.scales[1] / 2  # backoff
    g0, g2 = unscaled.grads[0], unscaled.grads[2]
    assert rows[0]["cost_aware/noise_grad_sq"] == pytest.approx(float(g0.pow(2).sum()), rel=1e-5)
    assert rows[2]["cost_aware/noise_grad_sq"] == pytest.approx(float(g2.pow(2).sum()), rel=1e-5)
    assert rows[2]["cost_aware/noise_grad_dot"] == pytest.approx(float(g2 @ g0), rel=1e-4, abs=1e-9)
    assert trainer._noise.count == 1


def test_gradient_source_by_backend():
    """Where the estimator reads: param.grad (one process, DDP), the DeepSpeed engine's step at ZeRO-0/1, nowhere at
    ZeRO-2/3 or under FSDP (before: off under every DeepSpeed stage)."""
    assert gradient_source(None, fsdp=False) == PARAM_GRAD
    assert gradient_source(0, fsdp=False) == ZERO0
    assert gradient_source(1, fsdp=False) == ZERO1
    assert gradient_source(2, fsdp=False) is None and gradient_source(3, fsdp=False) is None
    assert gradient_source(None, fsdp=True) is None


def bare_host(source):
    """The estimator alone (no trainer) on a `ComputeSignals` host, reading from `source`."""

    class Host(NoiseProbe, ComputeSignals):  # the probe off: the consecutive steps' estimator alone
        pass

    host = Host()
    host.args = SimpleNamespace(
        cost_aware=True,
        cost_aware_kept_fraction="compute",
        cost_aware_budget_delta=0.1,
        cost_aware_cost_model="tokens",
        cost_aware_generation_token_cost=1.2,
        cost_aware_noise_probe_every=0,
        optim="adamw_torch",
        seed=0,
    )
    host.is_deepspeed_enabled = host.is_fsdp_enabled = False
    host.accelerator = SimpleNamespace(scaler=None, process_index=0)
    host.add_callback = lambda callback: None
    host._metrics = {"train": defaultdict(list)}
    host.state = SimpleNamespace(global_step=0)
    host.model = torch.nn.Linear(1, 1)
    host.num_iterations = 1
    host._init_compute_signals()
    host._init_noise_probe(row_length=False)
    host._gradient_source = source
    return host


class Engine:
    """What the reader uses of a DeepSpeed engine: its module, optimizer, fp16 flag, device and step."""

    def __init__(self, module, optimizer, fp16=False):
        self.module, self.optimizer, self.fp16, self.device, self.steps = module, optimizer, fp16, "cpu", 0

    def fp16_enabled(self):
        return self.fp16

    def is_gradient_accumulation_boundary(self):
        return True

    def step(self):
        self.steps += 1


def test_engine_reader_divides_deepspeeds_fp16_loss_scale():
    """ZeRO-0 under DeepSpeed's fp16: the gradient at the engine's step carries the optimizer's loss scale (1024,
    then 2048): the terms are those of the unscaled gradient; the engine then steps."""
    host = bare_host(ZERO0)
    module = torch.nn.Linear(3, 2)
    optimizer = SimpleNamespace(loss_scale=1024.0)
    engine = Engine(module, optimizer, fp16=True)
    host.model_wrapped = engine
    host._attach_engine_reader()
    true = [torch.randn(2, 3), torch.randn(2)], [torch.randn(2, 3), torch.randn(2)]
    for step, (grads, scale) in enumerate(zip(true, (1024.0, 2048.0), strict=True)):
        host.state.global_step, host._generation_index, optimizer.loss_scale = step, step, scale
        for p, g in zip(module.parameters(), grads, strict=True):
            p.grad = g * scale
        engine.step()
    assert engine.steps == 2
    metrics = host._metrics["train"]
    squares = [sum(float(g.pow(2).sum()) for g in grads) for grads in true]
    assert metrics["cost_aware/noise_grad_sq"] == pytest.approx(squares, rel=1e-5)
    dot = sum(float((a * b).sum()) for a, b in zip(*true, strict=True))
    assert metrics["cost_aware/noise_grad_dot"] == pytest.approx([dot], rel=1e-5)


def test_engine_reader_falls_back_where_deepspeed_keeps_the_gradient_elsewhere():
    """ZeRO-1 whose optimizer has no `averaged_gradients` (e.g. with offload): one warning, then the 'auto' rule
    (the signal says the estimator is unavailable); the engine still steps."""
    host = bare_host(ZERO1)
    engine = Engine(torch.nn.Linear(1, 1), SimpleNamespace())
    host.model_wrapped = engine
    host._attach_engine_reader()
    with pytest.warns(UserWarning, match="no gradient readable"):
        engine.step()
    assert engine.steps == 1 and not host._noise_available
    signal = host._compute_signal()
    assert not signal.available and signal.rho is None


def test_zero1_terms_are_summed_over_ranks(monkeypatch):
    """ZeRO-1: each rank's partition terms are all-reduced (here a rank with an empty partition, the other rank's
    terms given); a step is paired only where every rank pairs it (the flag summed to the world size)."""
    host = bare_host(ZERO1)
    other = [torch.tensor([5.0, 0.0, 0.0]), torch.tensor([7.0, 3.0, 1.0]), torch.tensor([9.0, 4.0, 0.0])]

    def all_reduce(t, group=None):
        t += other.pop(0)

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    for step in range(3):
        host.state.global_step, host._generation_index = step, step
        host._record_gradient([], 1.0, reduce_group=None, device="cpu")
    metrics = host._metrics["train"]
    assert metrics["cost_aware/noise_grad_sq"] == [5.0, 7.0, 9.0]
    assert metrics["cost_aware/noise_grad_dot"] == [3.0]  # step 2: the other rank did not pair
    assert host._noise.count == 1
