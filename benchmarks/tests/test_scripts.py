"""Every benchmark script runs end to end in its smoke mode through its real entry point and writes its result files
(into a temporary folder, never over the committed results), and every command RESULTS.md and README.md show names
a `make` target, a script and options that exist. The scripts with tests of their own elsewhere: `regime_matrix.py`
(test_regime_matrix.py), `step_profile.py` (test_step_profile.py), `real_model_rows.py` (test_real_model_rows.py);
`real_model_learning*.py` have their own test file. `_common.py`, `baselines.py`, `regime_runs.py` and
`regime_analysis.py` are modules of those scripts, not commands."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
SCRIPTS_TESTED_ELSEWHERE = {"regime_matrix.py", "step_profile.py", "real_model_rows.py", "real_model_learning.py"}
MODULES = {"_common.py", "baselines.py", "regime_runs.py", "regime_analysis.py"}


def _files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.is_file()}


def test_every_script_has_a_smoke_test():
    """A new script under benchmarks/ gets a smoke test here (or a test file of its own, listed above)."""
    here = Path(__file__).read_text().split("def test_every_script_has_a_smoke_test")[-1]
    scripts = {p.name for p in BENCH.glob("*.py") if not p.name.startswith("real_model_learning")}
    scripts -= MODULES | SCRIPTS_TESTED_ELSEWHERE
    untested = sorted(s for s in scripts if f'"{s[:-3]}"' not in here and f"import {s[:-3]}" not in here)
    assert not untested, f"benchmark scripts without a smoke test: {untested}"


def test_no_import_circle_between_the_scripts():
    """A script imports its helper modules, never the other way round (the learning benchmark and its analysis
    imported each other)."""
    import ast

    from test_architecture import cycles

    names = {p.stem for p in BENCH.glob("*.py")}
    graph = {}
    for path in BENCH.glob("*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in names:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(a.name for a in node.names if a.name in names)
        graph[path.stem] = imported - {path.stem}
    assert graph["real_model_learning"] >= {"real_model_learning_analysis"}  # the graph sees these imports
    assert cycles(graph) == []


def test_cost_aware_sgd_smoke(tmp_path):
    import cost_aware_sgd

    payload = cost_aware_sgd.main(["--smoke", "--out", str(tmp_path)])
    assert _files(tmp_path) == {"cost_aware_sgd.json", "cost_aware_sgd.png"}
    samplers = set(payload["families"][0]["samplers"])
    assert samplers == set(cost_aware_sgd.SAMPLERS)  # the ablations 1/c and 1/√c are built by the script


def test_cost_aware_sgd_draw_is_hansen_hurwitz():
    import cost_aware_sgd

    p = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    idx, w = cost_aware_sgd.draw_multinomial(p, 4000, torch.Generator().manual_seed(0))
    assert torch.allclose(w, 1.0 / (3 * p[idx]))
    assert abs(float((idx == 0).double().mean()) - 0.5) < 0.05


def test_token_efficiency_smoke(tmp_path, warm_model_path):
    import token_efficiency

    token_efficiency.main(["--smoke", "--out", str(tmp_path / "runs"), "--results", str(tmp_path)])
    assert {"token_efficiency_smoke.json", "token_efficiency_smoke.md"} <= _files(tmp_path)
    res = json.loads((tmp_path / "token_efficiency_smoke.json").read_text())
    assert res["steps"] == 2
    token_efficiency.main(["--compute-to-target", "--results", str(tmp_path)])  # reads the committed runs
    assert {"compute_to_target.json", "compute_to_target.md"} <= _files(tmp_path)


def test_token_efficiency_schedules_only_existing_arms():
    import _common as common
    import token_efficiency as te

    for arms in (te.MAIN_ARMS, te.OTHER_ARMS, te.KEPT_ARMS, te.SMOKE_ARMS):
        assert set(arms) <= set(common.ARMS)
    assert {a for pair in te.PAIRS for a in pair} <= set(common.ARMS)
    with pytest.raises(SystemExit, match="unknown"):
        te.main(["--smoke", "--arms", "cost_aware_auto", "--out", "/nonexistent", "--results", "/tmp"])


@pytest.mark.multiprocess
def test_shared_prompt_update_smoke_resumes_and_analyses(tmp_path, capsys):
    """Two cells per pass on the tiny model, both passes, the token ratio from the drawn lengths; a rerun skips the
    cells already measured; the analysis writes its table and figure."""
    import shared_prompt_update as spu

    res = tmp_path / "res"
    assert spu.main(["--smoke", "--results", str(res)]) == 0
    cells = [json.loads(line) for line in (res / "cells.jsonl").read_text().splitlines()]
    assert {(c["prompt"], c["generations"], c["pass"]) for c in cells} == {
        (12, g, p) for g in (2, 4) for p in spu.PASSES
    }
    for c in cells:
        assert c["cpu_s"] > 0 and c["peak_mb_above_model"] >= 0 and 0 < c["token_ratio"] < 1
        assert c["tokens_run"] < 12 * c["generations"] + c["generations"] * 9 or c["pass"] == "unshared"
    assert spu.main(["--smoke", "--results", str(res)]) == 0  # nothing left to run
    assert len((res / "cells.jsonl").read_text().splitlines()) == 4
    assert _files(res) == {"cells.jsonl", "summary.md", "update_vs_tokens.png"}
    assert "| 12 | 4 |" in (res / "summary.md").read_text()


def test_shared_prompt_draw_smoke_and_nested_cost(tmp_path):
    """On a run record of two batches (prompts found again in the run's training set, measured by a stand-in
    tokenizer): every design's figure per batch, and the nested draw's cost is the expected shared cost of its draw
    (one uniform per group, Monte Carlo)."""
    import shared_prompt_draw as spd
    from real_model_learning import DATASET_N, task_dataset

    class Chars:  # a token per 4 characters of the message
        def apply_chat_template(self, messages, **kwargs):
            return list(range(len(messages[0]["content"]) // 4))

    rows = task_dataset("passage_table", DATASET_N, 0).select(range(4))
    rewards = ([1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0])
    groups = [
        {"step": 1 + i // 2, "a": r["a"], "b": r["b"], "notes": r["notes"], "rewards": rewards[i % 2],
         "tokens": [10 + i, 20, 30 + 2 * i, 64]}
        for i, r in enumerate(rows)
    ]  # fmt: skip
    record = tmp_path / "grpo_shared__s0.json"
    record.write_text(json.dumps({"seed": 0, "groups": groups}))
    # a real_model_rows result whose noise parts come from known row gradients x (K = 8 prompts x G = 8)
    x = torch.randn(8, 8, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x[:, :4] += x[:, 4:]  # correlated rows within a group
    a, sums = float((x**2).sum()), x.sum(1)
    b, t2 = float((sums**2).sum()) / 8, float((sums.sum(0) ** 2).sum())
    total = (b / 8 - t2 / (8 * 64)) / (7 * 8)
    noise = {"within": (a - b) / (8 * 7) / 64, "total": total, "signal": t2 / 64**2 - total}
    rows_json = tmp_path / "rows.json"
    batch_record = {"mode": "full", "batch": 0, "families": {"dapo": {"noise": noise}}}
    rows_json.write_text(json.dumps({"models": {"m": {"batches": [batch_record]}}}))
    want = float((sums**2).sum()) / a
    assert spd.cross_terms(str(rows_json))[0]["ratio"] == pytest.approx(want, rel=1e-9) and want > 1.1

    spd.main(["--runs", str(record), "--out", str(tmp_path / "draw"), "--rows", str(rows_json)], tokenizer=Chars())
    result = json.loads((tmp_path / "draw.json").read_text())
    for figures in result["figures"].values():
        assert set(figures) == {"uniform", "today_pc", "today_c", "today_grouped", "nested", "today_pc_unshared"}
        assert all(len(v) == 2 and all(x is None or 0 < x <= 1.0001 for x in v) for v in figures.values())
    assert (
        "| advantage | nested |" in (tmp_path / "draw.md").read_text()
        and "1: orthogonal rows" in (tmp_path / "draw.md").read_text()
    )

    batch = spd.batches(json.loads(record.read_text()), spd.prompt_lengths(0, Chars()))[0]
    g = spd.proxy(batch, "loss_aware")
    pi = spd.nested_pi(batch, g, 2e-3)
    assert ((pi > 0) & (pi <= 1)).all()
    # the grouped draw's scores are this water-filling's π without the multiplier λ (where no π reaches the cap of 1),
    # and its nested systematic draw keeps m rows, each with probability π_i
    small = spd.nested_pi(batch, g, 100.0)
    assert small.max() < 1 and torch.allclose(spd.grouped_scores(batch, g) / math.sqrt(100.0), small, rtol=1e-9)
    p, groups = spd.draw_distribution(batch, g, "grouped")
    m, draws, gen = max(1, len(g) // 2), 4000, torch.Generator().manual_seed(1)
    counts = torch.zeros(len(g), dtype=torch.float64)
    for _ in range(draws):
        kept = spd.nested_draw(p, m, gen, groups)
        assert len(set(kept.tolist())) == m
        counts[kept] += 1
    marginal = spd.inclusion_probabilities(p, m)
    assert ((counts / draws - marginal).abs() <= 4.5 * (marginal * (1 - marginal) / draws).sqrt() + 1e-9).all()
    u = torch.rand(20000, int(batch["group"].max()) + 1, generator=torch.Generator().manual_seed(0))
    keep = u[:, batch["group"].long()] < pi
    assert float(spd.shared_cost(batch, keep).mean()) == pytest.approx(spd.nested_point(batch, g, 2e-3)[0], rel=0.02)


@pytest.mark.multiprocess
def test_batch_shapes_smoke(tmp_path, warm_model_path):
    import batch_shapes

    out = tmp_path / "batch_shapes_smoke"
    assert batch_shapes.main(["--smoke", "--out", str(out)]) == 0
    assert _files(tmp_path) == {"batch_shapes_smoke.json", "batch_shapes_smoke.md"}
    rows = json.loads((tmp_path / "batch_shapes_smoke.json").read_text())["single"]["rows"]
    assert {r["arm"] for r in rows} == set(batch_shapes.ARMS)


def test_regime_matrix_reads_the_zero_variance_share_it_logs(tmp_path):
    """The multi-epoch cell's property: GRPO's runs log the zero-variance token share (the trainer no longer does),
    and the reader finds it."""
    import regime_matrix as rm

    adv = torch.tensor([0.0, 0.0, 1.0, -1.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    assert rm.zero_variance_token_share(adv, mask, 2) == pytest.approx(4 / 10)
    (tmp_path / "cost_aware_metrics.jsonl").write_text(json.dumps({"step": 1, rm.ZERO_SHARE_KEY: 0.25}) + "\n")
    assert rm.zero_variance_shares(str(tmp_path)) == [0.25]


# ---------------------------------------------------------------------------------------------- documented commands
DOCS = ("RESULTS.md", "README.md", "benchmarks/README.md")
COMMIT = re.compile(r"\b[0-9a-f]{7,40}\b")


def _paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def _make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z0-9_.-]+):", (ROOT / "Makefile").read_text(), re.M))


def _in_git(commit: str, path: str) -> bool | None:
    """Whether `path` exists at `commit` (None: no git history to ask)."""
    try:
        out = subprocess.run(["git", "cat-file", "-e", f"{commit}:{path}"], cwd=ROOT, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 and b"not a git repository" in out.stderr:
        return None
    return out.returncode == 0


@pytest.mark.parametrize("doc", DOCS)
def test_documented_make_targets_exist(doc):
    targets = _make_targets()
    text = (ROOT / doc).read_text()
    named = set(re.findall(r"`make ([a-z][\w-]*[a-z0-9])", text))
    named |= set(re.findall(r"^\s*make ([a-z][\w-]*[a-z0-9])", text, re.M))  # code blocks
    missing = sorted(named - targets)
    assert not missing, f"{doc} names make targets the Makefile lacks: {missing}"


def test_makefile_scripts_exist():
    text = (ROOT / "Makefile").read_text()
    scripts = set(re.findall(r"(benchmarks/[\w/]+\.py)", text))
    assert scripts and all((ROOT / s).exists() for s in scripts), [s for s in scripts if not (ROOT / s).exists()]


@pytest.mark.parametrize("doc", DOCS)
def test_documented_scripts_exist(doc):
    """A script path a document names exists, or its paragraph names the commit where it does (and git agrees)."""
    problems = []
    for para in _paragraphs((ROOT / doc).read_text()):
        for path in set(re.findall(r"(benchmarks/[\w/]+\.(?:py|sh))", para)):
            if (ROOT / path).exists():
                continue
            commits = COMMIT.findall(para)
            if not commits:
                problems.append(f"{path} (no such file, and no commit named beside it)")
            elif _in_git(commits[0], path) is False and not any(_in_git(c, path) for c in commits[1:]):
                problems.append(f"{path} (not at {', '.join(commits)} either)")
    assert not problems, f"{doc}: {problems}"


def _options(script: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return set(re.findall(r"(--[a-z][\w-]*)", out.stdout))


@pytest.mark.parametrize("doc", DOCS)
def test_documented_script_options_exist(doc):
    """`python benchmarks/X.py --option ...` in a document: each option is one X accepts today (commands given for an
    older commit, with the commit in their paragraph, are left out)."""
    options: dict[str, set[str]] = {}
    problems = []
    text = (ROOT / doc).read_text()
    for para in _paragraphs(text):
        if COMMIT.search(para):
            continue
        flat = " ".join(para.split())
        for script, rest in re.findall(
            r"python (benchmarks/[\w/]+\.py)((?: --?[\w.=,/-]+(?: [^`\s-][^`\s]*)?)*)", flat
        ):
            if not (ROOT / script).exists():
                continue
            used = set(re.findall(r"(--[a-z][\w-]*)", rest))
            known = options.setdefault(script, _options(script) if used else set())
            problems += [f"{script} {o}" for o in sorted(used - known)]
    assert not problems, f"{doc} shows options the scripts do not accept: {problems}"


def test_make_dry_run_of_every_benchmark_target():
    """`make -n` of every bench target expands (no missing variable or prerequisite of its own)."""
    targets = sorted(t for t in _make_targets() if t.startswith("bench"))
    out = subprocess.run(
        ["make", "-n", "-o", ".venv/.installed", *targets],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "MAKEFLAGS": ""},
    )
    assert out.returncode == 0, out.stderr
