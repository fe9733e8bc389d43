"""The micro-batch layouts (docs/layout.md): their pure functions (`rows.layout`), which one the trainer runs (packed,
or even with an entropy bonus or a router aux loss: `layout_for`), and real runs: the packed layout gives the even
layout's gradient for the same rows, and drops rows where the even one cannot (one row per micro-batch).

The even layout is forced in the comparisons with `testing_utils.make_trainer(..., layout="even")`."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from testing_utils import make_config, make_trainer, tiny_dataset
from transformers import TrainerCallback

from trl_costaware import trainer as trainer_module
from trl_costaware.rows.layout import (
    kept_multiple,
    layout_for,
    optimizer_segments,
    pack_sorted,
    packed_micro_steps,
    row_mean_scale,
    sampling_floor_warning,
    spread_sorted,
    token_mean_scale,
)
from trl_costaware.rows.plan import LOSS_NORMALISERS, PlanSettings, RowStats, plan_batch


# ---------------------------------------------------------------------------------------------------- pure functions
@given(
    lengths=st.lists(st.integers(1, 50), min_size=0, max_size=12),
    other=st.lists(st.integers(1, 50), min_size=12, max_size=12),
    capacity=st.integers(1, 5),
)
def test_pack_sorted_uses_the_fewest_micro_batches_of_sizes_equal_on_every_rank(lengths, other, capacity):
    groups = pack_sorted(lengths, capacity)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # every row once
    assert len(groups) == -(-len(lengths) // capacity)  # as few micro-batches as the rows need
    assert all(1 <= len(g) <= capacity for g in groups)
    assert all(len(g) == capacity for g in groups[1:])  # one short group, first: it takes the longest rows
    flat = [lengths[i] for g in groups for i in g]
    assert flat == sorted(flat, reverse=True)  # contiguous in the longest-first order
    # Another rank's rows (other lengths, same count): the same micro-batch sizes, which TRL's per-row gathers need.
    assert [len(g) for g in pack_sorted(other[: len(lengths)], capacity)] == [len(g) for g in groups]


@given(
    runs=st.integers(1, 3),
    g=st.integers(1, 4),
    capacity=st.integers(1, 4),
    data=st.data(),
)
def test_packed_micro_steps_give_each_optimizer_step_its_rows_and_end_on_a_real_micro_batch(runs, g, capacity, data):
    spg = runs * g
    accumulation = data.draw(st.sampled_from([g, spg, 2 * spg]) if runs == 1 else st.just(g))
    q = data.draw(st.integers(1, g * capacity))
    m = runs * q
    order = data.draw(st.permutations(list(range(m))))
    lengths = data.draw(st.lists(st.integers(1, 30), min_size=m, max_size=m))
    steps = packed_micro_steps(order, lengths, spg, accumulation, capacity)
    assert len(steps) == spg
    assert optimizer_segments(spg, accumulation) == (runs, g)
    for s in range(runs):
        run = steps[s * g : (s + 1) * g]
        real = [r for r in run if r is not None]
        assert sorted(i for r in real for i in r) == sorted(order[s * q : (s + 1) * q])  # this run's rows only
        assert len(real) == -(-q // capacity) and all(len(r) <= capacity for r in real)
        assert run[-1] is not None  # the micro-step that ends the optimizer step (and syncs) is a real one
        assert all(r is None for r in run[: g - len(real)])  # no-ops first


def test_packed_micro_steps_refuse_counts_the_runs_cannot_share():
    with pytest.raises(ValueError, match="multiple of 2"):
        packed_micro_steps([0, 1, 2], [1, 1, 1], 4, 2, 4)  # 2 optimizer steps per generation batch, 3 rows
    with pytest.raises(ValueError, match="do not fit"):
        packed_micro_steps(list(range(5)), [1] * 5, 2, 2, 2)


@given(run_rows=st.integers(1, 64), g=st.integers(1, 8), data=st.data())
def test_row_mean_scale_gives_every_row_the_even_layouts_weight(run_rows, g, data):
    """A mean over r rows divided by G, times c, weighs each row g/(G q): what q/g rows per micro-step give."""
    r = data.draw(st.integers(1, run_rows))
    accumulation = data.draw(st.integers(1, 8))
    per_row = row_mean_scale(r, run_rows, g) / (accumulation * r)
    assert per_row == pytest.approx(g / (accumulation * run_rows))
    assert row_mean_scale(run_rows // g, run_rows, g) == pytest.approx(1.0) or run_rows % g


def test_token_mean_scale_stays_positive():
    assert token_mean_scale(10.0, 40.0, 4) == pytest.approx(1.0)
    assert token_mean_scale(0.0, 40.0, 4) == 1.0 and token_mean_scale(3.0, 0.0, 4) == 1.0  # β stays non-zero


def test_kept_multiple_and_the_plan_round_m_to_the_layout():
    assert kept_multiple("even", 8, 8) == 8
    assert kept_multiple("packed", 8, 8) == 1
    assert kept_multiple("packed", 8, 4) == 2  # 2 optimizer steps per generation batch: m splits evenly over them
    assert kept_multiple("packed", 4, 8) == 1
    n = 8  # B = 1, S = 8: the even layout keeps every row, the packed one keeps half
    rows = RowStats(*(torch.ones(n) for _ in RowStats.names()))
    rows = RowStats(**{**vars(rows), "advantages": torch.linspace(-1, 1, n), "costs": torch.arange(1.0, n + 1)})
    even = PlanSettings(kept_fraction=0.5, steps_per_generation=8, kept_multiple=kept_multiple("even", 8, 8))
    packed = PlanSettings(kept_fraction=0.5, steps_per_generation=8, kept_multiple=kept_multiple("packed", 8, 8))
    assert plan_batch(rows, even, torch.Generator().manual_seed(0)).m == 8
    assert plan_batch(rows, packed, torch.Generator().manual_seed(0)).m == 4


# ---------------------------------------------------------------------------------------------------- which layout
# The runs below: 4 rows per micro-batch, 2 micro-steps per optimizer step, one completion length cap of 8.
SHAPE = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_completion_length=8, max_steps=1)


def _config(tmp_path, **overrides):
    return make_config(tmp_path, **{**SHAPE, **overrides})


def test_the_layout_is_packed_unless_a_loss_term_is_added_per_micro_batch(tmp_path):
    assert layout_for(_config(tmp_path)) == "packed"
    assert layout_for(_config(tmp_path, entropy_coef=0.01)) == "even"
    assert layout_for(_config(tmp_path, use_adaptive_entropy=True)) == "even"
    assert layout_for(_config(tmp_path), aux_loss=True) == "even"  # a router aux loss, known once the model loads


def test_config_warns_where_a_shape_cannot_sample(tmp_path):
    # With an entropy bonus the even layout runs: at one row per micro-batch it keeps every row.
    with pytest.warns(UserWarning, match=r"per_device_train_batch_size=1.*\(the even layout\)"):
        _config(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=8, entropy_coef=0.01)
    with pytest.warns(UserWarning, match="can drop no row"):
        _config(
            tmp_path,
            per_device_train_batch_size=1,
            gradient_accumulation_steps=8,
            entropy_coef=0.01,
            cost_aware_token_budget=100,
        )
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _config(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=8, num_generations=8)  # packed
    assert sampling_floor_warning("packed", 1, 8, 1, 0.5) is not None  # every micro-step its own optimizer step
    assert sampling_floor_warning("packed", 2, 8, 8, 0.25) is None
    assert sampling_floor_warning("even", 2, 8, 8, 0.25) is not None  # at least one row per micro-step: 0.5


def tiny_moe():
    """A 1-layer, 2-expert Mixtral on the embedded tokenizer: TRL turns its router aux loss on."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from trl_costaware.embedded.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    config = MixtralConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_local_experts=2,
        num_experts_per_tok=1,
        max_position_embeddings=128,
        router_aux_loss_coef=0.01,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def test_a_router_aux_loss_runs_the_even_layout_and_the_plan_rounds_to_it(tmp_path):
    """S = G = 4, one row per micro-batch: the packed layout could keep 2 of 4 rows, but a router aux loss (a term per
    micro-batch) makes the trainer run the even layout, whose unit is S = 4: every row is kept."""
    from testing_utils import length_reward, logged

    from trl_costaware import CostAwareGRPOTrainer

    model, tokenizer = tiny_moe()
    args = make_config(
        tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=4, max_completion_length=6, max_steps=1
    )
    assert layout_for(args) == "packed"  # what the config alone would run
    trainer = CostAwareGRPOTrainer(
        model, [length_reward], args=args, train_dataset=tiny_dataset(8), processing_class=tokenizer
    )
    assert trainer.aux_loss_enabled and trainer._cost_aware.layout == "even"
    trainer.train()
    assert logged(trainer, "cost_aware/kept_row_fraction") == [
        1.0
    ]  # the plan rounded m to the even layout's unit (S = 4)


