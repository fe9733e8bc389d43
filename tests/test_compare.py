"""`trl-costaware compare`: real short runs (baseline and cost-aware), synthetic histories, the noise rule, and the
W&B online reader against a stand-in `wandb.Api`."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer
from trl_costaware.embedded.arithmetic import arithmetic_dataset, arithmetic_reward
from trl_costaware.embedded.model import tiny_model_path
from trl_costaware.scripts.cli import main as cli_main
from trl_costaware.tracking.callbacks import METRICS_FILE, RUN_FILE, MetricsRecorderCallback, attach_tracking
from trl_costaware.tracking.compare import CompareError, RunHistory, compare_runs, format_report, load_runs, main, plot
from trl_costaware.tracking.compare.curves import aggregate, first_crossing, run_curve, smooth
from trl_costaware.tracking.compare.noise import (
    NO_CLAIM,
    baseline_improvement,
    bootstrap_mean_interval,
    improvement,
    step_noise_sd,
)
from trl_costaware.tracking.compare.readers import canonical_key
from trl_costaware.tracking.compare.report import NOT_REACHED


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    """Two real 3-step runs on the tiny model: baseline (cost_aware=False) and cost-aware; their output dirs."""
    root = tmp_path_factory.mktemp("runs")
    path, data = tiny_model_path(), arithmetic_dataset(48, seed=0)
    dirs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("OMP_NUM_THREADS", "1")
        for name, cost_aware in (("baseline-s0", False), ("cost-aware-s0", True)):
            args = CostAwareGRPOConfig(
                output_dir=str(root / name),
                use_cpu=True,
                report_to="none",
                per_device_train_batch_size=8,
                num_generations=4,
                max_completion_length=16,
                max_steps=3,
                logging_steps=1,
                bf16=False,
                save_strategy="no",
                disable_tqdm=True,
                cost_aware=cost_aware,
                cost_aware_run_group="compare-test",
            )
            trainer = CostAwareGRPOTrainer(path, [arithmetic_reward], args=args, train_dataset=data)
            if not any(isinstance(cb, MetricsRecorderCallback) for cb in trainer.callback_handler.callbacks):
                attach_tracking(trainer)
            trainer.train()
            dirs[name] = root / name
    return dirs


def test_compare_real_runs_table_and_png(real_runs, tmp_path, capsys):
    png, out_json = tmp_path / "cmp.png", tmp_path / "cmp.json"
    rc = main([*(str(d) for d in real_runs.values()), "--out", str(png), "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "| arm" in out and "| run" in out
    assert "baseline-s0" in out and "cost-aware-s0" in out
    assert "tokens to peak" in out and "tokens to 99% peak" in out and "saving" in out and "wall total" in out
    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    result = json.loads(out_json.read_text())
    assert result["baseline"] == "baseline"
    assert {a["arm"] for a in result["arms"]} == {"baseline", "cost_aware"}
    by_arm = {a["arm"]: a for a in result["arms"]}
    # the cost-aware arm trains on fewer policy tokens in total
    assert by_arm["cost_aware"]["x_total"] < by_arm["baseline"]["x_total"]
    # 3 steps of a random tiny model: the baseline does not improve, so nothing is claimed
    assert result["claim"] is False and not result["baseline_improvement"]["improved"]
    assert "did not improve beyond noise: no claim" in out
    assert all(t["x"] is None and t["saving_pct"] is None for a in result["arms"] for t in a["targets"])


def test_cli_compare_folder_of_runs(real_runs, tmp_path, capsys):
    root = str(next(iter(real_runs.values())).parent)
    rc = cli_main(["compare", root, "--out", str(tmp_path / "p.png"), "--x", "generated_tokens", "--smooth", "2"])
    out = capsys.readouterr().out
    assert rc == 0 and "cost_aware/generated_tokens" in out and "rolling mean of 2" in out
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_cli_usage_and_errors(tmp_path, capsys):
    assert cli_main([]) == 0 and "compare" in capsys.readouterr().out
    assert cli_main(["nope"]) == 2
    assert main([str(tmp_path / "missing"), "--no-plot"]) == 2
    assert "no such file" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- synthetic runs
def write_run(folder, xs, ys, cost_aware, seed=0, metric="reward", wall=None):
    os.makedirs(folder, exist_ok=True)
    wall = xs if wall is None else wall
    with open(os.path.join(folder, METRICS_FILE), "w") as fh:
        for i, (x, y, w) in enumerate(zip(xs, ys, wall, strict=True)):
            row = {"step": i + 1, "wall_time": float(w), "split": "train", "cost_aware/policy_tokens": float(x)}
            row[metric] = float(y)
            fh.write(json.dumps(row) + "\n")
    with open(os.path.join(folder, RUN_FILE), "w") as fh:
        arm = "cost_aware" if cost_aware else "baseline"
        json.dump({"arm": arm, "cost_aware": cost_aware, "seed": seed, "group": "g"}, fh)
    return str(folder)


def synthetic(name, xs, ys, cost_aware, seed=0):
    rows = [
        {"cost_aware/policy_tokens": float(x), "reward": float(y), "wall_time": float(x) / 10}
        for x, y in zip(xs, ys, strict=True)
    ]
    info = {"arm": "cost_aware" if cost_aware else "baseline", "cost_aware": cost_aware, "seed": seed}
    return RunHistory(name=name, source=name, kind="local", rows=rows, info=info)


def test_first_crossing_interpolates():
    x, y = [0, 10, 20, 30], [0.0, 0.2, 0.6, 0.4]
    assert first_crossing(x, y, 0.4) == (15.0,)
    assert first_crossing(x, y, 0.6, [0, 1, 2, 3]) == (20.0, 2.0)
    assert first_crossing(x, y, -1.0) == (0.0,)  # reached at the first point
    assert first_crossing(x, y, 0.61, [0, 1, 2, 3]) == (None, None)


def test_smoothing():
    assert np.allclose(smooth(np.full(5, 0.3), 0.9), 0.3)  # debiased EMA: no pull toward 0
    assert np.allclose(smooth([1, 2, 3, 4], 2), [1, 1.5, 2.5, 3.5])
    assert np.allclose(smooth([1, 5, 2], 0), [1, 5, 2])


def test_not_reached():
    runs = [
        synthetic("base", [100, 200, 300, 400], [0.1, 0.3, 0.5, 0.4], False),
        synthetic("ca", [50, 100, 150, 200], [0.1, 0.2, 0.3, 0.35], True),
    ]
    result = compare_runs(runs, smoothing=0)
    ca = next(a for a in result.arms if a["arm"] == "cost_aware")
    assert ca["targets"][0]["x"] is None and ca["targets"][0]["saving_pct"] is None
    assert result.targets[0].value == pytest.approx(0.5) and result.targets[0].baseline_x == pytest.approx(300)
    report = format_report(result)
    ca_line = next(line for line in report.splitlines() if line.startswith("| ca "))
    assert NOT_REACHED in ca_line and "n/a" in ca_line


def test_saving_and_99_percent_target():
    runs = [
        synthetic("base", [100, 200, 300, 400], [0.0, 0.5, 1.0, 0.8], False),
        synthetic("ca", [50, 100, 150, 200], [0.0, 0.5, 1.0, 1.0], True),
    ]
    result = compare_runs(runs, smoothing=0, fractions=(1.0, 0.99))
    assert [t.value for t in result.targets] == pytest.approx([1.0, 0.99])
    ca = next(a for a in result.arms if a["arm"] == "cost_aware")
    assert ca["targets"][0]["x"] == pytest.approx(150) and ca["targets"][0]["saving_pct"] == pytest.approx(50.0)
    assert ca["targets"][1]["x"] == pytest.approx(149) and ca["targets"][1]["saving_pct"] == pytest.approx(50.0)
    assert ca["targets"][0]["wall"] == pytest.approx(15.0) and ca["targets"][0]["wall_saving_pct"] == pytest.approx(50)
    assert ca["final_vs_baseline"] == pytest.approx(0.2)


def test_seeds_aggregated_mean_and_band(tmp_path):
    dirs = [
        write_run(tmp_path / "b0", [100, 200, 300], [0.0, 0.4, 0.8], False, seed=0),
        write_run(tmp_path / "b1", [100, 200, 300], [0.0, 0.2, 0.4], False, seed=1),
        write_run(tmp_path / "c0", [50, 100, 150, 200], [0.0, 0.3, 0.6, 0.7], True, seed=0),
        write_run(tmp_path / "c1", [60, 110, 160, 210], [0.0, 0.4, 0.5, 0.8], True, seed=1),
    ]
    runs = load_runs(dirs, progress=True)
    result = compare_runs(runs, smoothing=0, band="minmax")
    base = result.curves["arms"]["baseline"]
    assert base.n == 2 and np.allclose(base.y, [0.0, 0.3, 0.6])
    assert np.allclose(base.lo, [0.0, 0.2, 0.4]) and np.allclose(base.hi, [0.0, 0.4, 0.8])
    ca = result.curves["arms"]["cost_aware"]
    assert ca.x[0] == 60 and ca.x[-1] == 200  # the range both seeds cover
    assert result.baseline_peak == pytest.approx(0.6)
    arm = next(a for a in result.arms if a["arm"] == "cost_aware")
    assert arm["runs"] == 2 and arm["seeds"] == ["0", "1"]
    assert arm["targets"][0]["x"] is not None and arm["targets"][0]["saving_pct"] > 0
    assert len(result.runs) == 4


def test_progress_bar_on_many_runs(tmp_path, capsys):
    dirs = [write_run(tmp_path / f"r{i}", [1, 2], [0, 1], bool(i % 2), seed=i) for i in range(4)]
    load_runs([str(tmp_path)], progress=True)
    assert "reading runs" in capsys.readouterr().err
    assert len(load_runs(dirs)) == 4


def test_labels_baseline_and_errors(tmp_path):
    a = write_run(tmp_path / "arm-a", [1, 2, 3], [0.1, 0.2, 0.3], True)
    b = write_run(tmp_path / "arm-b", [1, 2, 3], [0.1, 0.3, 0.2], True)
    runs = load_runs([a, b])
    with pytest.raises(CompareError, match="baseline"):
        compare_runs(runs, labels=["*arm-a*=A", "*arm-b*=B"])
    result = compare_runs(runs, labels=["*arm-a*=A", "*arm-b*=B"], baseline="B", smoothing=0)
    assert result.baseline == "B" and result.baseline_peak == pytest.approx(0.3)
    with pytest.raises(CompareError, match="no rows"):
        compare_runs(runs, metric="eval_reward")
    result = compare_runs(runs, arm_by=["seed"], labels=None, baseline="seed=0", smoothing=0)
    assert [a["arm"] for a in result.arms] == ["seed=0"]


def test_minimize_and_keys():
    runs = [
        synthetic("base", [1, 2, 3], [3.0, 2.0, 1.0], False),
        synthetic("ca", [1, 2, 3], [3.0, 1.0, 0.5], True),
    ]
    result = compare_runs(runs, smoothing=0, minimize=True, fractions=(1.0,))
    assert result.baseline_peak == pytest.approx(1.0)
    ca = next(a for a in result.arms if a["arm"] == "cost_aware")
    assert ca["targets"][0]["x"] == pytest.approx(2.0) and ca["peak"] == pytest.approx(0.5)
    assert canonical_key("train/reward") == "reward" and canonical_key("eval/reward") == "eval_reward"
    assert canonical_key("_runtime") == "wall_time" and canonical_key("train/global_step") == "step"


class StandInRun:
    """A `wandb.apis.public.Run` as compare uses it: id, name, group, job_type, tags, config, scan_history()."""

    def __init__(self, run_id, name, cost_aware, rewards, scale, group="g"):
        self.id, self.name, self.group, self.tags = run_id, name, group, ["x"]
        self.job_type = "cost_aware" if cost_aware else "baseline"
        self.config = {"cost_aware": cost_aware, "seed": 3, "_wandb": {"internal": 1}, "_name_or_path": "m"}
        self.history = [{"_step": 0, "_runtime": 1.0, "train/global_step": 0, "train/learning_rate": 1e-6}]
        for i, r in enumerate(rewards, 1):
            self.history.append(
                {"_step": i, "_runtime": float(i), "train/global_step": i, "train/reward": r}
                | {"train/cost_aware/policy_tokens": scale * i}
            )
        self.history.append({"_step": 99, "eval/reward": None, "media": "table", "train/flag": True})

    def scan_history(self, keys=None, page_size=1000, min_step=None, max_step=None):
        for row in self.history:
            if keys is None or all(k in row for k in keys):
                yield dict(row)


class StandInApi:
    """`wandb.Api` with the calls compare makes: `run(path)` and `runs(path, filters)`."""

    calls: list = []
    runs_by_path = {
        "ent/proj": [
            StandInRun("b1", "wb-base", False, [0.1, 0.3, 0.5, 0.7, 0.6], 100),
            StandInRun("c1", "wb-ca", True, [0.2, 0.6, 0.6, 0.7, 0.7], 50),
            StandInRun("o1", "other", True, [0.0], 50, group="other-group"),
        ]
    }

    def __init__(self, overrides=None, timeout=None, api_key=None):
        self.calls.append(("init", timeout))

    def run(self, path):
        self.calls.append(("run", path))
        entity, project, run_id = path.split("/")
        for run in self.runs_by_path.get(f"{entity}/{project}", []):
            if run.id == run_id:
                return run
        raise ValueError(f"Could not find run {path}")

    def runs(self, path, filters=None, order="+created_at", per_page=50):
        self.calls.append(("runs", path, filters))
        group = (filters or {}).get("group")
        return [r for r in self.runs_by_path.get(path, []) if group is None or r.group == group]


def test_wandb_online_group_and_run(monkeypatch, tmp_path, capsys):
    """Runs read through (a stand-in for) the W&B API: a whole group, a single run, keys as the trainer logs them."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setattr(wandb, "Api", StandInApi)
    StandInApi.calls.clear()
    runs = load_runs(["https://wandb.ai/ent/proj/groups/g/workspace?nw=1"], progress=False)
    assert ("runs", "ent/proj", {"group": "g"}) in StandInApi.calls
    assert [r.name for r in runs] == ["wb-base", "wb-ca"] and [r.kind for r in runs] == ["wandb-online"] * 2
    base = runs[0]
    assert base.info["arm"] == "baseline" and base.info["seed"] == 3 and base.info["group"] == "g"
    assert "_wandb" not in base.info["config"] and base.source == "ent/proj/b1" and base.info["model"] == "m"
    assert base.rows[1] == {"_step": 1, "step": 1, "wall_time": 1.0, "reward": 0.1, "cost_aware/policy_tokens": 100}
    assert base.rows[-1] == {"_step": 99}  # None, text and booleans are not metrics
    rc = main(["ent/proj/groups/g", "--smooth", "0", "--no-plot", "--json", str(tmp_path / "r.json")])
    assert rc == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["claim"] is True
    ca = next(a for a in result["arms"] if a["arm"] == "cost_aware")
    # baseline peak 0.7 at 400 tokens; the cost-aware run reaches 0.7 at 200 tokens
    assert ca["targets"][0]["x"] == pytest.approx(200) and ca["targets"][0]["saving_pct"] == pytest.approx(50)
    single = load_runs(["https://wandb.ai/ent/proj/runs/c1/overview"], progress=False)
    assert ("run", "ent/proj/c1") in StandInApi.calls and single[0].info["arm"] == "cost_aware"
    assert main(["ent/proj/nope", "--no-plot"]) == 2
    assert (
        "cannot read it as a W&B run online (ValueError: Could not find run ent/proj/nope)" in capsys.readouterr().err
    )
    assert main(["ent/proj/groups/empty", "--no-plot"]) == 2
    assert "has no runs" in capsys.readouterr().err


