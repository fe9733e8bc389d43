"""Distributed training on CPU: the shipped accelerate configs, DDP / ZeRO-2 / ZeRO-3 (each also with LoRA), two nodes,
and a rank whose rows carry no signal.

Every launch runs two CPU processes over gloo on the embedded tiny model (built once per session in a temp dir) with
`tests/dist_workers/train_worker.py`: 2 optimizer steps x 2 micro-steps, cost-aware sampling on (kept fraction 0.5,
recentred weights). The worker saves each rank's full state dict and its sampler record; the tests check:

- both ranks end with identical weights (every backend);
- every backend ends with the same weights as DDP (within float tolerance; weights move ~2e-3 from the start);
- the sampler drew the same rows with the same globally normalised weights under every backend;
- a rank with all-zero advantages neither hangs nor desynchronises, and the metrics say so;
- a rank (or every rank) without a loss token trains on for every loss type, β = 0 and β > 0 (one launch of
  `tests/dist_workers/empty_batch_worker.py` covering every case).

Markers: `multiprocess` (launches processes), `deepspeed` (ZeRO), `slow` (ZeRO-3 offload, which compiles DeepSpeed's
CPU Adam on first use, and the example script under each config). See DEVELOPERS.md.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import pytest
import torch
from testing_utils import LOSS_TYPES

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "accelerate_configs"
WORKER = ROOT / "tests" / "dist_workers" / "train_worker.py"
EXAMPLE = ROOT / "examples" / "train_cost_aware_grpo.py"

LAUNCH_TIMEOUT = 300  # seconds per launch; a hang shows up as a timeout, not a stuck test session
ATOL = 2e-5  # observed max |Δ| vs DDP: 3e-7 (ZeRO-2), 3.5e-6 (ZeRO-3); weights move ~2e-3 in the two steps
MIN_MOVE = 1e-3  # the comparison only means something if training moved the weights by much more than ATOL

ALL_CONFIGS = ["single_gpu", "multi_gpu", "zero2", "zero3", "zero3_offload", "multi_node"]
DEEPSPEED_CONFIGS = ["zero2", "zero3", "zero3_offload"]
EXPECTED = {  # distributed_type, zero stage (None: not DeepSpeed), num_machines
    "single_gpu": ("NO", None, 1),
    "multi_gpu": ("MULTI_GPU", None, 1),
    "zero2": ("DEEPSPEED", 2, 1),
    "zero3": ("DEEPSPEED", 3, 1),
    "zero3_offload": ("DEEPSPEED", 3, 1),
    "multi_node": ("MULTI_GPU", None, 2),
}


# DeepSpeed is an optional extra: its tests carry the `deepspeed` marker and skip when it is not installed.
DEEPSPEED = [
    pytest.mark.deepspeed,
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None, reason="needs DeepSpeed (pip install .[deepspeed])"
    ),
]

# Under `pytest -n N --dist loadgroup` (make test) keep the tests that share a reference run in one worker. (With
# pytest 9 + xdist 3.8 the grouping is silently ignored; `run_once` makes the sharing hold across workers anyway.)
BACKENDS_GROUP = pytest.mark.xdist_group("distributed_backends")
EXAMPLE_GROUP = pytest.mark.xdist_group("distributed_example")


# ---------------------------------------------------------------------------------------------------- helpers
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    # ACCELERATE_USE_CPU=true would make accelerate drop the DeepSpeed plugin (MULTI_CPU): the worker sets
    # use_cpu=True on its training arguments instead, which keeps DeepSpeed and runs it over gloo.
    env.pop("ACCELERATE_USE_CPU", None)
    return env


def accelerate_cmd(config: str, *extra: str) -> list[str]:
    """`accelerate launch` with a shipped config, overridden to 2 CPU processes in float32."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(CONFIGS / f"{config}.yaml"),
        "--num_processes",
        "2",
        "--mixed_precision",
        "no",
        *extra,
    ]


