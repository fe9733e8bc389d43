"""The trainer review's findings (issue 27): resume with `ignore_data_skip`, the vLLM metrics over ranks, the scope of
the deferred-pass placeholder, the weights' exact float64 gather, and the drift guard of TRL's old-pass condition."""

from __future__ import annotations

import inspect
import math
import os
import types
import unittest.mock
from collections import defaultdict

import pytest
import torch
from trl import GRPOTrainer

from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer
from trl_costaware.embedded.arithmetic import arithmetic_dataset
from trl_costaware.embedded.model import tiny_model_path as build_tiny_model_path
from trl_costaware.rows.deferred import TRL_SCORING_CODE, VLLM_METRICS, DeferredLogProbPasses
from trl_costaware.rows.layout import layout_of
from trl_costaware.rows.plan import AcceleratorCollective
from trl_costaware.trainer import STATE_FILE


def length_reward(completions, **kwargs):
    return [float(len(c) % 4) for c in completions]


def make_args(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        bf16=False,
        seed=0,
        learning_rate=1e-3,
    )
    kwargs.update(overrides)
    return CostAwareGRPOConfig(**kwargs)


@pytest.fixture(scope="module")
def model_path():
    return build_tiny_model_path()


@pytest.fixture(scope="module")
def dataset():
    return arithmetic_dataset(64, seed=0)


# ---------------------------------------------------------------- resume
@pytest.mark.slow
def test_resume_with_ignore_data_skip_restores_the_sampler(tmp_path, model_path, dataset):
    """`ignore_data_skip=True` restarts the data, not the sampler: its generators and counters come back from the
    checkpoint: `_load_cost_aware_state`, called from `_load_optimizer_and_scheduler`, restores them on every resume
    (they were once restored in `_load_rng_state` only, which HF's Trainer may skip)."""
    common = dict(max_steps=4, save_strategy="steps", save_steps=2, steps_per_generation=2)
    first = CostAwareGRPOTrainer(
        model_path, [length_reward], args=make_args(tmp_path, **common), train_dataset=dataset
    )
    first.train()
    checkpoint = os.path.join(first.args.output_dir, "checkpoint-2")
    saved = torch.load(os.path.join(checkpoint, STATE_FILE.format(rank=0)), weights_only=True)

    args = make_args(tmp_path, ignore_data_skip=True, **common)
    resumed = CostAwareGRPOTrainer(model_path, [length_reward], args=args, train_dataset=dataset)
    states = []
    original = resumed._draw_kept_rows

    def draw(batch):
        states.append((resumed._sampler_generator.get_state(), dict(resumed._cost_aware_totals)))
        return original(batch)

    resumed._draw_kept_rows = draw
    resumed.train(resume_from_checkpoint=checkpoint)
    generator, totals = states[0]  # at the first draw after the resume
    assert torch.equal(generator, saved["generator"])
    assert totals == saved["totals"] and totals["rows_generated"] > 0
    final = [r for r in resumed.state.log_history if "cost_aware/rows_generated" in r][-1]
    assert final["cost_aware/rows_generated"] == 2 * saved["totals"]["rows_generated"]


# ---------------------------------------------------------------- the placeholder's scope
@pytest.mark.slow
def test_user_code_during_scoring_gets_real_log_probs(tmp_path, model_path, dataset):
    """A reward function that calls `_get_per_token_logps_and_entropies` while TRL scores the batch gets the real
    log-probabilities; TRL's own passes still get the placeholder (they are deferred to the kept rows)."""
    holder = {}
    seen = []

    def reward_calling_the_model(completions, **kwargs):
        trainer = holder["trainer"]
        ids = torch.tensor([[5, 6, 7, 8, 9]])
        with torch.no_grad():
            logps = trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.ones_like(ids), 3)[0]
        seen.append(logps)
        return length_reward(completions)

    args = make_args(tmp_path, max_steps=1, beta=0.04, steps_per_generation=2, gradient_accumulation_steps=1)
    trainer = CostAwareGRPOTrainer(model_path, [reward_calling_the_model], args=args, train_dataset=dataset)
    holder["trainer"] = trainer
    trainer.train()
    assert seen and all(torch.isfinite(x).all() for x in seen)
    assert math.isfinite([r for r in trainer.state.log_history if "loss" in r][-1]["loss"])


def trl_body(host, ids):
    """Stands for TRL's scoring function: the placeholder recognises its caller by code object."""
    return host._get_per_token_logps_and_entropies(None, ids, ids, 3)[0]


