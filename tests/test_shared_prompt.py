"""The shared-prompt forward (`shared_prompt_forward`, `rows/shared_prompt.py`): the layout reproduces the unshared
pass's log-probs, entropies and gradients; the trainer with it on trains to the same weights as with it off, for every
loss type, both layouts and plain GRPO, with LoRA; it refuses what it cannot make exact and falls back, with a warning,
on a batch it cannot lay out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from testing_utils import LOSS_TYPES, loss_settings, make_trainer, weights_of
from trl.trainer.utils import add_fused_lm_head

from trl_costaware import CostAwareGRPOConfig
from trl_costaware.rows import shared_prompt
from trl_costaware.rows.batching import concat_rows


# ---------------------------------------------------------------------------------------------------- batches
def make_batch(prompts, rows, width, vocab=40, seed=0):
    """A TRL-shaped batch: `prompts` lengths, `rows` a list of (prompt index, completion length); prompts
    left-padded to the longest, completions right-padded to `width`. Returns (input_ids, attention_mask)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(3, vocab, (n,), generator=gen) for n in prompts]
    width_p = max(prompts)
    ids, masks = [], []
    for p, n in rows:
        pad = width_p - prompts[p]
        completion = torch.randint(3, vocab, (n,), generator=gen)
        padding = torch.zeros(pad, dtype=torch.long), torch.zeros(width - n, dtype=torch.long)
        ids.append(torch.cat([padding[0], tokens[p], completion, padding[1]]))
        masks.append(torch.cat([torch.zeros(pad), torch.ones(prompts[p] + n), torch.zeros(width - n)]).long())
    return torch.stack(ids), torch.stack(masks)


def unshared(model, ids, mask, width):
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-width] = -100
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    return out.log_probs[:, -width:], out.entropy[:, -width:]


def shared(model, ids, mask, width, bias_dtype):
    layout = shared_prompt.shared_layout(ids, mask, width, shared_prompt.prompt_groups(ids, mask, width))
    out = model(
        input_ids=layout.input_ids,
        attention_mask=shared_prompt.attention_bias(layout.allowed, bias_dtype),
        position_ids=layout.position_ids,
        shift_labels=layout.shift_labels,
        fused_lm_head=True,
    )
    return shared_prompt.unshare(out.log_probs, layout), shared_prompt.unshare(out.entropy, layout), layout


@pytest.fixture(scope="module")
def fused_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    return model


# ---------------------------------------------------------------------------------------------------- the layout
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_layout_reproduces_logps_entropies_and_gradients(fused_model, attention):
    model = fused_model
    model.config._attn_implementation = attention
    # two prompts of different lengths, completions of 0 to the full width, rows of a group not adjacent
    ids, mask = make_batch([4, 7], [(0, 5), (1, 3), (0, 0), (1, 6), (0, 2), (1, 6)], width=6)
    weights = torch.randn(ids.size(0), 6, generator=torch.Generator().manual_seed(1))
    results = []
    for run in ("unshared", "shared"):
        model.zero_grad()
        if run == "unshared":
            logps, entropy = unshared(model, ids, mask, 6)
        else:
            logps, entropy, layout = shared(model, ids, mask, 6, None if attention == "sdpa" else torch.float32)
        ((logps * weights).sum() + entropy.sum()).backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((logps.detach(), entropy.detach(), grads))
    (lp_u, ent_u, grad_u), (lp_s, ent_s, grad_s) = results
    completion = mask[:, -6:].bool()
    assert torch.allclose(lp_s, lp_u, atol=1e-5)
    assert torch.allclose(ent_s, ent_u * completion, atol=1e-5)
    assert torch.allclose(grad_s, grad_u, atol=1e-5, rtol=1e-4)
    assert (lp_s[~completion] == 0).all()
    # the prompt is run once per group: tokens = per group (P - 1) + sum(1 + n)
    assert layout.tokens == (4 - 1 + 3 + 5 + 0 + 2) + (7 - 1 + 3 + 3 + 6 + 6)
    assert layout.unshared_tokens == int(mask.sum())