def run(cmd: list[str], log: Path, timeout: int = LAUNCH_TIMEOUT) -> float:
    start = time.monotonic()
    with open(log, "w") as fh:
        try:
            proc = subprocess.run(
                cmd, check=False, env=child_env(), cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"launch hung (> {timeout} s): {' '.join(cmd)}\n{tail(log)}")
    if proc.returncode != 0:
        pytest.fail(f"launch failed (rc={proc.returncode}): {' '.join(cmd)}\n{tail(log)}")
    return time.monotonic() - start


def tail(path: Path, n: int = 60) -> str:
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(line for line in lines[-n:] if "warn" not in line.lower())


def load_result(out: Path) -> dict:
    """Both ranks' state dicts and records; asserts the ranks ended with identical weights."""
    states = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in records] == [2, 2]
    assert states[0].keys() == states[1].keys()
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), f"ranks disagree on {k}"
    return {"state": states[0], "records": records}


def deepspeed_json(folder: Path, stage: int) -> str:
    """A DeepSpeed ZeRO config for `CostAwareGRPOConfig(deepspeed=...)`, every size left to the trainer ("auto")."""
    ds = {
        "zero_optimization": {"stage": stage},
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
    }
    path = folder / f"zero{stage}.json"
    path.write_text(json.dumps(ds))
    return str(path)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), set(a) ^ set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def cost_aware_logs(record: dict) -> list[dict]:
    return [{k: v for k, v in h.items() if k.startswith("cost_aware/")} for h in record["log_history"] if "loss" in h]


# ---------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def tiny_model(tiny_model_path) -> str:
    """The random tiny model, built once per session by the parent (conftest); workers get its path."""
    return tiny_model_path


@pytest.fixture(scope="session")
def initial_state(tiny_model) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def session_shared_dir(tmp_path_factory, name: str) -> Path:
    """A directory shared by every xdist worker of this session (never kept across sessions)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's basetemp is <session>/popen-gwN
        base = base.parent
    path = base / name
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def file_lock(path: Path):
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def run_once(root: Path, name: str, cmd: list[str], timeout: int = LAUNCH_TIMEOUT) -> Path:
    """Run `cmd` (which writes into root/name) unless a worker of this session already did; return root/name.

    Shared reference runs (DDP, the example under DDP) then run once per session even when pytest-xdist spreads the
    tests that use them over several workers (`xdist_group` alone does not guarantee it)."""
    out, done = root / name, root / f"{name}.done"
    with file_lock(root / f"{name}.lock"):
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            seconds = run(cmd, root / f"{name}.log", timeout=timeout)
            print(f"[{name}] {seconds:.1f} s")
            done.touch()
    return out


@pytest.fixture(scope="session")
def launch(tiny_model, tmp_path_factory):
    """launch(config, lora, *worker_flags) -> result; each runs once per session (DDP is shared by the comparisons)."""
    root = session_shared_dir(tmp_path_factory, "distributed_runs")

    @cache
    def _launch(config: str, lora: bool, *extra: str) -> dict:
        name = f"{config}{'-lora' if lora else ''}{''.join(extra)}"
        args = ["--model", tiny_model, "--out", str(root / name)] + (["--lora"] if lora else []) + list(extra)
        cmd = accelerate_cmd(config, "--main_process_port", str(free_port()), str(WORKER), *args)
        return load_result(run_once(root, name, cmd))

    return _launch


# ---------------------------------------------------------------------------------------------------- configs
def test_every_config_is_shipped():
    shipped = sorted(p.stem for p in CONFIGS.glob("*.yaml"))
    assert shipped == sorted(ALL_CONFIGS)


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_config_loads_with_accelerate(name):
    """accelerate's own loader (unknown keys raise) and the argument validation `accelerate launch` runs."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    path = CONFIGS / f"{name}.yaml"
    cfg = load_config_from_file(str(path))
    dist_type, stage, machines = EXPECTED[name]
    assert str(cfg.distributed_type).split(".")[-1] == dist_type
    assert cfg.num_machines == machines
    assert cfg.use_cpu is False
    if stage is not None:
        assert int(cfg.deepspeed_config["zero_stage"]) == stage
        # one command for every node, torchrun per node (no pdsh/hostfile needed)
        assert cfg.deepspeed_config["deepspeed_multinode_launcher"] == "standard"
    if machines > 1:
        assert cfg.rdzv_backend == "static" and cfg.main_process_ip and cfg.main_process_port
        assert cfg.num_processes % machines == 0

    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, _, _ = _validate_launch_command(args)
    assert args.num_processes == cfg.num_processes
    assert bool(args.use_deepspeed) == (stage is not None)
    assert bool(args.multi_gpu) == (dist_type == "MULTI_GPU")