def test_placeholder_only_for_trls_scoring_calls():
    """Inside `_deferred_log_prob_passes`, a call made from TRL's scoring function gets the NaN placeholder; any other
    call gets the method itself; afterwards the class method is back."""

    class Host(DeferredLogProbPasses):
        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *a, **k):
            return torch.zeros(input_ids.size(0), logits_to_keep), None, None

    host = Host()
    ids = torch.ones(2, 5, dtype=torch.long)
    assert TRL_SCORING_CODE is inspect.unwrap(GRPOTrainer._generate_and_score_completions).__code__
    with host._deferred_log_prob_passes():
        assert torch.equal(host._get_per_token_logps_and_entropies(None, ids, ids, 3)[0], torch.zeros(2, 3))
        assert torch.equal(trl_body(host, ids), torch.zeros(2, 3))  # not TRL's code: real values
        with unittest.mock.patch("trl_costaware.rows.deferred.TRL_SCORING_CODE", trl_body.__code__):
            assert torch.isnan(trl_body(host, ids)).all()
            assert torch.equal(host._get_per_token_logps_and_entropies(None, ids, ids, 3)[0], torch.zeros(2, 3))
    assert "_get_per_token_logps_and_entropies" not in vars(host)
    assert torch.equal(trl_body(host, ids), torch.zeros(2, 3))


# ---------------------------------------------------------------- vLLM metrics over ranks
class TwoRanks:
    """An accelerator of 2 processes seen from rank 0: `gather` appends the other rank's row."""

    process_index, num_processes = 0, 2

    def __init__(self, other):
        self.other = other

    def gather(self, x):
        return torch.cat([x, self.other.to(x.dtype)])


def _chunk(old, sampling, mask, ratio):
    return {
        "old_per_token_logps": torch.tensor(old),
        "sampling_per_token_logps": torch.tensor(sampling),
        "completion_mask": torch.tensor(mask),
        "importance_sampling_ratio": torch.tensor(ratio),
    }


def _host(accelerator, mode="token_truncate"):
    host = types.SimpleNamespace(
        accelerator=accelerator,
        vllm_importance_sampling_mode=mode,
        _metrics={"train": defaultdict(list)},
        _cost_aware_totals=defaultdict(float),
        _loss_mask=lambda chunk: chunk["completion_mask"],
    )
    for name in ("_vllm_ratio_stats", "_log_vllm_ratio"):
        setattr(host, name, types.MethodType(getattr(DeferredLogProbPasses, name), host))
    return host


def _trl_values(ranks):
    """TRL's own reductions (GRPOTrainer._generate_and_score_completions), rank by rank, then over ranks."""
    means, maxes, r_mins, r_means, r_maxes = [], [], [], [], []
    for chunks in ranks:
        delta = torch.cat([(c["old_per_token_logps"] - c["sampling_per_token_logps"]).abs().flatten() for c in chunks])
        mask = torch.cat([c["completion_mask"].bool().flatten() for c in chunks])
        ratio = torch.cat([c["importance_sampling_ratio"].flatten() for c in chunks])
        d = delta[mask & ~torch.isnan(delta)]
        means.append(d.mean() if d.numel() else torch.tensor(0.0))
        maxes.append(d.max() if d.numel() else torch.tensor(0.0))
        r = ratio[mask]
        r_mins.append(r.min() if r.numel() else torch.tensor(0.0))
        r_means.append(r.mean() if r.numel() else torch.tensor(0.0))
        r_maxes.append(r.max() if r.numel() else torch.tensor(0.0))
    return [
        float(torch.stack(means).mean()),
        float(torch.stack(maxes).max()),
        float(torch.stack(r_mins).min()),
        float(torch.stack(r_means).mean()),
        float(torch.stack(r_maxes).max()),
    ]


@pytest.mark.parametrize("empty_rank", [False, True])
def test_vllm_metrics_are_defined_as_trls_over_ranks(empty_rank):
    """Rank 0 has many loss tokens with small differences, rank 1 few with large ones: TRL averages the per-rank
    means (a pooled mean would weigh rank 0's tokens more); a rank without a token counts 0, as in TRL."""
    rank0 = [
        _chunk([[-1.0, -1.0, -1.0, -1.0]] * 2, [[-1.1, -1.1, -1.1, -1.1]] * 2, [[1, 1, 1, 1]] * 2, [[1.1] * 4] * 2),
        _chunk([[-1.0, -1.0, -1.0, -1.0]], [[-1.2, math.nan, -1.2, -1.2]], [[1, 1, 1, 0]], [[1.2, 1.0, 1.2, 1.0]]),
    ]
    if empty_rank:
        rank1 = [_chunk([[-1.0, -1.0]], [[-2.0, -2.0]], [[0, 0]], [[2.0, 2.0]])]
    else:
        rank1 = [_chunk([[-1.0, -1.0]], [[-2.0, -2.0]], [[1, 0]], [[2.5, 1.0]])]
    sent = []

    class Sending(TwoRanks):  # rank 1's own call: what it sends is rank 0's "other" row
        def gather(self, x):
            sent.append(x)
            return torch.cat([x, x])

    _host(Sending(None))._log_vllm_ratio(rank1, {"policy_tokens_padded": 7.0}, torch.device("cpu"))
    other_row = sent[0]
    assert other_row.dtype == torch.int64  # bit patterns: no float64 on the device
    host = _host(TwoRanks(other_row))
    host._log_vllm_ratio(rank0, {"policy_tokens_padded": 5.0}, torch.device("cpu"))
    logged = [host._metrics["train"][k][-1] for k in VLLM_METRICS]
    assert logged == pytest.approx(_trl_values([rank0, rank1]), rel=1e-6)
    assert host._cost_aware_totals["policy_tokens_padded"] == 12.0


