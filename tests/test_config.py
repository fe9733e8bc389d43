"""`CostAwareGRPOConfig`: its fields (at most 8 `cost_aware_*`, the docs' table generated from or matching them),
and `__post_init__` refusing values the sampler cannot use, naming the field and what it allows."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from trl_costaware import CostAwareGRPOConfig

DOCS_TABLE = Path(__file__).resolve().parents[1] / "docs" / "trainer.md"
README = Path(__file__).resolve().parents[1] / "README.md"


def make(tmp_path, **kwargs):
    from testing_utils import make_config

    return make_config(tmp_path, **kwargs)


# ---------------------------------------------------------------- the fields and their documentation
def cost_aware_fields() -> dict[str, object]:
    """name → default of every field the dataclass adds to `GRPOConfig` (the `cost_aware*` fields and
    `shared_prompt_forward`)."""
    from trl import GRPOConfig

    inherited = {f.name for f in dataclasses.fields(GRPOConfig)}
    out = {}
    for f in dataclasses.fields(CostAwareGRPOConfig):
        if f.name not in inherited:
            out[f.name] = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return out


def docs_field_rows(markdown: str) -> list[tuple[str, str]]:
    """(name, default cell) of each table row ``| `cost_aware_xxx` | default | ... |`` (pipes escaped as ``\\|`` inside
    a cell do not split it)."""
    rows = []
    for line in markdown.splitlines():
        match = re.match(r"\s*\|\s*`((?:cost_aware|shared_prompt)\w*)`\s*\|", line)
        if match:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
            rows.append((match.group(1), cells[1] if len(cells) > 1 else ""))
    return rows


def _default_of(cell: str):
    """A default cell's value: one Python literal in backticks (`0.5`, `None`, `"advantage"`)."""
    match = re.fullmatch(r"`([^`]*)`", cell)
    if not match:
        raise ValueError(f"not one literal in backticks: {cell!r}")
    return ast.literal_eval(match.group(1))


def table_mismatches(markdown: str, fields: dict[str, object]) -> list[str]:
    """Every way the docs' field table and the dataclass's fields disagree (empty when they match)."""
    problems = []
    rows = docs_field_rows(markdown)
    names = [name for name, _ in rows]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"{name}: documented {names.count(name)} times")
    for name in sorted(set(fields) - set(names)):
        problems.append(f"{name}: a field without a row in the docs' table")
    for name in sorted(set(names) - set(fields)):
        problems.append(f"{name}: a row in the docs' table that is no field")
    for name, cell in rows:
        if name not in fields:
            continue
        try:
            value = _default_of(cell)
        except (ValueError, SyntaxError) as err:
            problems.append(f"{name}: default cell {cell!r} ({err})")
            continue
        if value != fields[name] or type(value) is not type(fields[name]):
            problems.append(f"{name}: the docs say the default is {cell}, the dataclass {fields[name]!r}")
    return problems


def test_at_most_eight_cost_aware_fields():
    fields = cost_aware_fields()
    sampling = [name for name in fields if name.startswith("cost_aware")]
    assert 1 <= len(sampling) <= 8, sorted(fields)
    assert set(fields) - set(sampling) == {"shared_prompt_forward"}
    assert "cost_aware" in fields and fields["cost_aware"] is True


@pytest.mark.parametrize("table", [DOCS_TABLE, README], ids=["docs/trainer.md", "README.md"])
def test_field_tables_match_the_dataclass(table):
    """docs/trainer.md's and README's tables have one row ``| `cost_aware_xxx` | `default` | contract |`` per field,
    with the dataclass's default, and no row for anything else (README's said `"advantage"` for the proxy after the
    default became `"loss_aware"`)."""
    assert table_mismatches(table.read_text(), cost_aware_fields()) == []


def test_the_table_check_catches_each_kind_of_mismatch():
    """Control: a table with a wrong default, a missing field, a stale field and a duplicate row is reported."""
    fields = {"cost_aware": True, "cost_aware_kept_fraction": 0.5, "cost_aware_token_budget": None}
    good = (
        "| field | default | contract |\n|---|---|---|\n"
        "| `cost_aware` | `True` | on \\| off |\n"
        "| `cost_aware_kept_fraction` | `0.5` | m/N |\n"
        "| `cost_aware_token_budget` | `None` | tokens |\n"
    )
    assert table_mismatches(good, fields) == []
    bad = good.replace("`0.5`", "`0.25`").replace("| `cost_aware_token_budget` | `None` | tokens |\n", "")
    bad += '| `cost_aware_layout` | `"auto"` | gone |\n| `cost_aware` | `True` | again |\n'
    problems = table_mismatches(bad, fields)
    assert len(problems) == 4, problems
    assert any("cost_aware_kept_fraction" in p and "0.25" in p for p in problems)
    assert any(p.startswith("cost_aware_token_budget: a field without") for p in problems)
    assert any(p.startswith("cost_aware_layout: a row") for p in problems)
    assert any(p.startswith("cost_aware: documented 2 times") for p in problems)
    assert table_mismatches(good.replace("`True`", "True"), fields)  # a default not in backticks
    assert table_mismatches(good.replace("`0.5`", "`1`").replace("0.5", "1"), {**fields})  # 1 is not 0.5