def _deepspeed_config_as_launched(name, monkeypatch) -> dict:
    """The DeepSpeed config that a process started by `accelerate launch --config_file <name>.yaml` builds."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args = launch_command_parser().parse_args(["--config_file", str(CONFIGS / f"{name}.yaml"), "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    args.deepspeed_fields_from_accelerate_config = ",".join(list(defaults.deepspeed_config.keys()))
    args.main_process_port = free_port()
    _, env = prepare_deepspeed_cmd_env(args)
    for key, value in env.items():
        if key.startswith("ACCELERATE_"):
            monkeypatch.setenv(key, value)
    plugin = DeepSpeedPlugin()
    plugin.set_mixed_precision(env["ACCELERATE_MIXED_PRECISION"])
    return plugin.deepspeed_config


@pytest.mark.parametrize("name", [pytest.param(n, marks=DEEPSPEED) for n in DEEPSPEED_CONFIGS])
def test_deepspeed_config_passes_deepspeed_checks(name, tiny_model, monkeypatch, tmp_path):
    """Resolve the "auto" values the way the Trainer does, then run DeepSpeed's own config parser and checks."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import (
        HfTrainerDeepSpeedConfig,
        is_deepspeed_zero3_enabled,
        unset_hf_deepspeed_config,
    )

    from trl_costaware import CostAwareGRPOConfig

    ds_config = _deepspeed_config_as_launched(name, monkeypatch)
    stage = EXPECTED[name][1]
    assert ds_config["zero_optimization"]["stage"] == stage
    expected_device = "cpu" if name.endswith("offload") else "none"
    for part in ("offload_param", "offload_optimizer"):
        assert ds_config["zero_optimization"][part]["device"] == expected_device
    assert ds_config["bf16"]["enabled"] is True  # the yaml's mixed_precision: bf16 reaches DeepSpeed

    for key in [k for k in os.environ if k.startswith("ACCELERATE_")]:
        monkeypatch.delenv(key)  # build the training arguments as a plain single process
    args = CostAwareGRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        bf16=True,
        use_cpu=True,
        report_to="none",
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model)  # before the ZeRO-3 config exists (else zero.Init)
    hf_ds = HfTrainerDeepSpeedConfig(ds_config)  # registers itself globally: unset below for the other tests
    try:
        hf_ds.trainer_config_process(args)
        hf_ds.trainer_config_finalize(args, model, num_training_steps=10)
    finally:
        unset_hf_deepspeed_config()
    assert not is_deepspeed_zero3_enabled()  # nothing left behind for the tests that follow in this process
    resolved = json.dumps(hf_ds.config)
    assert '"auto"' not in resolved, resolved
    checked = DeepSpeedConfig(hf_ds.config)  # raises DeepSpeedConfigError / pydantic errors on a bad config
    assert checked.zero_optimization_stage == stage
    assert checked.train_batch_size == 4 * 2 * checked.world_size
    assert checked.gradient_accumulation_steps == 2
    assert checked.bfloat16_config.enabled
    assert checked.zero_config.offload_param is None or checked.zero_config.offload_param.device == expected_device