# ---------------------------------------------------------------- the weights' gather
def test_weights_gather_is_float64_bit_for_bit():
    """`AcceleratorCollective.cat` carries the float64 weights exactly (a float32 round trip would move them)."""

    class Mirror:
        process_index, num_processes = 0, 2

        def gather(self, x):
            return torch.cat([x, x])

    x = torch.tensor([[1.0 + 1e-12, 0.0], [1.0 / 3.0, 1.0], [1e-300, 0.0]], dtype=torch.float64)
    out = AcceleratorCollective(Mirror(), torch.device("cpu")).cat(x)
    assert out.dtype == torch.float64
    assert torch.equal(out, torch.cat([x, x]))


# ---------------------------------------------------------------- drift guard: TRL's old-pass condition
@pytest.mark.slow
def test_deferred_pass_condition_is_trls(tmp_path, model_path, dataset):
    """`_deferred_passes` re-derives when TRL's scoring runs its old-policy and reference passes: for each setting,
    the passes TRL itself runs (seen through `_get_per_token_logps_and_entropies`) are the ones it says."""
    trainer = CostAwareGRPOTrainer(
        model_path, [length_reward], args=make_args(tmp_path, beta=0.04), train_dataset=dataset
    )
    trainer.model.train()
    raw = [dataset[i] for i in range(8)]
    calls = []

    def record(model, *a, **kw):
        calls.append("ref" if model is trainer.ref_model else "old")
        ids = a[0]
        return torch.zeros(ids.size(0), a[2]), None, None

    trainer._get_per_token_logps_and_entropies = record
    settings = [  # (gradient_accumulation_steps, steps_per_generation, num_iterations, beta)
        (1, 1, 1, 0.04),
        (1, 2, 1, 0.0),
        (2, 1, 1, 0.0),
        (2, 2, 2, 0.04),
        (4, 2, 2, 0.0),
    ]
    for accumulation, spg, iterations, beta in settings:
        trainer.args.gradient_accumulation_steps, trainer.args.steps_per_generation = accumulation, spg
        trainer.num_iterations, trainer.beta = iterations, beta
        calls.clear()
        GRPOTrainer._generate_and_score_completions(trainer, raw)
        assert ("old" in calls, "ref" in calls) == trainer._deferred_passes, (accumulation, spg, iterations, beta)


# ---------------------------------------------------------------- the counters' gather, the length grouping
class OwnDrawTrainer(CostAwareGRPOTrainer):
    """A subclass's own draw (every row, weight 1): no plan, so the trainer counts the kept tokens itself (the plan's
    other counters are the subclass's to keep)."""

    def _draw_kept_rows(self, batch):
        n = len(batch["completion_ids"])
        return torch.arange(n), torch.ones(n)


@pytest.mark.parametrize("cls", [CostAwareGRPOTrainer, OwnDrawTrainer])
def test_the_counters_gather_sends_the_same_keys_with_or_without_a_plan(tmp_path, model_path, dataset, cls):
    """Per generation batch the layout's counters go through ONE gather; its keys must not depend on whether this
    rank's draw came from the plan (a rank that sends an extra key would gather a tensor of another shape than its
    peers). With the subclass's draw the trainer counts the kept tokens itself."""
    trainer = cls(model_path, [length_reward], args=make_args(tmp_path, max_steps=1), train_dataset=dataset)
    sent = []
    gather = trainer._sum_over_ranks

    def recording(values, device):
        sent.append(sorted(values))
        return gather(values, device)

    trainer._sum_over_ranks = recording
    trainer.train()
    layout_gathers = [keys for keys in sent if "policy_tokens_padded" in keys]
    assert layout_gathers == [["policy_tokens", "policy_tokens_padded"]]
    totals = trainer._cost_aware_totals
    assert 0 < totals["policy_tokens"] <= totals["policy_tokens_padded"]
    if cls is OwnDrawTrainer:  # counted by the trainer; the plan's other counters are the subclass's to keep
        assert totals["rows_kept"] == 0
    else:
        assert totals["policy_tokens"] < totals["rollout_tokens"]


def test_length_grouping_is_a_layout_of_its_own(tmp_path):
    """Length grouping applies to the even layout only, so it is one of `cost_aware_layout`'s values (the packed layout
    already sorts): no combination of fields can ask for it where it does nothing."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        args = make_args(tmp_path, cost_aware_layout="even_by_length")
    assert layout_of(args) == "even"
    with pytest.raises(ValueError, match="use cost_aware_layout='even_by_length'"):
        make_args(tmp_path, cost_aware_group_by_length=True)