@pytest.mark.parametrize(
    "name",
    [
        "cost_aware_layout",
        "cost_aware_draw",
        "cost_aware_weight_cap",
        "cost_aware_budget_delta",
        "cost_aware_prompt_sampling",
        "cost_aware_prompt_fraction",
        "cost_aware_noise_probe_every",
    ],
)
def test_an_unknown_field_fails_as_any_dataclass_field_does(tmp_path, name):
    with pytest.raises(TypeError, match=name):
        make(tmp_path, **{name: 1})


def test_every_field_has_help_and_the_choices_are_the_allowed_values():
    from trl_costaware.rows.sampling import PROXIES, WEIGHT_NORMALIZATIONS

    meta = {f.name: f.metadata for f in dataclasses.fields(CostAwareGRPOConfig) if f.name.startswith("cost_aware")}
    assert all(m.get("help") for m in meta.values()), [n for n, m in meta.items() if not m.get("help")]
    assert meta["cost_aware_proxy"]["choices"] == list(PROXIES) == ["advantage", "loss_aware", "uniform"]
    assert meta["cost_aware_weight_normalization"]["choices"] == list(WEIGHT_NORMALIZATIONS) == ["none", "recenter"]


# ---------------------------------------------------------------- values refused, naming the field
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cost_aware_kept_fraction", 0.0),
        ("cost_aware_kept_fraction", 1.5),
        ("cost_aware_kept_fraction", -0.1),
        ("cost_aware_kept_fraction", "auto"),
        ("cost_aware_kept_fraction", "compute"),
        ("cost_aware_kept_fraction", "0.25"),
        ("cost_aware_kept_fraction", True),
        ("cost_aware_kept_fraction", None),
        ("cost_aware_kept_fraction", float("nan")),
        ("cost_aware_token_budget", 0),
        ("cost_aware_proxy", "gradient"),
        ("cost_aware_proxy", "inverse_sqrt_cost"),
        ("cost_aware_proxy", "inverse_cost"),
        ("cost_aware_cost", "flops"),
        ("cost_aware_cost", "no_such_module_xyz:fn"),
        ("cost_aware_smoothing", -0.1),
        ("cost_aware_smoothing", 1.1),
        ("cost_aware_weight_normalization", "softmax"),
        ("cost_aware_weight_normalization", "self_normalize"),
    ],
)
def test_config_errors_name_the_field(tmp_path, field, value):
    with pytest.raises(ValueError, match=field):
        make(tmp_path, **{field: value})


@pytest.mark.parametrize(
    ("field", "allowed"),
    [
        ("cost_aware_proxy", ("advantage", "loss_aware", "uniform")),
        ("cost_aware_weight_normalization", ("none", "recenter")),
        ("cost_aware_cost", ("prompt_completion", "completion")),
    ],
)
def test_a_bad_choice_names_the_allowed_values(tmp_path, field, allowed):
    with pytest.raises(ValueError) as err:
        make(tmp_path, **{field: "nope"})
    assert all(repr(a) in str(err.value) for a in allowed), str(err.value)


@pytest.mark.parametrize("budget", [0.5, 0, -3, "100", True, 99.5])
def test_bad_token_budget_refused(tmp_path, budget):
    with pytest.raises(ValueError, match=r"cost_aware_token_budget must be a whole number of tokens >= 1"):
        make(tmp_path, cost_aware_token_budget=budget)


def test_whole_values_accepted_as_ints(tmp_path):
    args = make(tmp_path, cost_aware_token_budget=4096.0)
    assert args.cost_aware_token_budget == 4096 and type(args.cost_aware_token_budget) is int
    assert make(tmp_path, cost_aware_token_budget=1).cost_aware_token_budget == 1