# ---------------------------------------------------------------------------------------------------- backends
def _check_against_ddp(result, ddp, initial_state, lora: bool):
    state, ref = result["state"], ddp["state"]
    diff = max_diff(state, ref)
    print(f"max |w - w_ddp| = {diff:.3g}")
    assert diff <= ATOL, f"weights differ from DDP by {diff:.3g} > {ATOL}"
    if lora:
        adapters = [k for k in ref if "lora_" in k]
        assert adapters, "no LoRA parameters in the state dict"
        assert max(ref[k].abs().max().item() for k in ref if "lora_B" in k) >= MIN_MOVE  # B starts at 0
        for k in ref:
            if "lora_" not in k:  # base weights frozen
                base = k.replace("base_model.model.", "").replace(".base_layer", "")
                assert torch.equal(state[k], initial_state[base]), k
    else:
        assert max_diff(ref, initial_state) >= MIN_MOVE
    # The sampler made the same draws with the same globally normalised weights under both backends.
    for rec, rec_ref in zip(result["records"], ddp["records"], strict=True):
        assert rec["kept"] == rec_ref["kept"]
        for w, w_ref in zip(rec["global_weights"], rec_ref["global_weights"], strict=True):
            assert w == pytest.approx(w_ref, rel=1e-6)


def _check_global_weights(records):
    """Every rank saw the same globally normalised weight vector and applied its own slice of it."""
    r0, r1 = records
    assert r0["global_weights"] == r1["global_weights"]
    assert r0["kept"] == r1["kept"]  # equal rows per rank
    for step, weights in enumerate(r0["global_weights"]):
        m = r0["kept"][step]
        filler = r0["global_filler"][step]
        assert len(weights) == 2 * m
        real = [w for w, f in zip(weights, filler, strict=True) if not f]
        # recentred over ALL ranks' non-filler rows at the design's mean weight (1: every row can be drawn here)
        assert sum(real) / len(real) == pytest.approx(1.0)
        ratios = []
        for rank, rec in enumerate(records):
            own = list(
                zip(
                    rec["factors"][step],
                    weights[rank * m : (rank + 1) * m],
                    filler[rank * m : (rank + 1) * m],
                    strict=True,
                )
            )
            ratios += [f / w for f, w, is_filler in own if not is_filler]
            assert all(f == 0 for f, _, is_filler in own if is_filler)
        # one loss-type factor (N/m for token-sum losses, 1 otherwise) shared by every row of every rank
        assert ratios == pytest.approx([ratios[0]] * len(ratios))


@BACKENDS_GROUP
@pytest.mark.multiprocess
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_ddp(launch, lora):
    result = launch("multi_gpu", lora)
    assert [r["distributed_type"] for r in result["records"]] == ["DistributedType.MULTI_CPU"] * 2
    _check_global_weights(result["records"])
    logs = cost_aware_logs(result["records"][0])
    assert len(logs) == 2 and all(h["cost_aware/kept_row_fraction"] == 0.5 for h in logs)
    assert logs == cost_aware_logs(result["records"][1])


@BACKENDS_GROUP
@pytest.mark.multiprocess
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("config", [pytest.param(c, marks=DEEPSPEED) for c in ("zero2", "zero3")])
def test_zero_matches_ddp(launch, initial_state, config, lora):
    ddp = launch("multi_gpu", lora)
    result = launch(config, lora)
    assert [r["zero_stage"] for r in result["records"]] == [EXPECTED[config][1]] * 2
    _check_global_weights(result["records"])
    _check_against_ddp(result, ddp, initial_state, lora)


@BACKENDS_GROUP
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "config, lora, plain",
    [
        ("multi_gpu", False, True),
        ("multi_gpu", True, False),
        pytest.param("zero3", False, False, marks=DEEPSPEED),
    ],
    ids=["ddp-grpo", "ddp-lora", "zero3"],
)
def test_shared_prompt_matches_unshared(launch, initial_state, config, lora, plain):
    """shared_prompt_forward=True trains, over two processes, to the weights of the unshared run (DDP), with the same
    draws: plain GRPO and LoRA under DDP, ZeRO-3."""
    flags = ("--plain",) if plain else ()
    reference = launch("multi_gpu", lora, *flags)
    result = launch(config, lora, "--shared-prompt", *flags)
    diff = max_diff(result["state"], reference["state"])
    assert diff <= ATOL, f"weights differ from the unshared DDP run by {diff:.3g} > {ATOL}"
    ref = reference["state"]
    moved = max(ref[k].abs().max().item() for k in ref if "lora_B" in k) if lora else max_diff(ref, initial_state)
    assert moved >= MIN_MOVE  # LoRA's B starts at 0
    for rec, rec_ref in zip(result["records"], reference["records"], strict=True):
        assert rec["kept"] == rec_ref["kept"]
        ratios = [h["cost_aware/shared_prompt_token_ratio"] for h in rec["log_history"] if "loss" in h]
        assert ratios and min(ratios) < 1, ratios