def test_wandb_offline_files_are_not_read(tmp_path, capsys):
    run_dir = tmp_path / "wandb" / "offline-run-1"
    run_dir.mkdir(parents=True)
    (run_dir / "run-1.wandb").write_bytes(b":W&B")
    assert main([str(tmp_path / "wandb"), "--no-plot"]) == 2
    assert "pass the run's output dir" in capsys.readouterr().err
    assert main([str(run_dir / "run-1.wandb"), "--no-plot"]) == 2
    assert "wandb sync" in capsys.readouterr().err


def test_online_path_unreachable_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert main(["someone/some-project/abc123", "--no-plot"]) == 2
    assert "online" in capsys.readouterr().err


def test_run_curve_skips_rows_without_metric():
    run = synthetic("r", [1, 2], [0.5, 0.7], False)
    run.rows.insert(1, {"cost_aware/policy_tokens": 1.5, "loss": 0.1})
    curve = run_curve(run, "reward", "cost_aware/policy_tokens", 0)
    assert list(curve.x) == [1.0, 2.0]
    single = aggregate([curve])
    assert single.n == 1 and list(single.y) == [0.5, 0.7]


def test_early_noise_is_not_a_crossing():
    """With smoothing, each run's first points (where the average rests on a few values) are dropped by default."""
    base = synthetic("base", [10, 20, 30, 40, 50, 60], [0.1, 0.2, 0.3, 0.4, 0.5, 0.5], False)
    ca = synthetic("ca", [5, 10, 15, 20, 25, 30], [0.9, 0.0, 0.1, 0.2, 0.2, 0.2], True)  # one lucky first batch
    result = compare_runs([base, ca], smoothing=2)
    assert result.min_points == 2
    ca_arm = next(a for a in result.arms if a["arm"] == "cost_aware")
    assert ca_arm["targets"][0]["x"] is None
    kept = compare_runs([base, ca], smoothing=2, min_points=1)
    assert next(a for a in kept.arms if a["arm"] == "cost_aware")["targets"][0]["x"] == 5.0