def test_unknown_loss_type_refused_at_config_time(tmp_path, monkeypatch):
    """A loss type whose normaliser is not derived is refused by the config, before a model is named or loaded."""
    from trl import GRPOConfig

    original = GRPOConfig.__post_init__

    def accept_any_loss(self):  # as if TRL had added a new loss type
        loss_type, self.loss_type = self.loss_type, "grpo"
        original(self)
        self.loss_type = loss_type

    monkeypatch.setattr(GRPOConfig, "__post_init__", accept_any_loss)
    with pytest.raises(ValueError, match=r"loss_type='new_token_sum' is not supported with cost_aware=True"):
        make(tmp_path, loss_type="new_token_sum")
    assert make(tmp_path, loss_type="new_token_sum", cost_aware=False).loss_type == "new_token_sum"


def test_top_entropy_quantile_is_refused(tmp_path):
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        make(tmp_path, top_entropy_quantile=0.2)
    make(tmp_path, top_entropy_quantile=0.2, cost_aware=False)  # plain GRPO keeps TRL's option


# ---------------------------------------------------------------- the kept fraction and the token budget
def test_kept_fraction_defaults_to_half(tmp_path):
    assert make(tmp_path).cost_aware_kept_fraction == 0.5
    assert CostAwareGRPOConfig.__dataclass_fields__["cost_aware_kept_fraction"].default == 0.5


@pytest.mark.parametrize("value", [1, 0.25, 1.0])
def test_kept_fraction_is_stored_as_a_float(tmp_path, value):
    args = make(tmp_path, cost_aware_kept_fraction=value)
    assert args.cost_aware_kept_fraction == value and type(args.cost_aware_kept_fraction) is float


def test_a_token_budget_replaces_the_fraction(tmp_path):
    """Both set: the config keeps both as given, and the plan reads the budget (`PlanSettings.from_args`)."""
    from trl_costaware.rows.plan import PlanSettings

    args = make(tmp_path, cost_aware_kept_fraction=0.25, cost_aware_token_budget=4096)
    assert args.cost_aware_kept_fraction == 0.25 and args.cost_aware_token_budget == 4096
    assert PlanSettings.from_args(args, False, 1).token_budget == 4096


def test_kept_fraction_and_budget_parse_from_the_command_line(tmp_path):
    """HfArgumentParser / TrlParser call the field's annotation on the text."""
    from trl import TrlParser

    base = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--report_to", "none", "--bf16", "false"]
    (args,) = TrlParser((CostAwareGRPOConfig,)).parse_args_and_config(base)
    assert (args.cost_aware_kept_fraction, args.cost_aware_token_budget) == (0.5, None)
    extra = ["--cost_aware_kept_fraction", "0.25", "--cost_aware_token_budget", "300", "--cost_aware_proxy", "uniform"]
    (args,) = TrlParser((CostAwareGRPOConfig,)).parse_args_and_config(base + extra)
    fields = (args.cost_aware_kept_fraction, args.cost_aware_token_budget, args.cost_aware_proxy)
    assert fields == (0.25, 300, "uniform")
    with pytest.raises(SystemExit):  # argparse refuses a value outside the field's choices
        TrlParser((CostAwareGRPOConfig,)).parse_args_and_config(base + ["--cost_aware_proxy", "inverse_cost"])


@pytest.mark.parametrize(
    ("shape", "fraction", "warns"),
    [
        (dict(per_device_train_batch_size=8, gradient_accumulation_steps=1), 0.5, False),  # packed: any m at S = G
        (dict(per_device_train_batch_size=1, gradient_accumulation_steps=4), 0.5, False),  # packed, S = G = 4: 2 of 4
        (dict(per_device_train_batch_size=1, gradient_accumulation_steps=4, entropy_coef=0.01), 0.5, True),  # even
        (dict(per_device_train_batch_size=4, gradient_accumulation_steps=1, steps_per_generation=4), 0.25, False),
        (dict(per_device_train_batch_size=1, gradient_accumulation_steps=1, steps_per_generation=4), 0.25, True),
    ],
)
def test_a_shape_that_keeps_more_than_asked_warns_naming_the_fields(tmp_path, shape, fraction, warns):
    """m is a multiple of the layout's unit (S for the even layout, S/gcd(S, G) for the packed one): a fraction whose
    count rounds up past 1.1× of it warns at construction, naming the shape's fields."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make(tmp_path, num_generations=4, cost_aware_kept_fraction=fraction, **shape)
    messages = [str(w.message) for w in caught if "cost_aware_kept_fraction" in str(w.message)]
    assert bool(messages) == warns, messages
    if warns:
        assert "per_device_train_batch_size" in messages[0] and "steps_per_generation" in messages[0]