@BACKENDS_GROUP
@pytest.mark.multiprocess
@pytest.mark.deepspeed
@pytest.mark.slow
@pytest.mark.offload
@DEEPSPEED[1]
def test_zero3_offload_matches_ddp(launch, initial_state):
    """Compiles DeepSpeed's CPU Adam on first use (~4 min on 2 busy cores; cached under ~/.cache/torch_extensions)."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("ZeRO offload needs a C++ compiler to build DeepSpeed's CPU Adam")
    ddp = launch("multi_gpu", False)
    result = launch("zero3_offload", False)
    assert [r["zero_stage"] for r in result["records"]] == [3, 3]
    _check_against_ddp(result, ddp, initial_state, lora=False)


@BACKENDS_GROUP
@pytest.mark.multiprocess
def test_two_nodes_static_rendezvous(launch, tiny_model, tmp_path):
    """multi_node.yaml on localhost: two `accelerate launch` commands (machine_rank 0 and 1), one process each."""
    ddp = launch("multi_gpu", False)
    port = free_port()
    procs = []
    for machine_rank in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(CONFIGS / "multi_node.yaml"),
            "--num_processes",
            "2",
            "--num_machines",
            "2",
            "--machine_rank",
            str(machine_rank),
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            str(port),
            "--mixed_precision",
            "no",
            str(WORKER),
            "--model",
            tiny_model,
            "--out",
            str(tmp_path / "out"),
        ]
        log = open(tmp_path / f"node{machine_rank}.log", "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(cmd, env=child_env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    try:
        for machine_rank, (proc, log) in enumerate(procs):
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            log.close()
            assert rc == 0, f"node {machine_rank} failed:\n{tail(tmp_path / f'node{machine_rank}.log')}"
    except subprocess.TimeoutExpired:
        pytest.fail("two-node launch hung")
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    result = load_result(tmp_path / "out")
    assert max_diff(result["state"], ddp["state"]) == 0.0  # same world size, same backend: bit-identical


# ---------------------------------------------------------------------------------------------------- zero-signal rank
@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["ddp", "ddp_budget", pytest.param("zero3", marks=DEEPSPEED)])
def test_rank_without_signal(tiny_model, tmp_path, backend):
    """Rank 1's rewards are constant (all its advantages are 0), rank 0's vary: no hang, identical weights, and the
    metrics report one zero-signal rank. Launched with torchrun; ZeRO-3 via `CostAwareGRPOConfig(deepspeed=...)`, and
    with a token budget instead of a fraction, under which the two ranks' own row counts differ (rank 0 favours cheap
    rows, rank 1 draws uniformly) and must be reconciled to the smallest.

    Setup: 4 rows per micro-batch x 2 micro-steps = 8 rows per rank per generation, num_generations=4, so every
    prompt group lies on one rank (TRL normalises rewards per group over the gathered batch) and rank 1's groups
    really have zero variance.
    """
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(WORKER),
        "--model",
        tiny_model,
        "--out",
        str(out),
        "--reward",
        "rank_dependent",
        "--weight-normalization",
        "recenter",
    ]
    if backend == "zero3":
        cmd += ["--deepspeed", deepspeed_json(tmp_path, 3)]
    if backend != "ddp":
        cmd += ["--token-budget", "60"]
    seconds = run(cmd, tmp_path / "log.txt")
    print(f"[rank_without_signal-{backend}] {seconds:.1f} s")
    result = load_result(out)  # identical weights on both ranks
    records = result["records"]
    if backend == "zero3":
        assert [r["zero_stage"] for r in records] == [3, 3]
    if backend != "ddp":
        from trl_costaware.rows.sampling import capped_kept_count, kept_row_count

        own_counts = list(zip(records[0]["budget_rows"], records[1]["budget_rows"], strict=True))
        assert any(a != b for a, b in own_counts), (
            f"the budget no longer gives the ranks different row counts {own_counts}: retune --token-budget so the "
            "test still covers the min-over-ranks path"
        )
        eligible = list(zip(records[0]["eligible_rows"], records[1]["eligible_rows"], strict=True))
        n = 8  # rows per rank per generation batch
        told_apart = 0
        for (b0, b1), (k0, k1), m0, m1, unit in zip(
            own_counts, eligible, records[0]["kept"], records[1]["kept"], records[0]["kept_multiple"], strict=True
        ):
            # The smallest budget count over ranks, then capped by the busiest rank's eligible rows: equal everywhere.
            expected = capped_kept_count(kept_row_count(n, min(b0, b1) / n, unit), max(k0, k1), unit)
            assert m0 == m1 == expected, (b0, b1, k0, k1, m0, m1)
            told_apart += expected != capped_kept_count(kept_row_count(n, max(b0, b1) / n, unit), max(k0, k1), unit)
        assert told_apart, "no generation batch where the largest count would differ: retune --token-budget"

    _check_global_weights(records)  # one global weight vector, each rank its slice
    r0, r1 = records
    # m per generation batch: under the token budget it follows each batch's costs (the expected kept cost fits)
    for m, weights, filler in zip(r0["kept"], r0["global_weights"], r0["global_filler"], strict=True):
        # rank 1 has no signal: every slot of it is a filler (weight 0, out of the normalisation); rank 0 drew by
        # |A|/sqrt(c): varied weights, whose mean is the global mean over the rows that carry gradient (all here)
        assert all(filler[m:]) and set(weights[m:]) == {0.0}
        assert len(set(weights[:m])) > 1
        assert sum(weights[:m]) / m == pytest.approx(1.0)

    logs0, logs1 = cost_aware_logs(r0), cost_aware_logs(r1)
    assert logs0 == logs1 and len(logs0) == 2  # both ranks ran (and logged) every step
    for h in logs0:
        assert h["cost_aware/zero_signal_ranks"] == 1.0
        assert 0.0 < h["cost_aware/informative_fraction"] <= 0.5  # rank 1's half of the rows carries nothing
        if backend == "ddp":
            assert h["cost_aware/kept_row_fraction"] == 0.5  # rank 1 still trained its zero-weight rows


# ---------------------------------------------------------------------------------------------------- empty batches
EMPTY_WORKER = ROOT / "tests" / "dist_workers" / "empty_batch_worker.py"
EMPTY_CASES = [f"{loss}:{beta}:rank1" for loss in LOSS_TYPES for beta in ("0.0", "0.04")] + [
    "grpo:0.04:all",
    "bnpo:0.0:all",
    "dapo:0.04:all",
]


@pytest.mark.multiprocess
def test_log_on_rank_zero_only_returns(tiny_model, tmp_path):
    """A user's callback that calls `trainer.log` on rank 0 only (as each step begins, logging every 2 steps, so the
    packed layout's metric window of step 1 is open at step 2) returns: the trainer's `log` runs no collective.
    Before the fix its gather of the window's weights met the other rank's next collective (a collective mismatch or
    a hang)."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(free_port()), str(WORKER), "--model", tiny_model, "--out", str(out), "--rank0-log"]
    run(cmd + ["--logging-steps", "2"], tmp_path / "log.txt", timeout=180)
    r0, r1 = load_result(out)["records"]
    assert r0["layout"] == "packed"
    assert [row["rank0_only"] for row in r0["log_history"] if "rank0_only" in row] == [0.0, 1.0]
    assert not any("rank0_only" in row for row in r1["log_history"])
    trained = [[row["cost_aware/policy_tokens"] for row in r["log_history"] if "loss" in row] for r in (r0, r1)]
    assert trained[0] == trained[1] and len(trained[0]) == 1 and trained[0][0] > 0