def test_control_unshared_positions_differ(fused_model):
    """A control: the same sequences with position ids 0..L-1 (the packed-sequence default) are not the unshared
    pass; the test above would see it."""
    model = fused_model
    model.config._attn_implementation = "sdpa"
    ids, mask = make_batch([3, 9], [(0, 4), (1, 4), (0, 4), (1, 2)], width=4)
    logps_u, _ = unshared(model, ids, mask, 4)
    layout = shared_prompt.shared_layout(ids, mask, 4, shared_prompt.prompt_groups(ids, mask, 4))
    out = model(
        input_ids=layout.input_ids,
        attention_mask=shared_prompt.attention_bias(layout.allowed, None),
        position_ids=torch.arange(layout.input_ids.size(1)).expand_as(layout.input_ids),
        shift_labels=layout.shift_labels,
        fused_lm_head=True,
    )
    assert (shared_prompt.unshare(out.log_probs, layout) - logps_u).abs().max() > 1e-3


rows_strategy = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5)), min_size=1, max_size=9)


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.integers(1, 6), min_size=3, max_size=3), rows=rows_strategy)
def test_layout_targets_and_mask(prompts, rows):
    """Every real completion token is one target, once; no query sees another row's segment; positions are the
    unshared columns; the token count is the formula's."""
    width = 5
    ids, mask = make_batch(prompts, rows, width)
    groups = shared_prompt.prompt_groups(ids, mask, width)
    layout = shared_prompt.shared_layout(ids, mask, width, groups)
    expected = sorted(r * width + j for r, (_, n) in enumerate(rows) for j in range(n))
    assert sorted(layout.targets.tolist()) == expected
    labels = layout.shift_labels[layout.shift_labels != shared_prompt.IGNORE]
    assert torch.equal(labels, ids[:, -width:].flatten()[layout.targets])
    p_width = ids.size(1) - width
    used = {p for p, _ in rows}
    assert layout.tokens == sum(prompts[p] - 1 for p in used) + sum(1 + n for _, n in rows)
    for s, group in enumerate(groups):
        allowed = layout.allowed[s]
        assert not allowed.triu(1).any()  # causal
        real = layout.position_ids[s][: allowed.diagonal().sum()]
        assert int(real.max()) < ids.size(1)
        prompt_real = int(mask[group[0], :p_width].sum())
        # a segment's first token (the prompt's last) sees the whole prefix and itself only
        first = prompt_real - 1
        assert allowed[first, :first].all() and allowed[first, first] and not allowed[first, first + 1 :].any()
        assert layout.position_ids[s, first] == p_width - 1


def test_groups_and_problems():
    ids, mask = make_batch([2, 2], [(0, 1), (1, 1), (0, 2)], width=3)
    assert shared_prompt.prompt_groups(ids, mask, 3) == [[0, 2], [1]]
    assert shared_prompt.layout_problem(mask, 3) is None
    holed = mask.clone()
    holed[0, -3:] = torch.tensor([1, 0, 1])
    assert "hole" in shared_prompt.layout_problem(holed, 3)
    right_padded = mask.clone()
    right_padded[1, :2] = torch.tensor([1, 0])
    assert "left-padded" in shared_prompt.layout_problem(right_padded, 3)
    assert "no prompt" in shared_prompt.layout_problem(mask[:, -3:], 3)


def test_planned_pass_counts_what_the_layout_runs():
    ids, mask = make_batch([5, 3], [(0, 4), (1, 2), (0, 1), (0, 3)], width=4)
    plan = shared_prompt.plan_pass(ids, mask, 4)
    assert plan.shared and plan.reason is None and plan.groups == [[0, 2, 3], [1]]
    layout = shared_prompt.shared_layout(ids, mask, 4, plan.groups)
    # group 0: prefix 4 + segments 5, 2, 4; group 1: prefix 2 + segment 3
    assert plan.tokens() == (layout.tokens, len(layout.input_ids) * layout.input_ids.size(1)) == (20, 30)
    assert not shared_prompt.plan_pass(ids[:2], mask[:2], 4).shared  # no prompt repeats
    holed = mask.clone()
    holed[0, -4:] = torch.tensor([1, 0, 1, 0])
    unlaid = shared_prompt.plan_pass(ids, holed, 4)
    assert "hole" in unlaid.reason and not unlaid.shared


