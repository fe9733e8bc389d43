import warnings

import pytest
import trl

from trl_costaware import TESTED_TRL_RANGE, check_trl_version


def test_installed_trl_is_in_the_tested_range():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_trl_version(trl.__version__)


@pytest.mark.parametrize("version", ["1.15.0", "1.17.0", "2.0.0"])
def test_untested_trl_warns_naming_the_range(version):
    with pytest.warns(UserWarning, match="tested with trl>=1.16.0,<1.17.0") as record:
        assert not check_trl_version(version)
    assert version in str(record[0].message)
    assert TESTED_TRL_RANGE == (">=1.16.0", "<1.17.0")


def test_init_accepts_every_grpo_trainer_parameter_with_the_same_default():
    """The subclass is a drop-in: every `GRPOTrainer.__init__` parameter, in the same order, of the same kind, with the
    same default (so the next TRL release cannot drift past it silently)."""
    import inspect

    from trl import GRPOTrainer

    from trl_costaware import CostAwareGRPOTrainer

    theirs = inspect.signature(GRPOTrainer.__init__).parameters
    ours = inspect.signature(CostAwareGRPOTrainer.__init__).parameters
    assert list(ours) == list(theirs)
    for name, parameter in theirs.items():
        assert ours[name].kind == parameter.kind, name
        assert ours[name].default == parameter.default, (name, ours[name].default, parameter.default)


class CountingEnvironment:
    """An environment that owns the reward (`get_reward`) and offers no tool: TRL's `reward_funcs=None` path. Its
    reward is a running count mod 3, so the rollouts of a group differ."""

    calls = 0

    def reset(self, **kwargs):
        return None

    def get_reward(self):
        CountingEnvironment.calls += 1
        return float(CountingEnvironment.calls % 3)


def test_sampling_works_when_the_environment_owns_the_reward(tmp_path, tiny_model_path):
    """reward_funcs omitted, as TRL allows with an environment that defines `get_reward`; the cost-aware draw runs on
    its rewards."""
    import torch
    from testing_utils import last_metric, make_config
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_chat_template

    from trl_costaware import CostAwareGRPOTrainer
    from trl_costaware.embedded.arithmetic import arithmetic_dataset

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    tokenizer.chat_template = qwen3_chat_template  # a template that can render tool calls, as TRL requires

    trainer = CostAwareGRPOTrainer(
        tiny_model_path,
        args=make_config(tmp_path, max_steps=2),
        train_dataset=arithmetic_dataset(32, seed=1, conversational=True),
        processing_class=tokenizer,
        environment_factory=CountingEnvironment,
    )
    assert trainer.reward_func_names == ["CountingEnvironment"]
    before = torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters()])
    trainer.train()
    assert last_metric(trainer, "cost_aware/kept_row_fraction") <= 0.5
    assert last_metric(trainer, "cost_aware/batch_rows_generated") == 8
    after = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    assert not torch.equal(before, after)