@pytest.mark.multiprocess
def test_empty_batches_train_on(tiny_model, tmp_path):
    """A rank with no loss token (rank1: rank 1's completions all truncated under `mask_truncated_completions`, rank
    0's all ended) and a whole step without one (all), every loss type, β = 0 and β > 0, in one launch: no hang, no
    error (bnpo divided by zero), identical weights on both ranks, the KL metric logged whenever β > 0 (β must never
    become 0 on one rank only: TRL's KL branch holds a collective), the step moved the weights when rank 0 had signal
    and left them in place (as GRPOTrainer does) when no rank had a loss token."""
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(EMPTY_WORKER),
        "--model",
        tiny_model,
        "--out",
        str(out),
        "--cases",
        ",".join(EMPTY_CASES),
    ]
    seconds = run(cmd, tmp_path / "log.txt")
    print(f"[empty_batches] {len(EMPTY_CASES)} cases, {seconds:.1f} s")
    r0, r1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    for case in EMPTY_CASES:
        loss_type, beta, empty = case.split(":")
        a, b = r0[case], r1[case]
        assert a["checksum"] == b["checksum"], f"{case}: the ranks' weights differ"
        assert b["loss_tokens"] == [0.0], case  # the case is the one meant
        assert (a["loss_tokens"][0] > 0) == (empty == "rank1"), case
        for rec in (a, b):
            row = next(h for h in rec["log_history"] if "loss" in h)
            assert math.isfinite(row["loss"]), case
            assert ("kl" in row) == (float(beta) > 0), case
            assert all(s is None or s > 0 for s in rec["kl_scale"]), case
        if empty == "all":
            assert a["moved"] == 0.0, case
            assert a["kl_scale"] == b["kl_scale"] == ([1.0] if loss_type in ("dapo", "cispo", "vespo") else [None])
        else:
            assert a["moved"] > 0, case