def test_refusal_rules():
    ok = SimpleNamespace(_attn_implementation="sdpa")
    assert shared_prompt.refusal(ok, False, False, False) is None
    assert "attention implementation" in shared_prompt.refusal(
        SimpleNamespace(_attn_implementation="flash_attention_2"), False, False, False
    )
    windowed = SimpleNamespace(_attn_implementation="sdpa", sliding_window=4096)
    assert "sliding-window" in shared_prompt.refusal(windowed, False, False, False)
    qwen2_like = SimpleNamespace(_attn_implementation="sdpa", sliding_window=4096, use_sliding_window=False)
    assert shared_prompt.refusal(qwen2_like, False, False, False) is None
    layered = SimpleNamespace(_attn_implementation="eager", layer_types=["full_attention", "sliding_attention"])
    assert "sliding-window" in shared_prompt.refusal(layered, False, False, False)
    assert "multimodal" in shared_prompt.refusal(ok, True, False, False)
    assert "aux loss" in shared_prompt.refusal(ok, False, True, False)
    assert "prompt-learning" in shared_prompt.refusal(ok, False, False, True)


def test_group_micro_batches_keeps_rows_and_sizes():
    ids, mask = make_batch([2, 3, 4], [(0, 1), (1, 1), (2, 2), (0, 2), (1, 2), (2, 1), (0, 1), (1, 1)], width=2)
    p = ids.size(1) - 2
    batch = {
        "prompt_ids": ids[:, :p],
        "prompt_mask": mask[:, :p],
        "completion_ids": ids[:, p:],
        "completion_mask": mask[:, p:],
        "advantages": torch.arange(8.0),
        "cost_aware_rows": list(range(8)),
        "num_items_in_batch": torch.tensor(11),
    }
    chunks = [{k: (v if k == "num_items_in_batch" else v[i : i + 2]) for k, v in batch.items()} for i in (0, 2, 4, 6)]
    out = shared_prompt.group_micro_batches(chunks, run_length=2)
    assert [len(c["advantages"]) for c in out] == [2, 2, 2, 2]
    # within each run of 2 micro-batches the same rows, each prompt's rows adjacent
    assert sorted(concat_rows(out[:2])["cost_aware_rows"]) == [0, 1, 2, 3]
    assert concat_rows(out[:2])["cost_aware_rows"] == [0, 3, 1, 2]
    assert concat_rows(out[2:])["cost_aware_rows"] == [4, 7, 5, 6]
    for c in out:
        assert torch.equal(c["advantages"], torch.tensor(c["cost_aware_rows"], dtype=torch.float))
        assert int(c["num_items_in_batch"]) == 11


def test_config_validates_the_field():
    with pytest.raises(ValueError, match="shared_prompt_forward must be True or False"):
        CostAwareGRPOConfig(output_dir="unused", shared_prompt_forward="yes", use_cpu=True, report_to="none")


# ---------------------------------------------------------------------------------------------------- the trainer
# sgd: the weights move by the gradient itself (Adam's first step would amplify rounding into sign flips)
EXACT_RUN = dict(
    optim="sgd",
    learning_rate=0.5,
    gradient_accumulation_steps=2,
    per_device_train_batch_size=4,
    beta=0.04,
    num_iterations=2,
    max_steps=2,
)


def trained(model_path, tmp_path, name, **overrides):
    trainer = make_trainer(model_path, tmp_path / name, **{**EXACT_RUN, **overrides})
    before = weights_of(trainer.model)
    trainer.train()
    return trainer, weights_of(trainer.model), before


def assert_same_training(model_path, tmp_path, shares=True, **overrides):
    off, w_off, before = trained(model_path, tmp_path, "off", **overrides)
    on, w_on, _ = trained(model_path, tmp_path, "on", shared_prompt_forward=True, **overrides)
    moved = (w_off - before).abs().max()
    assert moved > 1e-3
    assert (w_on - w_off).abs().max() <= 1e-5 * max(1.0, float(moved)), (w_on - w_off).abs().max()
    ratios = [row["cost_aware/shared_prompt_token_ratio"] for row in on.state.log_history if "loss" in row]
    assert len(ratios) == overrides.get("max_steps", EXACT_RUN["max_steps"]) and all(0 < r <= 1 for r in ratios)
    assert min(ratios) < 1 or not shares, ratios
    return on


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("cost_aware", [False, True], ids=["grpo", "packed"])
def test_trainer_matches_unshared(tiny_model_path, tmp_path, loss_type, cost_aware):
    assert_same_training(tiny_model_path, tmp_path, cost_aware=cost_aware, **loss_settings(loss_type))