# ---------------------------------------------------------------------------------------------------- noise rule
def flat_noisy(seed, n=100, tokens_per_step=100):
    """A reward curve with no trend: 0.4 + N(0, 0.08) per step (like the old embedded demo's flat curves)."""
    rng = np.random.default_rng(seed)
    return [tokens_per_step * (i + 1) for i in range(n)], 0.4 + rng.normal(0.0, 0.08, n)


def improving(seed, n=100, tokens_per_step=100, gain=0.3):
    xs, ys = flat_noisy(seed, n, tokens_per_step)
    return xs, ys + gain * np.arange(n) / n


def test_flat_noisy_baseline_makes_no_claim(tmp_path, capsys):
    """On two flat noisy curves the cost-aware arm crosses the baseline's (noise) peak with far fewer tokens: the code
    before the noise rule reported that as an 87% saving. Now: no claim."""
    dirs = [
        write_run(tmp_path / "base", *flat_noisy(28), cost_aware=False),
        write_run(tmp_path / "ca", *flat_noisy(29, tokens_per_step=50), cost_aware=True),
    ]
    result = compare_runs(load_runs(dirs))
    base, ca = result.curves["arms"]["baseline"], result.curves["arms"]["cost_aware"]
    peak = result.targets[0].value
    # what the old report printed: tokens to the baseline's peak, cost-aware vs baseline
    (old_ca,), (old_base,) = first_crossing(ca.x, ca.y, peak), first_crossing(base.x, base.y, peak)
    assert old_ca is not None and 1 - old_ca / old_base > 0.5
    assert not result.claim and result.noise.runs == 1 and result.noise.window == 20
    assert all(t["x"] is None and t["saving_pct"] is None for r in result.arms + result.runs for t in r["targets"])
    assert main([*dirs, "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "Baseline did not improve beyond noise: no claim" in out
    ca_line = next(line for line in out.splitlines() if line.startswith("| cost_aware "))
    assert ca_line.count(NO_CLAIM) == 6 and "%" not in ca_line


def test_flat_noisy_seeds_make_no_claim():
    runs = [synthetic(f"b{s}", *flat_noisy(s), False, seed=s) for s in range(3)]
    runs += [synthetic(f"c{s}", *flat_noisy(10 + s, tokens_per_step=50), True, seed=s) for s in range(3)]
    result = compare_runs(runs)
    assert result.noise.rule == "bootstrap over seeds" and result.noise.runs == 3
    assert result.noise.lo < 0 < result.noise.hi and not result.claim
    assert "no claim" in format_report(result)


@pytest.mark.parametrize("seeds", [1, 3])
def test_improving_baseline_still_claims(seeds, tmp_path):
    runs = [synthetic(f"b{s}", *improving(s), False, seed=s) for s in range(seeds)]
    runs += [synthetic(f"c{s}", *improving(10 + s, tokens_per_step=50), True, seed=s) for s in range(seeds)]
    result = compare_runs(runs)
    assert result.claim and result.noise.improvement > 0.2 and result.noise.lo > 0
    ca = next(a for a in result.arms if a["arm"] == "cost_aware")
    assert ca["targets"][0]["saving_pct"] > 20  # half the tokens per step, same gain per step
    report = format_report(result)
    assert "Baseline improved beyond noise" in report and NO_CLAIM not in report
    plot(result, str(tmp_path / "p.png"))


def test_noise_rule_pieces():
    assert improvement([0, 0, 0, 0, 0, 1, 1, 1, 1, 1]) == pytest.approx(1.0)  # windows of 2
    assert step_noise_sd(np.arange(50) * 0.01) == pytest.approx(0.0, abs=1e-12)  # a linear trend is not noise
    noisy = np.random.default_rng(0).normal(0, 0.1, 20_000)
    assert step_noise_sd(noisy) == pytest.approx(0.1, rel=0.03)
    assert bootstrap_mean_interval([1.0, 2.0]) == pytest.approx((1.0, 2.0))
    lo, hi = bootstrap_mean_interval([0.1, 0.2, 0.3, 0.25])
    assert 0.1 <= lo < 0.2125 < hi <= 0.3
    two = baseline_improvement([[0, 0, 1, 1, 1], [0, 0, 0, 0, -0.1]])  # one seed improved, one did not
    assert not two.improved and two.lo < 0
    assert not baseline_improvement([[0.0, 1.0]]).improved  # 2 points: no noise estimate
    assert not baseline_improvement([]).improved


# ---------------------------------------------------------------------------------------------------- compute
def synthetic_steps(name, steps, ys, cost_aware, gen_per_step, policy_per_step, seed=0):
    """A run logged once per step with cumulative generated and policy tokens at constant rates per step."""
    rows = [
        {
            "step": s,
            "reward": float(y),
            "wall_time": float(s),
            "cost_aware/generated_tokens": float(gen_per_step * s),
            "cost_aware/policy_tokens": float(policy_per_step * s),
        }
        for s, y in zip(steps, ys, strict=True)
    ]
    info = {"arm": "cost_aware" if cost_aware else "baseline", "cost_aware": cost_aware, "seed": seed}
    return RunHistory(name=name, source=name, kind="local", rows=rows, info=info)


def test_compute_weights_calibrate_the_baseline_step_to_one():
    from trl_costaware.tracking.compare.compute import GPU_VERL, token_weights

    w = token_weights(GPU_VERL, gen_per_step=500.0, policy_per_step=2000.0)
    assert w.compute(500.0, 2000.0) == pytest.approx(1.0)
    assert w.gen == pytest.approx(0.55 / 500) and w.policy == pytest.approx(0.45 / 2000)  # passes + update
    assert w.compute(500.0, 1000.0) == pytest.approx(0.55 + 0.45 * 0.5)  # half the policy tokens


def test_step_cost_and_break_even():
    from trl_costaware.tracking.compare.compute import (
        GPU_GEN77,
        GPU_VERL,
        break_even_steps_ratio,
        cpu_split,
        step_cost,
    )

    assert step_cost(1.0, GPU_VERL) == pytest.approx(1.0)
    assert step_cost(0.3, GPU_VERL) == pytest.approx(0.55 + 0.45 * 0.3)
    assert break_even_steps_ratio(0.3, GPU_VERL) == pytest.approx(1 / 0.685)
    assert GPU_GEN77.generation + GPU_GEN77.passes + GPU_GEN77.update == pytest.approx(1.0)
    # The CPU-like (update-heavy) split breaks even later than the GPU splits, which break even later than gen 77%.
    cpu = cpu_split(0.55)
    assert (
        break_even_steps_ratio(0.3, cpu)
        > break_even_steps_ratio(0.3, GPU_VERL)
        > break_even_steps_ratio(0.3, GPU_GEN77)
    )
    assert break_even_steps_ratio(0.5, cpu_split(0.55)) == pytest.approx(1 / (0.45 + 0.55 * 0.5))


def test_parse_split_and_phase_cost():
    from trl_costaware.tracking.compare.compute import GPU_VERL, parse_split, phase_step_cost

    assert parse_split("gpu") is GPU_VERL
    assert parse_split("cpu:0.55").update == pytest.approx(0.55) and parse_split("cpu:0.55").passes == 0
    custom = parse_split("gen=0.6,passes=0.1,update=0.3")
    assert (custom.generation, custom.passes, custom.update) == pytest.approx((0.6, 0.1, 0.3))
    for bad in ("gen=0.6,update=0.3", "gen=0.5,foo=0.5", "nonsense", "cpu:1.5"):
        with pytest.raises(ValueError):
            parse_split(bad)
    # GRPO's update is 55% of its step; an arm whose update is 30% of its own (same generation) costs 0.45/0.70.
    assert phase_step_cost(0.30, 0.55) == pytest.approx(0.45 / 0.70)


def test_compare_reports_compute_to_target_and_break_even():
    """Baseline: 1000 generated + 1000 policy tokens per step, reaches 1.0 at step 4. Cost-aware: the same generation,
    a quarter of the policy tokens, reaches 1.0 at step 5. Under verl's split (generation 55%) its step costs
    0.55 + 0.45 / 4 = 0.6625 of the baseline's, so its compute to the target is 5 × 0.6625 = 3.3125 baseline steps
    (a saving of 17.2%), and it would break even at 1 / 0.6625 = 1.51× the baseline's steps."""
    steps = [1, 2, 3, 4, 5, 6]
    runs = [
        synthetic_steps("base", steps, [0.0, 0.25, 0.5, 1.0, 0.9, 0.9], False, 1000, 1000),
        synthetic_steps("ca", steps, [0.0, 0.2, 0.4, 0.8, 1.0, 1.0], True, 1000, 250),
    ]
    result = compare_runs(runs, smoothing=0, fractions=(1.0,))
    assert result.targets[0].baseline_compute == pytest.approx(4.0)
    ca = next(a for a in result.arms if a["arm"] == "cost_aware")
    t = ca["targets"][0]
    assert t["compute"] == pytest.approx(5 * 0.6625)
    assert t["compute_saving_pct"] == pytest.approx(100 * (1 - 5 * 0.6625 / 4))
    assert t["saving_pct"] == pytest.approx(100 * (1 - 5 * 250 / 4000))  # policy tokens: the old headline
    assert ca["compute_per_step"] == pytest.approx(0.6625) and ca["break_even_steps_ratio"] == pytest.approx(
        1.5094, 1e-3
    )
    report = format_report(result)
    assert "compute to peak" in report and "break-even steps ratio" in report and "3.3 steps" in report
    # The update-heavy CPU-like split (update 55% of the baseline's step) makes the same run cheaper in compute.
    cpu = compare_runs(runs, smoothing=0, fractions=(1.0,), compute_split=parse_split_cpu())
    ca_cpu = next(a for a in cpu.arms if a["arm"] == "cost_aware")
    assert ca_cpu["targets"][0]["compute"] == pytest.approx(5 * (0.45 + 0.55 / 4))
    # No split: no compute columns, the report as before.
    plain = compare_runs(runs, smoothing=0, fractions=(1.0,), compute_split=None)
    assert plain.compute_weights is None and "compute to" not in format_report(plain)
    assert plain.to_json()["compute"] is None and result.to_json()["compute"]["units"] == "baseline steps"


def test_generation_alpha_prices_generation_by_rows_per_step():
    """α = 1 reproduces the per-token price at any batch; α = 0 prices a step's generation as fixed whatever its rows
    (at the same completion lengths); the published curve fits α ≈ 0.38."""
    from trl_costaware.tracking.compare.compute import (
        GPU_VERL,
        PUBLISHED_ALPHA,
        fitted_alpha,
        token_weights,
    )

    per_token = token_weights(GPU_VERL, 1000.0, 2000.0)
    one = token_weights(GPU_VERL, 1000.0, 2000.0, alpha=1.0, rows_per_step=64)
    zero = token_weights(GPU_VERL, 1000.0, 2000.0, alpha=0.0, rows_per_step=64)
    half = token_weights(GPU_VERL, 1000.0, 2000.0, alpha=0.5, rows_per_step=64)
    for rows, gen, pol in [(64, 1000.0, 2000.0), (32, 500.0, 1000.0), (128, 2000.0, 1000.0)]:
        assert one.compute(gen, pol, rows) == pytest.approx(per_token.compute(gen, pol))
        # half the rows at the same lengths: the same generation per step at α = 0, 1/√2 of it at α = ½
        assert zero.compute(gen, pol, rows) == pytest.approx(0.55 + 0.45 * pol / 2000)
        assert half.compute(gen, pol, rows) == pytest.approx(0.55 * (rows / 64) ** 0.5 + 0.45 * pol / 2000)
    with pytest.raises(ValueError, match="rows per step"):
        zero.compute(1000.0, 2000.0)
    with pytest.raises(ValueError, match="generation_alpha"):
        token_weights(GPU_VERL, 1000.0, 2000.0, alpha=1.5, rows_per_step=64)
    assert fitted_alpha([16, 64, 256], [3.0, 4.0, 8.5]) == pytest.approx(PUBLISHED_ALPHA, abs=0.005)
    assert fitted_alpha([1, 2, 4], [1.0, 2.0, 4.0]) == pytest.approx(1.0)


def test_compare_prices_a_smaller_batch_by_generation_alpha(capsys):
    """Baseline: 64 rows, 1000 generated and 1000 policy tokens per step, reaches 1.0 at step 4. A smaller batch:
    32 rows, half of both, reaches it at step 6. Per token (α = 1) its step costs 0.5 of the baseline's: 3 baseline
    steps; at α = 0 its generation costs the baseline's per step, 0.55 + 0.45 / 2 = 0.775: 4.65 baseline steps."""
    steps = [1, 2, 3, 4, 5, 6, 7]
    base = synthetic_steps("base", steps, [0.0, 0.25, 0.5, 1.0, 1.0, 1.0, 1.0], False, 1000, 1000)
    small = synthetic_steps("small", steps, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.0], False, 500, 500)
    for run, rows in ((base, 64), (small, 32)):
        for row in run.rows:
            row["cost_aware/rows_generated"] = float(rows * row["step"])
    arms = dict(smoothing=0, fractions=(1.0,), baseline="baseline", labels=["small=small", "base=baseline"])
    one = compare_runs([base, small], **arms)
    zero = compare_runs([base, small], **arms, generation_alpha=0.0)
    cost = {r["arm"]: r["targets"][0]["compute"] for r in one.arms}
    assert cost == pytest.approx({"baseline": 4.0, "small": 3.0})
    cost = {r["arm"]: r["targets"][0]["compute"] for r in zero.arms}
    assert cost == pytest.approx({"baseline": 4.0, "small": 6 * 0.775})
    assert zero.to_json()["compute"]["generation_alpha"] == 0.0 and "--generation-alpha" in format_report(zero)
    with pytest.raises(ValueError, match="generation_alpha"):
        compare_runs([base, small], smoothing=0, generation_alpha=2.0)


def test_png_has_a_compute_panel_at_the_split():
    """The PNG draws the metric against policy tokens AND against compute at the comparison's split (verl's
    generation 55% by default), where the cost-aware arm's crossing sits at 3.3 baseline steps against the baseline's
    4 (policy tokens: 1,250 against 4,000); without a split (or without the token counters), one panel as before."""
    from trl_costaware.tracking.compare.plot import COMPUTE_LABEL, figure

    steps = [1, 2, 3, 4, 5, 6]
    runs = [
        synthetic_steps("base", steps, [0.0, 0.25, 0.5, 1.0, 0.9, 0.9], False, 1000, 1000),
        synthetic_steps("ca", steps, [0.0, 0.2, 0.4, 0.8, 1.0, 1.0], True, 1000, 250),
    ]
    fig = figure(compare_runs(runs, smoothing=0, fractions=(1.0,)))
    tokens, compute = fig.axes
    assert tokens.get_xlabel() == "policy-optimisation tokens" and compute.get_xlabel() == COMPUTE_LABEL
    assert "generation 55%" in compute.get_title()
    crossings = {line.get_color(): line.get_xdata()[0] for line in compute.lines if line.get_marker() == "o"}
    assert crossings["tab:blue"] == pytest.approx(5 * 0.6625) and crossings["tab:gray"] == pytest.approx(4.0)
    assert "compute to baseline peak vs baseline — cost_aware: +17.2%" in compute.texts[-1].get_text()
    assert len(figure(compare_runs(runs, smoothing=0, fractions=(1.0,), compute_split=None)).axes) == 1
    no_counters = [
        synthetic("base", [100, 200, 300, 400], [0.0, 0.5, 1.0, 0.8], False),
        synthetic("ca", [50, 100, 150, 200], [0.0, 0.5, 1.0, 1.0], True),
    ]
    assert len(figure(compare_runs(no_counters, smoothing=0)).axes) == 1


def parse_split_cpu():
    from trl_costaware.tracking.compare.compute import cpu_split

    return cpu_split(0.55)


def test_compare_compute_needs_the_token_counters():
    """Runs without generated-token counters (an older record) get no compute: n/a, not a wrong number."""
    runs = [
        synthetic("base", [100, 200, 300, 400], [0.0, 0.5, 1.0, 0.8], False),
        synthetic("ca", [50, 100, 150, 200], [0.0, 0.5, 1.0, 1.0], True),
    ]
    result = compare_runs(runs, smoothing=0)
    assert result.compute_weights is None
    assert all(t["compute"] is None for a in result.arms for t in a["targets"])


def test_cli_compute_split(tmp_path, capsys):
    base = write_run(tmp_path / "b", [100, 200, 300], [0.0, 0.5, 1.0], False)
    assert main([base, "--no-plot", "--compute-split", "gen=0.5,update=0.4"]) == 2
    assert "--compute-split" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- duplicated steps
def duplicate_record(folder) -> None:
    """Rewrite a run's record as a duplicated launch leaves it (tests/test_launch.py, before the refusal): two
    processes each log every step into the one file, interleaved, and the later one's start truncated the earlier
    one's first rows."""
    path = os.path.join(folder, METRICS_FILE)
    with open(path) as fh:
        rows = [json.loads(line) for line in fh]
    first, second = rows[3:], [dict(r, wall_time=r["wall_time"] + 0.01) for r in rows]
    mixed = [r for pair in zip(first, second, strict=False) for r in pair] + second[len(first) :]
    with open(path, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in mixed)


def test_compare_flags_a_record_with_duplicated_steps(tmp_path, capsys):
    xs, ys = improving(0)
    dirs = [
        write_run(tmp_path / "base", xs, ys, cost_aware=False),
        write_run(tmp_path / "ca", *improving(1, tokens_per_step=50), cost_aware=True),
    ]
    duplicate_record(dirs[1])
    out_json = tmp_path / "cmp.json"
    assert main([*dirs, "--no-plot", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    warning = next((line for line in out.splitlines() if line.startswith("Warning")), None)
    assert warning is not None, out[:2000]
    assert "run `ca`" in warning and f"{len(xs) - 3} of its {len(xs)} train steps" in warning
    assert "2 times" in warning and "--use_cpu true" in warning
    assert out.index(warning) < out.index("| arm")  # above the tables
    data = json.loads(out_json.read_text())
    by_name = {r["name"]: r for r in data["runs"]}
    assert by_name["ca"]["duplicated_steps"] == {"steps": len(xs) - 3, "train_steps": len(xs), "max_copies": 2}
    assert by_name["base"]["duplicated_steps"] is None
    assert data["warnings"] == [warning]


def test_eval_and_train_rows_at_one_step_are_not_duplicates():
    """A clean record has a train, an eval and a summary row at the same step; W&B rows carry no `split`."""
    from trl_costaware.tracking.compare.readers import duplicated_steps

    rows = [
        {"step": 1, "split": "train", "reward": 0.1},
        {"step": 2, "split": "train", "reward": 0.2},
        {"step": 2, "split": "eval", "eval_reward": 0.3},
        {"step": 2, "split": "summary", "train_runtime": 1.0},
    ]
    assert duplicated_steps(rows) is None
    online = [{"step": 2, "reward": 0.2}, {"step": 2, "eval_reward": 0.3}, {"step": 2, "train_runtime": 1.0}]
    online.append({"step": 2, "_step": 7, "wall_time": 3.0, "time": 1.0})  # a row that only logged a table
    assert duplicated_steps(online) is None
    twice = rows + [{"step": 1, "split": "train", "reward": 0.1}] * 2
    assert duplicated_steps(twice) == {"steps": 1, "train_steps": 2, "max_copies": 3}