# ---------------------------------------------------------------------------------------------------- the example
EXAMPLE_ARGS = [
    "--max_steps",
    "2",
    "--per_device_train_batch_size",
    "4",
    "--gradient_accumulation_steps",
    "2",
    "--num_generations",
    "4",
    "--max_completion_length",
    "8",
    "--eval_strategy",
    "no",
    "--save_strategy",
    "no",
    "--logging_steps",
    "1",
    "--use_cpu",
    "true",
    "--bf16",
    "false",
    "--report_to",
    "none",
]


@pytest.fixture(scope="session")
def launch_example(tmp_path_factory, warm_model_path):
    """launch_example(config) -> saved model state dict; the example script, unchanged, for 2 steps. The recipe's
    default policy (`warm_model_path`) is built once by the parent into the session cache the children inherit."""
    if not EXAMPLE.exists():
        pytest.skip("examples/train_cost_aware_grpo.py not present")
    root = session_shared_dir(tmp_path_factory, "example_runs")
    recipe = ROOT / "examples" / "recipes" / "embedded_default.yaml"

    @cache
    def _launch(config: str) -> dict:
        from safetensors.torch import load_file

        cmd = accelerate_cmd(config, "--main_process_port", str(free_port()))
        if config == "single_gpu":
            cmd[cmd.index("--num_processes") + 1] = "1"
        cmd += [str(EXAMPLE), "--config", str(recipe), "--output_dir", str(root / config), *EXAMPLE_ARGS]
        out = run_once(root, config, cmd, timeout=2 * LAUNCH_TIMEOUT)
        assert "cost_aware/kept_row_fraction" in (root / f"{config}.log").read_text()
        return {k: v.float() for k, v in load_file(out / "model.safetensors").items()}

    return _launch


@EXAMPLE_GROUP
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(
    "config",
    [
        "single_gpu",
        "multi_gpu",
        pytest.param("zero2", marks=DEEPSPEED),
        pytest.param("zero3", marks=DEEPSPEED),
    ],
)
def test_example_script_under_config(launch_example, config):
    """examples/train_cost_aware_grpo.py, unchanged, 2 steps under each shipped config (2 CPU processes; single_gpu
    1). The ZeRO runs save the same model as the DDP run."""
    state = launch_example(config)
    if config in ("zero2", "zero3"):
        ddp = launch_example("multi_gpu")
        common = ddp.keys() & state.keys()  # ZeRO-2 also writes the tied lm_head.weight
        assert common == ddp.keys()
        assert max((state[k] - ddp[k]).abs().max().item() for k in common) <= ATOL