# ---------------------------------------------------------------------------------------------------- real runs
def varied_reward(completions, **kwargs):
    """Position in the group plus a text term: every group has reward variance."""
    return [float(i % 4) + 0.1 * sum(ch.isdigit() for ch in str(c)) for i, c in enumerate(completions)]


class GradRecorder(TrainerCallback):
    """Every optimizer step's gradient (before the step; no clipping is configured)."""

    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def _train(tmp_path, model_path, name, layout=None, **overrides):
    options = dict(
        optim="sgd",
        learning_rate=0.05,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        seed=3,
        cost_aware_weight_normalization="recenter",
    )
    options.update(overrides)
    trainer = make_trainer(
        model_path,
        tmp_path / name,
        rewards=[varied_reward],
        dataset=tiny_dataset(32),
        layout=layout,
        **{**SHAPE, **options},
    )
    recorder = GradRecorder()
    trainer.add_callback(recorder)
    shapes = []

    def hook(module, args_, kwargs):
        if torch.is_grad_enabled() and module.training:
            shapes.append(tuple(kwargs["input_ids"].shape))

    handle = trainer.model.register_forward_pre_hook(hook, with_kwargs=True)
    trainer.train()
    handle.remove()
    return trainer, recorder.grads, shapes


def _assert_same_gradients(grads_a, grads_b):
    assert len(grads_a) == len(grads_b) > 0
    for step_a, step_b in zip(grads_a, grads_b, strict=True):
        assert step_a.keys() == step_b.keys()
        norm = max(g.abs().max().item() for g in step_a.values())
        assert norm > 0
        for key in step_a:
            torch.testing.assert_close(step_b[key], step_a[key], rtol=1e-4, atol=1e-5 * norm)