@pytest.mark.parametrize("loss_type", ["bnpo", "dapo"])
def test_trainer_matches_unshared_even_layout(tiny_model_path, tmp_path, loss_type, monkeypatch):
    """The even layout regroups TRL's micro-batches for dapo; bnpo's step depends on the split, so its rows stay
    where TRL put them (shared only where a micro-batch happens to repeat a prompt)."""
    from trl_costaware import trainer as trainer_module

    monkeypatch.setattr(trainer_module, "layout_for", lambda args, aux=False: "even")
    assert_same_training(tiny_model_path, tmp_path, shares=loss_type != "bnpo", **loss_settings(loss_type))


def test_trainer_matches_unshared_lora(tiny_model_path, tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    runs = {}
    for name, on in (("off", False), ("on", True)):
        args = make_trainer(tiny_model_path, tmp_path / name, **EXACT_RUN, shared_prompt_forward=on).args
        from testing_utils import length_reward, tiny_dataset

        from trl_costaware import CostAwareGRPOTrainer

        trainer = CostAwareGRPOTrainer(
            tiny_model_path, [length_reward], args=args, train_dataset=tiny_dataset(), peft_config=lora
        )
        trainer.train()
        runs[name] = weights_of(trainer.model)
    assert (runs["on"] - runs["off"]).abs().max() <= 1e-5


def test_refused_attention_names_the_field(tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="shared_prompt_forward=True cannot be exact.*flex_attention"):
        make_trainer(model, tmp_path, shared_prompt_forward=True)


def test_a_holed_batch_runs_unshared_with_a_warning(tiny_model_path, tmp_path):
    trainer = make_trainer(tiny_model_path, tmp_path, shared_prompt_forward=True)
    ids, mask = make_batch([3, 5], [(0, 3), (1, 2), (0, 3), (1, 1)], width=3)
    mask[0, -3:] = torch.tensor([1, 0, 1])
    model = trainer.model
    with pytest.warns(UserWarning, match="running unshared where a completion mask has a hole"):
        got = trainer._get_per_token_logps_and_entropies(model, ids, mask, 3)[0]
    trainer.args.shared_prompt_forward = False
    want = trainer._get_per_token_logps_and_entropies(model, ids, mask, 3)[0]
    assert torch.equal(got, want)


def test_control_a_leaky_mask_is_detected(tiny_model_path, tmp_path, monkeypatch):
    """A control for the trainer tests: a mask that lets a segment see the earlier rows' completions trains to other
    weights, and `assert_same_training` says so."""

    def leaky(allowed, dtype):
        causal = torch.ones(allowed.shape[-2:], dtype=torch.bool).tril()
        return causal.expand_as(allowed)[:, None] if dtype is None else None

    monkeypatch.setattr(shared_prompt, "attention_bias", leaky)
    with pytest.raises(AssertionError):
        assert_same_training(tiny_model_path, tmp_path, cost_aware=False, loss_type="dapo")


def test_counters_count_what_the_shared_pass_runs(tiny_model_path, tmp_path):
    """With sharing on, `policy_tokens` counts the tokens the shared policy pass runs (each group's prompt once):
    with one micro-batch, exactly the unshared run's count times the logged token ratio (the first step: both runs
    generate from the same weights)."""
    one_micro_batch = dict(cost_aware=False, loss_type="dapo", num_iterations=1, gradient_accumulation_steps=1)
    one_micro_batch["max_steps"] = 1
    one_micro_batch["per_device_train_batch_size"] = 8
    off, _, _ = trained(tiny_model_path, tmp_path, "off", **one_micro_batch)
    on, _, _ = trained(tiny_model_path, tmp_path, "on", shared_prompt_forward=True, **one_micro_batch)
    tokens_off = [r["cost_aware/policy_tokens"] for r in off.state.log_history if "loss" in r]
    rows_on = [r for r in on.state.log_history if "loss" in r]
    tokens_on = [r["cost_aware/policy_tokens"] for r in rows_on]
    steps_off = [b - a for a, b in zip([0.0] + tokens_off[:-1], tokens_off, strict=True)]
    steps_on = [b - a for a, b in zip([0.0] + tokens_on[:-1], tokens_on, strict=True)]
    for off_step, on_step, row in zip(steps_off, steps_on, rows_on, strict=True):
        assert on_step < off_step
        assert on_step == pytest.approx(off_step * row["cost_aware/shared_prompt_token_ratio"], rel=1e-9)


def test_a_micro_batch_is_planned_once_for_all_its_passes(tiny_model_path, tmp_path, monkeypatch):
    """The host grouping (one device→host copy) runs once per real micro-batch, shared by its old-policy, reference
    and policy passes (β > 0, two iterations: four passes each) and its token counts."""
    from trl_costaware import CostAwareGRPOTrainer

    counts = {"planned": 0, "forwards": 0, "micro_batches": 0}
    plan_pass, shared_forward = shared_prompt.plan_pass, shared_prompt.shared_forward
    process = CostAwareGRPOTrainer._process_new_buffer

    def counting(key, fn):
        def wrapped(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)

        return wrapped

    def counting_process(self):
        process(self)
        counts["micro_batches"] += sum(not step.noop for step in self._cost_aware.generation.micro_steps)

    monkeypatch.setattr(shared_prompt, "plan_pass", counting("planned", plan_pass))
    monkeypatch.setattr(shared_prompt, "shared_forward", counting("forwards", shared_forward))
    monkeypatch.setattr(CostAwareGRPOTrainer, "_process_new_buffer", counting_process)
    trained(tiny_model_path, tmp_path, "on", shared_prompt_forward=True, cost_aware=True, loss_type="dapo")
    assert counts["planned"] == counts["micro_batches"] > 0
    assert counts["forwards"] >= 3 * counts["micro_batches"], counts


def test_forwards_hold_at_most_batch_size_rows(fused_model, monkeypatch):
    """`batch_size` bounds the rows of each forward as in TRL's chunked pass: a group larger than it is split into
    sequences of at most `batch_size` rows, each with its prompt; the log-probs are the same."""
    model = fused_model
    model.config._attn_implementation = "sdpa"
    ids, mask = make_batch([5], [(0, 3), (0, 2), (0, 4), (0, 1), (0, 3)], width=4)
    groups = shared_prompt.prompt_groups(ids, mask, 4)
    seen = []
    original = shared_prompt.shared_layout

    def recorded(input_ids, attention_mask, width, chunk):
        seen.append([len(g) for g in chunk])
        return original(input_ids, attention_mask, width, chunk)

    monkeypatch.setattr(shared_prompt, "shared_layout", recorded)
    with torch.no_grad():
        whole = shared_prompt.shared_forward(model, ids, mask, 4, groups, bias_dtype=None)[0]
        split = shared_prompt.shared_forward(model, ids, mask, 4, groups, bias_dtype=None, batch_size=2)
    assert seen == [[5], [2], [2], [1]]
    assert torch.allclose(split[0], whole, atol=1e-5)
    assert split[2] == (5 - 1) * 3 + (1 + 3) + (1 + 2) + (1 + 4) + (1 + 1) + (1 + 3)  # the prompt once per sequence


def test_packed_micro_steps_keep_groups_together_over_several_runs():
    """With several optimizer steps per generation batch (two runs), group ids keep each prompt's rows in one
    micro-batch where they fit, run by run, and without group ids the layout is the one before (no group ids leak
    from one run into the next)."""
    from trl_costaware.rows.layout import packed_micro_steps

    order = list(range(8))
    lengths = [5, 4, 1, 2, 8, 7, 6, 3]
    groups = [0, 1, 0, 1, 2, 3, 2, 3]
    plain = packed_micro_steps(order, lengths, 4, 2, capacity=2)
    assert plain == [[0, 1], [3, 2], [4, 5], [6, 7]]  # longest first: groups mixed
    grouped = packed_micro_steps(order, lengths, 4, 2, capacity=2, groups=groups)
    assert grouped == [[0, 2], [1, 3], [4, 6], [5, 7]]
