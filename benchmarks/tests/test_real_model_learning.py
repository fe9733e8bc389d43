"""`benchmarks/real_model_learning.py` and its analysis: the harness on the tiny model (a run resumed from its
checkpoint logs what an uninterrupted one logs, the driver skips finished runs, the lock file), and the analysis on
recorded logs with known answers (costs to the target, ratios, Δ at equal compute, the generation side)."""

from __future__ import annotations

import json
import math
import os

import pytest
import real_model_learning as rml
import real_model_learning_analysis as rmla


def _smoke(tmp, name, *args):
    out, res = str(tmp / name / "out"), str(tmp / name / "res")
    rml.main(["--smoke", "--out", out, "--results", res, "--seeds", "0", "--no-analyse", *args])
    return out, res


def _run(res, arm="advantage_0.5", seed=0):
    with open(os.path.join(res, "runs", f"{arm}__s{seed}.json"), encoding="utf-8") as fh:
        return json.load(fh)


def _trace(run):
    steps = [(s["step"], s["policy_tokens"], s["generated_tokens"], s["rows_kept"]) for s in run["steps"]]
    groups = [(g["step"], g["a"], g["b"], g["rewards"], g["tokens"]) for g in run["groups"]]
    return steps, groups


def test_smoke_resume_matches_an_uninterrupted_run_and_the_driver_skips_finished_runs(tmp_path):
    # interrupted after step 1 (its checkpoint), then resumed to step 2
    out, res = _smoke(tmp_path, "resumed", "--arms", "advantage_0.5", "--steps", "1")
    first = _run(res)
    assert [s["step"] for s in first["steps"]] == [1] and first["resumed_from_step"] == 0
    os.remove(os.path.join(res, "runs", "advantage_0.5__s0.json"))  # as if the session ended before it was written
    with open(os.path.join(out, "runs", "advantage_0.5__s0", "steps.jsonl"), "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"step": 2, "step_s": 0.0, "gen_s": 0.0}) + "\n")  # a step after the checkpoint: cut
    _smoke(tmp_path, "resumed", "--arms", "advantage_0.5")
    resumed = _run(res)
    assert resumed["resumed_from_step"] == 1
    assert [s["step"] for s in resumed["steps"]] == [1, 2]

    _, res_whole = _smoke(tmp_path, "whole", "--arms", "advantage_0.5")
    assert _trace(resumed) == _trace(_run(res_whole))
    assert all("eval" in s for s in resumed["steps"])  # smoke: evaluated at every step
    assert resumed["base_eval"]["greedy_per_problem"] and resumed["commit"]

    # finished runs are skipped: nothing runs, the record is untouched
    before = os.path.getmtime(os.path.join(res, "runs", "advantage_0.5__s0.json"))
    assert rml.drive(["advantage_0.5"], [0], out, res, smoke=True) == []
    assert os.path.getmtime(os.path.join(res, "runs", "advantage_0.5__s0.json")) == before

    # the end score evaluated again from the last checkpoint: the recorded seed reproduces the recorded score
    _smoke(tmp_path, "resumed", "--arms", "advantage_0.5,grpo", "--reevaluate", "2")  # grpo: not run, skipped
    again = json.load(open(os.path.join(res, "reevaluations", "advantage_0.5__s0.json"), encoding="utf-8"))
    assert again["reproduced"] and again["step"] == 2 and len(again["scores"]) == len(set(again["seeds"])) == 2
    assert again["recorded"]["score"] == resumed["steps"][-1]["eval"]["score"]
    assert not os.path.exists(os.path.join(res, "reevaluations", "grpo__s0.json"))
    assert rml.reevaluate("advantage_0.5", 0, str(tmp_path / "elsewhere"), res, 2, smoke=True) is None  # no checkpoint
    with pytest.raises(SystemExit, match="--reevaluate"):
        rml.main(["--reevaluate", "0"])


def test_smoke_analysis_writes_its_files(tmp_path):
    out, res = _smoke(tmp_path, "both", "--arms", "grpo,uniform_0.5")
    os.makedirs(os.path.join(res, "reevaluations"))
    record = dict(run="grpo__s0", step=2, recorded={"score": 0.5, "greedy": 1.0}, reproduced=True, scores=[0.25, 0.75])
    with open(os.path.join(res, "reevaluations", "grpo__s0.json"), "w", encoding="utf-8") as fh:
        json.dump(dict(record, score=0.5), fh)
    summary = rmla.analyse(res)
    for name in ("summary.json", "summary.md", "curves.png"):
        assert os.path.getsize(os.path.join(res, name)) > 0
    assert summary["reevaluations"]["grpo__s0"]["score"] == 0.5
    assert "| grpo__s0 | 2 | 0.500 | 0.500 [0.250, 0.750] | 2 | yes |" in open(os.path.join(res, "summary.md")).read()
    assert summary["arms"] == ["grpo", "uniform_0.5"]
    # the GRPO arm trains on every rollout; the row stage on about half (at least one row per step)
    grpo, uniform = (summary["end"][a]["policy_tokens_per_step"]["mean"] for a in ("grpo", "uniform_0.5"))
    assert 0 < uniform < grpo


def test_lock_is_exclusive_and_a_stale_one_is_taken_over(tmp_path):
    with rml.claimed(str(tmp_path), "x") as mine:
        assert mine
        with rml.claimed(str(tmp_path), "x") as other:
            assert not other
    assert not os.path.exists(tmp_path / "locks" / "x.lock")
    (tmp_path / "locks" / "y.lock").write_text("999999999")  # no such process
    with rml.claimed(str(tmp_path), "y") as mine:
        assert mine


def test_command_line_rejects_unknown_arms_and_bad_seeds(tmp_path, capsys):
    with pytest.raises(SystemExit, match="--arms"):
        rml.main(["--arms", "grpo,nope", "--out", str(tmp_path), "--results", str(tmp_path)])
    with pytest.raises(SystemExit, match="--seeds"):
        rml.main(["--seeds", "a", "--out", str(tmp_path), "--results", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        rml.main(["--help"])
    assert exc.value.code == 0 and "--smoke" in capsys.readouterr().out


# ====================================================================================================== analysis
def _record(arm, seed, scores, gen_per_step, policy_per_step, step_s, every=5, groups=(), rows=64):
    """A run record with evaluations at every `every` steps (scores[0] is the start), `rows` rollouts per step."""
    steps = []
    for k in range(1, (len(scores) - 1) * every + 1):
        row = {"step": k, "step_s": step_s, "gen_s": step_s / 2}
        row.update(generated_tokens=gen_per_step * k, policy_tokens=policy_per_step * k, rows_kept=0, rows_generated=0)
        if k % every == 0:
            row["eval"] = {"score": scores[k // every], "greedy": 0.9, "eval_s": 1.0}
        steps.append(row)
    return {
        "arm": arm,
        "seed": seed,
        "commit": "abc",
        "base_eval": {"score": scores[0], "greedy": 0.8},
        "shape": {"prompts": rows // 8, "generations": 8},
        "steps": steps,
        "groups": list(groups),
    }


def test_costs_to_the_target_and_ratios_on_a_recorded_log(tmp_path):
    runs = {}
    for seed in range(3):
        # GRPO: 0.1 -> 0.5 -> 0.9 at steps 5, 10; the arm learns half as fast per step at half the policy tokens
        runs[("grpo", seed)] = _record("grpo", seed, [0.1, 0.5, 0.9], 1000, 2000, 10.0)
        runs[("arm", seed)] = _record("arm", seed, [0.1, 0.3, 0.5, 0.7, 0.9], 1000, 1000, 6.0)
    s = rmla.summarise(runs)
    assert s["start"] == pytest.approx(0.1) and s["grpo_end"] == pytest.approx(0.9)
    t = s["targets"]["0.8"]
    assert t["target"] == pytest.approx(0.74)
    # GRPO reaches 0.74 at step 5 + 5 * 0.24 / 0.4 = 8; the arm at 15 + 5 * 0.04 / 0.2 = 16
    assert t["arms"]["grpo"]["step"]["by_seed"][0] == pytest.approx(8.0)
    assert t["arms"]["arm"]["step"]["by_seed"][0] == pytest.approx(16.0)
    assert t["arms"]["arm"]["step"]["ratio"]["mean"] == pytest.approx(2.0)
    assert t["arms"]["arm"]["policy_tokens"]["ratio"]["mean"] == pytest.approx(1.0)
    assert t["arms"]["arm"]["seconds"]["ratio"]["mean"] == pytest.approx(16 * 6.0 / (8 * 10.0))
    # priced (generation 55%, passes + update 45%, calibrated on GRPO's step): the arm's step costs 0.55 + 0.225
    assert t["arms"]["arm"]["compute_gpu"]["ratio"]["mean"] == pytest.approx(2 * 0.775)
    iv = t["arms"]["arm"]["step"]["ratio"]
    assert iv["lo"] == pytest.approx(2.0) and iv["hi"] == pytest.approx(2.0)
    # equal steps: both end at 0.9; equal compute: the arm's 20 steps cost 15.5 GRPO steps > GRPO's 10: outside
    end = s["end"]["arm"]
    assert end["delta_equal_steps"]["mean"] == pytest.approx(0.0)
    assert end["delta_equal_compute_gpu"]["mean"] is None
    assert end["update_share"] == pytest.approx(0.5)
    # a run that never reaches the target is listed, not given a cost
    runs[("slow", 0)] = _record("slow", 0, [0.1, 0.2, 0.3], 1000, 1000, 6.0)
    s = rmla.summarise(runs)
    assert s["targets"]["0.8"]["arms"]["slow"]["step"]["not_reached"] == [0]
    assert "slow" in rmla.report(s)


def test_ratios_to_another_baseline_arm_and_their_files(tmp_path):
    """--baseline grpo_shared: every ratio is taken to that arm of the same seed, its seeds define the target (GRPO
    without it may miss seeds), and the files get a suffix; an arm with no run is refused."""
    runs = {("grpo", 0): _record("grpo", 0, [0.1, 0.5, 0.9], 1000, 2000, 10.0)}
    for seed in range(2):
        runs[("grpo_shared", seed)] = _record("grpo_shared", seed, [0.1, 0.5, 0.9], 1000, 1000, 4.0)
        runs[("arm", seed)] = _record("arm", seed, [0.1, 0.3, 0.5, 0.7, 0.9], 1000, 500, 3.0)
    s = rmla.summarise(runs, baseline="grpo_shared")
    t = s["targets"]["0.8"]["arms"]
    assert s["baseline"] == "grpo_shared" and s["arms"][0] == "grpo_shared"
    assert t["arm"]["step"]["ratio"]["values"] == pytest.approx([2.0, 2.0])  # both seeds, not only GRPO's seed 0
    assert t["arm"]["seconds"]["ratio"]["mean"] == pytest.approx(16 * 3.0 / (8 * 4.0))
    assert t["grpo"]["policy_tokens"]["ratio"]["values"] == pytest.approx([2.0])
    assert "Ratio to `grpo_shared` (8 x 8)" in rmla.report(s)
    res = tmp_path / "res"
    os.makedirs(res / "runs")
    for (arm, seed), run in runs.items():
        (res / "runs" / f"{arm}__s{seed}.json").write_text(json.dumps(run))
    rmla.main([str(res), "--baseline", "grpo_shared"])
    assert json.loads((res / "summary_vs_grpo_shared.json").read_text())["baseline"] == "grpo_shared"
    assert (res / "frontier_vs_grpo_shared.png").exists() and not (res / "summary.md").exists()
    with pytest.raises(SystemExit, match="--baseline grpo_4x8"):
        rmla.main([str(res), "--baseline", "grpo_4x8"])


def test_arms_are_compared_paired_by_seed_and_a_fall_is_measured():
    runs = {}
    for seed in range(3):
        runs[("grpo", seed)] = _record("grpo", seed, [0.1, 0.5, 0.9], 1000, 2000, 10.0)
        # a: GRPO's curve at half the policy tokens, but it falls from 0.9 to 0.7 on seed 0; b: two steps per GRPO step
        a_end = 0.7 if seed == 0 else 0.9
        runs[("a", seed)] = _record("a", seed, [0.1, 0.5, 0.9, a_end], 1000, 1000, 6.0)
        runs[("b", seed)] = _record("b", seed, [0.1, 0.3, 0.5, 0.7, 0.9], 1000, 1000, 6.0)
    s = rmla.summarise(runs)
    assert rmla.largest_fall([{"score": v} for v in (0.1, 0.6, 0.4, 0.5, 0.3)]) == pytest.approx(0.3)
    assert s["end"]["a"]["largest_fall"]["values"] == pytest.approx([0.2, 0.0, 0.0])
    assert s["end"]["grpo"]["largest_fall"]["mean"] == 0.0
    row = s["between_arms"]["b - a"]
    assert row["seeds"] == [0, 1, 2]
    # to 0.74: a at step 8 (as GRPO), b at step 16: b - a = +1.0 of GRPO's steps on every seed
    assert row["step@0.8"]["values"] == pytest.approx([1.0, 1.0, 1.0])
    assert row["step@0.8"]["lo"] == pytest.approx(1.0) and row["step@0.8"]["hi"] == pytest.approx(1.0)
    # CPU seconds (the step clock where a record has none): (16 - 8) steps x 6 s over GRPO's 8 x 10 s
    assert row["cpu_seconds@0.8"]["values"] == pytest.approx([0.6, 0.6, 0.6])
    # last scores: b 0.9 against a 0.7 / 0.9 / 0.9
    assert row["end_score"]["values"] == pytest.approx([0.2, 0.0, 0.0])
    assert "b - a" in rmla.report(s) and "Between arms" in rmla.report(s)


def test_generation_side_shares_and_predictability():
    def group(step, a, rewards, tokens=10):
        return {
            "step": step,
            "a": a,
            "b": 2,
            "rewards": rewards,
            "tokens": [tokens] * len(rewards),
            "cut_off": [0] * 4,
        }

    groups = [
        group(1, 2, [1, 1, 1, 1], 5),  # no gradient, solved
        group(1, 3, [0, 1, 0, 1]),
        group(6, 2, [1, 1, 1, 1], 5),  # again no gradient: predicted from its history
        group(6, 3, [1, 0, 0, 0]),  # has gradient: predicted from a mixed history
    ]
    g = rmla.generation_side([{"groups": groups}])
    assert g["no_gradient_share"] == pytest.approx(0.5)
    assert g["no_gradient_token_share"] == pytest.approx(40 / 120)
    assert [w["steps"] for w in g["windows"]] == ["1-5", "6-10"]
    assert g["predicted_groups"] == 2 and g["auc_earlier_share"] == 1.0 and g["auc_bernoulli"] == 1.0
    assert g["at_half_recall_bernoulli"] == {"precision": 1.0, "recall": 1.0, "skipped_share": 0.5}


def test_auc_counts_ties_as_half():
    assert rmla.auc([1, 1], [1, 0]) == 0.5
    assert rmla.auc([0.2, 0.9, 0.5], [0, 1, 0]) == 1.0
    assert rmla.auc([1.0], [1]) is None


def test_frontier_prices_by_generation_share_and_alpha():
    """GRPO 8 x 8 (64 rows, 1000 generated + 2000 policy tokens per step) reaches the 80% target 0.74 at step 8;
    GRPO 4 x 8 (32 rows, half of both) at step 10; the row stage (64 rows, half the policy tokens) at step 9. At
    generation share 0.55: 4 x 8 costs 0.55·5 + 0.45·5 = 5 GRPO steps per generated token (α = 1), and 0.55·5·2 +
    2.25 = 7.75 with generation fixed per step (α = 0); the row stage 0.55·9 + 0.45·4.5 = 6.975 at any α. They
    break even where 0.55·5·2^(1−α) = 4.725: α = 1 − log2(1.71818) = 0.219."""
    runs = {}
    for seed in range(3):
        runs[("grpo", seed)] = _record("grpo", seed, [0.1, 0.5, 0.9], 1000, 2000, 10.0)
        runs[("grpo_4x8", seed)] = _record("grpo_4x8", seed, [0.1, 0.42, 0.74001, 0.9], 500, 1000, 6.0, rows=32)
        runs[("loss_aware_0.5", seed)] = _record("loss_aware_0.5", seed, [0.1, 0.42, 0.82, 0.9], 1000, 1000, 7.0)
    s = rmla.summarise(runs)
    one, zero = s["frontier"]["s0.55_a1"], s["frontier"]["s0.55_a0"]
    assert one["arms"]["grpo"]["ratio"]["mean"] == pytest.approx(1.0)
    assert one["arms"]["grpo_4x8"]["ratio"]["mean"] == pytest.approx(5.0 / 8, rel=1e-3)
    assert zero["arms"]["grpo_4x8"]["ratio"]["mean"] == pytest.approx(7.75 / 8, rel=1e-3)
    for t in (one, zero):
        assert t["best_grpo"] == "grpo_4x8"
        assert t["arms"]["loss_aware_0.5"]["ratio"]["mean"] == pytest.approx(6.975 / 8)
    assert one["arms"]["loss_aware_0.5"]["vs_best_grpo"]["mean"] == pytest.approx(6.975 / 5.0, rel=1e-3)
    assert zero["arms"]["loss_aware_0.5"]["vs_best_grpo"]["mean"] == pytest.approx(6.975 / 7.75, rel=1e-3)
    # α = 1 is the per-token pricing of the targets table, calibrated on GRPO's steps up to the target
    assert s["targets"]["0.8"]["arms"]["grpo_4x8"]["compute_gpu"]["ratio"]["mean"] == pytest.approx(5 / 8, rel=1e-3)
    against = s["break_even_alpha"]["grpo_4x8"]
    assert against["0.55"]["alpha"] == pytest.approx(0.219, abs=2e-3)
    assert against["0.55"]["cheaper_below"] == "loss_aware_0.5"  # generation nearly fixed: the row stage
    assert against["0.3"]["alpha"] == pytest.approx(1 - math.log2(2.35 / 1.5), abs=2e-3)
    assert s["break_even_alpha"]["grpo_8x4"]["0.55"] is None  # no such run
    assert "## The frontier" in rmla.report(s)
    assert one["best_grpo_shared"] is None and "GRPO with sharing's best" not in rmla.report(s)
    # GRPO with each prompt run once (the row stage's tokens, GRPO's steps): its own best batch, its own ratio column
    for seed in range(3):
        runs[("grpo_shared", seed)] = _record("grpo_shared", seed, [0.1, 0.5, 0.9], 1000, 1000, 7.0)
    shared = rmla.summarise(runs)["frontier"]["s0.55_a1"]
    assert shared["best_grpo"] == "grpo_4x8" and shared["best_grpo_shared"] == "grpo_shared"
    # GRPO with sharing: 0.55·8 + 0.45·4 = 6.2 GRPO steps
    assert shared["arms"]["loss_aware_0.5"]["vs_best_grpo_shared"]["mean"] == pytest.approx(6.975 / 6.2, rel=1e-3)
    assert "GRPO with sharing's best" in rmla.report(rmla.summarise(runs))


def test_intervals_are_student_t_with_the_seeds_values():
    iv = rmla.interval([1.0, 2.0, 3.0])
    assert iv["mean"] == 2.0 and iv["values"] == [1.0, 2.0, 3.0]
    assert iv["hi"] - 2.0 == pytest.approx(4.303 * 1.0 / 3**0.5, rel=1e-3)  # t(2) · sd / √3
    assert rmla.interval([0.5])["lo"] is None
    assert rmla.excludes_zero(rmla.interval([0.1, 0.2, 0.15])) and not rmla.excludes_zero(rmla.interval([-1, 1, 0.5]))
    assert "(1.00, 2.00, 3.00)" in rmla._iv(iv)


def test_smoke_new_arms_run_at_their_shapes(tmp_path):
    """GRPO at 4 x 8 and the 8 x 16 draw run at their scaled-down shapes (1 x 4 and 2 x 8 in smoke mode), filter only
    keeps every row with an advantage; each step records its CPU seconds and the load, each run its cores."""
    _, res = _smoke(tmp_path, "shapes", "--arms", "grpo_4x8,filter_only,loss_aware_0.25_8x16", "--steps", "1")
    rows = {arm: _run(res, arm)["steps"][0] for arm in ("grpo_4x8", "filter_only", "loss_aware_0.25_8x16")}
    assert rows["grpo_4x8"]["rows_generated"] == 4 == rows["grpo_4x8"]["rows_kept"]
    assert rows["loss_aware_0.25_8x16"]["rows_generated"] == 16 and rows["loss_aware_0.25_8x16"]["rows_kept"] <= 4
    assert rows["filter_only"]["rows_generated"] == 8 >= rows["filter_only"]["rows_kept"]
    for arm, row in rows.items():
        assert row["cpu_s"] > 0 and row["load"] >= 0, arm
        assert _run(res, arm)["cores"], arm
    assert rml.arm_shape("grpo_8x4")["generations"] == 4 and rml.arm_shape("grpo_8x4", smoke=True)["generations"] == 2
    assert rml.arm_shape("loss_aware_0.5_8x4") == rml.arm_shape("grpo_8x4")
    assert rml.ARMS["loss_aware_0.5_8x4"] == rml.ARMS["loss_aware_0.5"]


def test_smoke_passage_task_logs_what_the_draw_keeps(tmp_path):
    """--task passage_table trains and evaluates on the passage task (one note per passage for the tiny model) in
    folders of its own, and logs per generation batch every row's prompt tokens and the kept rows."""
    out, res = str(tmp_path / "out"), str(tmp_path / "res")
    rml.main(["--smoke", "--task", "passage_table", "--out", out, "--results", res, "--seeds", "0", "--no-analyse",
              "--arms", "loss_aware_0.5", "--steps", "1"])  # fmt: skip
    run = _run(res, "loss_aware_0.5")
    assert run["task"] == "passage_table" and run["groups"][0]["notes"] == 1
    (draw,) = run["draws"]
    assert len(draw["prompt_tokens"]) == 8 and 0 < len(draw["kept"]) < 8
    assert min(draw["prompt_tokens"]) > 100  # the passage's characters, not a times-table question's
    assert rml.task_dirs("passage_table")[1].endswith("real_model_learning_passage_table")


def test_shapes_per_task_and_the_shared_arms(tmp_path):
    """The passage task runs at its own shape (4 x 4 in 2 micro-batches, 40 steps), which an arm's shape scales; the
    shared arms switch on the shared-prompt forward and train (smoke, the passage task)."""
    shape = rml.arm_shape("grpo", task="passage_table")
    assert (shape["prompts"], shape["generations"], shape["micro_batches"], shape["steps"]) == (4, 4, 2, 40)
    assert rml.arm_shape("grpo_8x4", task="passage_table")["generations"] == 2
    assert (
        rml.arm_shape("grpo")["prompts"] == rml.PROMPTS
        and rml.arm_shape("grpo", smoke=True, task="passage_table")["prompts"] == rml.SMOKE["prompts"]
    )
    assert rml.ARMS["grpo_shared"]["shared_prompt_forward"] and not rml.ARMS["grpo_shared"]["cost_aware"]
    assert rml.arm_shape("grpo_shared_4x8", task="passage_table")["prompts"] == 2
    assert rml.ARMS["filter_only_shared"] == {**rml.ARMS["filter_only"], "shared_prompt_forward": True}
    for proxy in ("loss_aware", "advantage"):
        assert rml.ARMS[f"{proxy}_0.5_shared"] == {**rml.ARMS[f"{proxy}_0.5"], "shared_prompt_forward": True}
    out, res = str(tmp_path / "out"), str(tmp_path / "res")
    rml.main(["--smoke", "--task", "passage_table", "--out", out, "--results", res, "--seeds", "0", "--no-analyse",
              "--arms", "grpo_shared", "--steps", "1"])  # fmt: skip
    assert _run(res, "grpo_shared")["settings"]["shared_prompt_forward"] is True


def test_a_run_gets_a_port_of_its_own(tmp_path, monkeypatch):
    """accelerate leaves MASTER_PORT (29500) in the environment of a process that trained in-process and binds it
    for a world-size-1 group on the CPU: a run launched from such a process, while another holds that port, still
    starts (before: EADDRINUSE when smoke runs ran side by side under pytest-xdist)."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        monkeypatch.setenv("MASTER_PORT", str(held.getsockname()[1]))
        out, res = str(tmp_path / "out"), str(tmp_path / "res")
        assert rml.drive(["grpo"], [0], out, res, smoke=True, steps=1) == ["grpo__s0"]