# (steps_per_generation, max_steps, beta, num_iterations): one optimizer step per generation batch at β = 0, and two
# (S = 2G) at β > 0 with two passes over each buffer (old-policy log-probs, 4 optimizer steps per generation batch).
CASES = {"one_step": (2, 1, 0.0, 1), "two_steps_beta_iterations": (4, 4, 0.04, 2)}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("loss_type", list(LOSS_NORMALISERS))
def test_packed_layout_has_the_even_layouts_gradient(tmp_path, tiny_model_path, loss_type, case):
    """Same kept rows, same factors, same TRL shuffle: every optimizer step's gradient equals the even layout's up to
    float summation order, while the packed run makes fewer, fuller micro-batches."""
    spg, steps, beta, iterations = CASES[case]
    options = dict(
        loss_type=loss_type, steps_per_generation=spg, max_steps=steps, beta=beta, num_iterations=iterations
    )
    if loss_type == "bnpo" and beta:
        # bnpo's KL term is each micro-batch's own token mean under the even layout, which depends on how the rows
        # split; the packed layout takes the optimizer step's token mean: the same when micro-batches hold equal
        # tokens, so completions run to the cap here (docs/layout.md).
        options["generation_kwargs"] = {"min_new_tokens": 8}
    _, even, even_shapes = _train(tmp_path, tiny_model_path, "even", layout="even", **options)
    trainer, packed, packed_shapes = _train(tmp_path, tiny_model_path, "packed", **options)
    assert trainer._cost_aware.layout == "packed"  # the trainer's own choice
    _assert_same_gradients(even, packed)
    assert [s[0] for s in even_shapes] == [2] * len(even_shapes)  # m/S = 2 rows per micro-step
    assert [s[0] for s in packed_shapes] == [4] * (len(even_shapes) // 2)  # 4 rows, half the micro-steps


def test_no_op_micro_steps_that_run_the_model_add_no_gradient_and_no_metric(tmp_path, tiny_model_path, monkeypatch):
    """Where a backend cannot skip the model (DeepSpeed), a no-op runs a 1-token forward/backward: the gradient and the
    logged metrics (entropy, clip ratios, KL) are those of the run whose no-ops skip it."""
    options = dict(loss_type="grpo", steps_per_generation=4, max_steps=2, beta=0.04)
    skipped, grads_skipped, shapes_skipped = _train(tmp_path, tiny_model_path, "skip", **options)
    monkeypatch.setattr(trainer_module, "noop_skippable", lambda accelerator: False)
    real_pack = trainer_module.pack_buffer
    # Keep the fewest, fullest micro-batches (and so the no-ops), which a backend that runs them would not choose.
    monkeypatch.setattr(trainer_module, "pack_buffer", lambda *a, **k: real_pack(*a, **{**k, "fill": True}))
    ran, grads_ran, shapes_ran = _train(tmp_path, tiny_model_path, "run", **options)
    _assert_same_gradients(grads_skipped, grads_ran)
    assert len(shapes_ran) == 2 * len(shapes_skipped) and shapes_ran.count((1, 2)) == len(shapes_skipped)
    keys = ("entropy", "kl", "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max")
    for a, b in zip(skipped.state.log_history, ran.state.log_history, strict=True):
        for key in keys:
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    padded = (skipped._cost_aware.totals["policy_tokens_padded"], ran._cost_aware.totals["policy_tokens_padded"])
    assert padded[1] == padded[0] + 2 * len(shapes_skipped)  # the no-ops' tokens are counted where they run


@pytest.mark.parametrize("per_device_train_batch_size", [2, 4])
def test_where_no_ops_run_the_model_the_rows_spread_over_the_even_layouts_forwards(
    tmp_path, tiny_model_path, monkeypatch, per_device_train_batch_size
):
    """Where a no-op would run a forward anyway (DeepSpeed: `packed.noop_skippable` False), the packed layout spreads
    each optimizer step's rows over all its micro-steps, sorted by length: the even layout's gradient, its number of
    forwards and rows per forward, and each forward padded no wider than the even layout's, widest to narrowest
    (`layout.spread_sorted`). So it is never slower than the even layout there."""
    options = dict(
        loss_type="grpo",
        steps_per_generation=4,
        max_steps=4,
        beta=0.04,
        per_device_train_batch_size=per_device_train_batch_size,
        generation_kwargs={"min_new_tokens": 1},
    )
    _, even, even_shapes = _train(tmp_path, tiny_model_path, "even", layout="even", **options)
    monkeypatch.setattr(trainer_module, "noop_skippable", lambda accelerator: False)
    fills = []
    real_pack = trainer_module.pack_buffer
    monkeypatch.setattr(trainer_module, "pack_buffer", lambda *a, **k: fills.append(k["fill"]) or real_pack(*a, **k))
    trainer, spread, spread_shapes = _train(tmp_path, tiny_model_path, "spread", **options)
    assert trainer._cost_aware.layout == "packed" and fills and not any(fills)
    _assert_same_gradients(even, spread)
    assert len(spread_shapes) == len(even_shapes)  # no no-op: every position trains rows, as under the even layout
    assert sorted(s[0] for s in spread_shapes) == sorted(s[0] for s in even_shapes)
    for step in range(0, len(even_shapes), 2):  # per optimizer step (2 micro-steps): widths dominated, sorted
        widths_even = sorted((s[1] for s in even_shapes[step : step + 2]), reverse=True)
        widths_spread = sorted((s[1] for s in spread_shapes[step : step + 2]), reverse=True)
        assert all(a <= b for a, b in zip(widths_spread, widths_even, strict=True))


@given(
    k=st.integers(0, 24),
    count=st.integers(1, 8),
    data=st.data(),
)
def test_spread_sorted_pads_no_wider_than_any_equal_split(k, count, data):
    lengths = data.draw(st.lists(st.integers(1, 60), min_size=k, max_size=k))
    groups = spread_sorted(lengths, count)
    assert sorted(i for g in groups for i in g) == list(range(k))
    assert len(groups) == min(k, count)
    sizes = [len(g) for g in groups]
    assert max(sizes, default=0) - min(sizes, default=0) <= 1 and sizes == sorted(sizes)
    flat = [lengths[i] for g in groups for i in g]
    assert flat == sorted(flat, reverse=True)
    if k and k % count == 0:  # the even layout's sizes: any split into groups of k/count rows is no narrower
        other = data.draw(st.permutations(list(range(k))))
        a = k // count
        widths_any = sorted((max(lengths[i] for i in other[j * a : (j + 1) * a]) for j in range(count)), reverse=True)
        widths_sorted = sorted((max(lengths[i] for i in g) for g in groups), reverse=True)
        assert all(s <= w for s, w in zip(widths_sorted, widths_any, strict=True))


# ---------------------------------------------------------------------------------------------------- two processes
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.deepspeed
def test_packed_layout_under_ddp_and_zero3_matches_the_even_layout(tiny_model_path, tmp_path):
    """2 CPU processes, B = 2 rows per micro-batch, 4 micro-steps, kept 0.5 (4 rows per rank), SGD (so the weights move
    by the gradient itself, scale included): DDP with the packed layout (2 micro-batches of 2 rows and 2 no-ops that
    skip the model before the syncing micro-step) ends with the even layout's weights (4 micro-batches of 1 row), and
    ZeRO-3 (whose no-ops run a 1-token forward/backward, so both ranks make the same forwards and DeepSpeed counts
    every micro-step) with DDP's."""
    pytest.importorskip("deepspeed")
    from test_distributed import ATOL, WORKER, accelerate_cmd, free_port, load_result, max_diff, run
    from transformers import AutoModelForCausalLM

    initial = {
        k: v.detach().float() for k, v in AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict().items()
    }
    common = ["--per-device-batch", "2", "--grad-accum", "4", "--optim", "sgd", "--lr", "0.5", "--max-steps", "2"]
    results = {}
    for name, config, layout in (
        ("even", "multi_gpu", "even"),
        ("ddp", "multi_gpu", "packed"),
        ("zero3", "zero3", "packed"),
    ):
        out = tmp_path / name
        cmd = accelerate_cmd(config, "--main_process_port", str(free_port()), str(WORKER))
        run(
            [*cmd, "--model", tiny_model_path, "--out", str(out), "--layout", layout, *common],
            tmp_path / f"{name}.log",
        )
        results[name] = load_result(out)
    assert [r["zero_stage"] for r in results["zero3"]["records"]] == [3, 3]
    assert [results[name]["records"][0]["layout"] for name in ("even", "ddp", "zero3")] == ["even", "packed", "packed"]
    assert results["even"]["records"][0]["micro_batches"] == 4  # one kept row per micro-step
    assert results["ddp"]["records"][0]["micro_batches"] == 2  # two micro-batches of 2 rows, two no-ops
    assert max_diff(results["even"]["state"], initial) >= 1e-3  # SGD moved the weights well beyond the tolerance
    assert results["ddp"]["records"][0]["kept"] == results["even"]["records"][0]["kept"] == [4, 4]
    assert max_diff(results["ddp"]["state"], results["even"]["state"]) <= ATOL
    assert max_diff(results["zero3"]["state"], results["ddp"]["state"]) <= ATOL


def test_one_row_per_micro_batch_drops_rows_and_its_update_compute_falls_with_them(tmp_path, tiny_model_path):
    """B = 1, 8 micro-steps, kept 0.5: the even layout cannot drop a row (m is a multiple of 8 = N), the packed layout
    trains 4 of the 8 rows in 4 forwards, and the tokens through the model with gradients are the kept rows' tokens."""
    options = dict(
        per_device_train_batch_size=1,
        gradient_accumulation_steps=8,
        num_generations=8,
        max_steps=1,
        optim="adamw_torch",
        max_grad_norm=1.0,
    )
    even, _, even_shapes = _train(tmp_path, tiny_model_path, "even", layout="even", **options)
    packed, _, packed_shapes = _train(tmp_path, tiny_model_path, "packed", **options)  # the trainer's layout
    assert packed._cost_aware.layout == "packed"
    assert even._cost_aware.totals["rows_kept"] == 8 and len(even_shapes) == 8
    assert packed._cost_aware.totals["rows_kept"] == 4 and len(packed_shapes) == 4
    grad_tokens = sum(b * w for b, w in packed_shapes)
    assert (
        grad_tokens == packed._cost_aware.totals["policy_tokens"] == packed._cost_aware.totals["policy_tokens_padded"]
    )
    assert grad_tokens < 0.6 * sum(b * w for b, w in even_shapes)


def test_bnpo_micro_token_factor_keeps_1_for_a_micro_batch_without_loss_tokens():
    from trl_costaware.rows.layout import micro_token_factor

    assert micro_token_factor(6.0, 4.0) == 1.5
    assert micro_token_factor(0.0, 4.0) == 1.0
    factors = micro_token_factor(torch.tensor([6.0, 0.0]), 4.0)
    torch.testing.assert_close(factors, torch.tensor([1.5, 1.0]))
