"""The embedded default: tiny model, character tokenizer, arithmetic task, rewards, warm-up, and a plain GRPO run."""

import statistics
import threading
import time
from pathlib import Path

import pytest
import torch

from trl_costaware import embedded
from trl_costaware.embedded.arithmetic import DEFAULT_MAX_TERMS, LEGACY_MAX_TERMS, make_problem, max_completion_tokens
from trl_costaware.embedded.warmup import WARMUP_RECIPES, warmup_dataset

# ---------------------------------------------------------------------------------------------------------------------
# Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def test_tokenizer_round_trips_task_strings_after_reload(tokenizer):
    ds = embedded.arithmetic_dataset(300, seed=3)
    for row in ds:
        for text in (row["prompt"], row["solution"], row["prompt"] + row["solution"]):
            ids = tokenizer(text, add_special_tokens=True)["input_ids"]
            assert len(ids) == len(text)  # one token per character, nothing added
            assert tokenizer.decode(ids) == text
    other = "Hello, world!\n\t{x: [1, 2]} ~`'\"\\"
    assert tokenizer.decode(tokenizer(other)["input_ids"]) == other


def test_tokenizer_matches_in_memory_build_and_special_tokens(tokenizer):
    built = embedded.build_tokenizer()
    assert tokenizer.get_vocab() == built.get_vocab()
    assert tokenizer.padding_side == "left"
    assert (tokenizer.pad_token, tokenizer.eos_token) == ("<pad>", "<eos>")
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    ids = tokenizer("3+4=7<eos>")["input_ids"]
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "3+4=7"
    assert tokenizer.decode(tokenizer("é")["input_ids"]) == "<unk>"


def test_tokenizer_left_pads(tokenizer):
    batch = tokenizer(["1=", "1+2+3="], padding=True, return_tensors="pt")
    assert batch["input_ids"][0, 0].item() == tokenizer.pad_token_id
    assert batch["attention_mask"][0].tolist() == [0, 0, 0, 0, 1, 1]


def test_chat_template(tokenizer):
    prompt = [{"role": "user", "content": "3+5+2="}]
    assert tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) == "3+5+2="
    full = prompt + [{"role": "assistant", "content": "8,10|10"}]
    assert tokenizer.apply_chat_template(full, tokenize=False) == "3+5+2=8,10|10<eos>"


# ---------------------------------------------------------------------------------------------------------------------
# Model and cache


def test_tiny_model_loads_like_a_hub_model(tiny_model_path, tokenizer):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert isinstance(model, LlamaForCausalLM)
    n_params = sum(p.numel() for p in model.parameters())
    assert 100_000 <= n_params <= 500_000, n_params
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.tie_word_embeddings
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id


def test_cache_reuse_and_seed(tmp_path):
    path = embedded.tiny_model_path(tmp_path)
    assert path.startswith(str(tmp_path))
    stamp = (tmp_path / path).joinpath("model.safetensors").stat().st_mtime_ns
    assert embedded.tiny_model_path(tmp_path) == path
    assert (tmp_path / path).joinpath("model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    other = embedded.tiny_model_path(tmp_path, seed=1)
    assert other != path
    # No temporary build directories left behind.
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_cache_removes_the_temporary_folders_of_a_killed_build(tmp_path):
    """A build killed before its rename leaves `.{name}.tmp-*` behind; the next build of that name removes it (and
    only its own name's)."""
    from trl_costaware.embedded._cache import cached_build

    for stale in (".model.tmp-abc123", ".model.tmp-def456", ".other.tmp-xyz"):
        (tmp_path / stale).mkdir()
        (tmp_path / stale / "model.safetensors").write_bytes(b"0" * 1024)

    def build(folder):
        Path(folder, "config.json").write_text("{}")

    path = cached_build(tmp_path, "model", build)
    assert Path(path, "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if ".tmp-" in p.name) == [".other.tmp-xyz"]


def test_cache_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_COSTAWARE_CACHE", str(tmp_path / "env_cache"))
    assert embedded.tiny_model_path().startswith(str(tmp_path / "env_cache"))


def test_model_is_deterministic_in_seed(tmp_path):
    def weights(root, seed):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(embedded.tiny_model_path(root, seed=seed)).state_dict()

    a, b, c = weights(tmp_path / "a", 0), weights(tmp_path / "b", 0), weights(tmp_path / "a", 1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_concurrent_builds_agree(tmp_path):
    paths, errors = [], []

    def build():
        try:
            paths.append(embedded.tiny_model_path(tmp_path / "shared", seed=2))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(paths)) == 1
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(paths[0])
    assert sorted(p.name for p in (tmp_path / "shared").iterdir() if not p.name.startswith(".")) == [
        "tiny-llama-v1-seed2"
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Task


def test_problem_format():
    assert make_problem([3, 5, 2]) == {"prompt": "3+5+2=", "answer": "10", "solution": "8,10|10", "num_terms": 3}
    assert make_problem([7]) == {"prompt": "7=", "answer": "7", "solution": "|7", "num_terms": 1}


def test_dataset_columns_determinism_and_correctness():
    ds = embedded.arithmetic_dataset(200, seed=5)
    assert set(ds.column_names) == {"prompt", "answer", "solution", "num_terms"}
    assert ds.to_list() == embedded.arithmetic_dataset(200, seed=5).to_list()
    assert ds.to_list() != embedded.arithmetic_dataset(200, seed=6).to_list()
    assert set(ds["num_terms"]) == set(range(1, DEFAULT_MAX_TERMS + 1))
    assert set(embedded.arithmetic_dataset(200, seed=5, max_terms=LEGACY_MAX_TERMS)["num_terms"]) == set(range(1, 7))
    for row in ds:
        terms = [int(t) for t in row["prompt"].rstrip("=").split("+")]
        assert len(terms) == row["num_terms"]
        assert row["answer"] == str(sum(terms))
        chain, final = row["solution"].split("|")
        sums = [int(s) for s in chain.split(",")] if chain else []
        assert sums == [sum(terms[: i + 1]) for i in range(1, len(terms))]
        assert final == row["answer"]
    conv = embedded.arithmetic_dataset(10, seed=5, conversational=True, min_terms=2, max_terms=3)
    plain = embedded.arithmetic_dataset(10, seed=5, min_terms=2, max_terms=3)
    assert conv["prompt"] == [[{"role": "user", "content": p}] for p in plain["prompt"]]
    assert set(conv["num_terms"]) <= {2, 3}
    with pytest.raises(ValueError):
        embedded.arithmetic_dataset(3, min_terms=4, max_terms=2)


def test_length_ratio_at_least_4x(tokenizer):
    ds = embedded.arithmetic_dataset(1000, seed=0)
    # prompt + correct response + EOS, in tokens
    lengths = [len(tokenizer(r["prompt"] + r["solution"] + tokenizer.eos_token)["input_ids"]) for r in ds]
    assert min(lengths) == 5 and max(lengths) == 20
    assert max(lengths) / min(lengths) >= 4


@pytest.mark.parametrize("max_terms", [1, 2, 4, 6])
def test_max_completion_tokens_bounds_every_correct_completion(tokenizer, max_terms):
    ds = embedded.arithmetic_dataset(2000, seed=1, min_terms=max_terms, max_terms=max_terms)
    longest = max(len(tokenizer(r["solution"] + tokenizer.eos_token)["input_ids"]) for r in ds)
    assert longest <= max_completion_tokens(max_terms) <= longest + 1


def test_warmup_dataset_repeats_the_answer_in_the_recipe_fraction():
    recipe = WARMUP_RECIPES["default"]
    ds = warmup_dataset(4000, seed=3, recipe=recipe)
    assert ds.column_names == ["prompt", "completion"]
    repeated = 0
    for row in ds:
        answer = str(sum(int(t) for t in row["prompt"].rstrip("=").split("+")))
        chain_and_answer = row["completion"].split("|")
        assert chain_and_answer[1] == answer
        if len(chain_and_answer) == 3:  # "8,10|10|10": the answer repeated, which the reward scores 0
            assert chain_and_answer[2] == answer
            assert embedded.arithmetic_reward([row["completion"]], [answer]) == [0.0]
            repeated += 1
    assert abs(repeated / len(ds) - recipe.repeat_fraction) < 0.03
    clean = warmup_dataset(500, seed=3, recipe=WARMUP_RECIPES["sums6"])
    assert all(c.count("|") == 1 for c in clean["completion"])
    assert warmup_dataset(500, seed=3, recipe=recipe).to_list() == warmup_dataset(500, seed=3, recipe=recipe).to_list()


def test_unknown_warmup_recipe_is_refused(tmp_path):
    with pytest.raises(ValueError, match="recipe must be one of"):
        embedded.warmed_up_model_path(tmp_path, recipe="nope")


# ---------------------------------------------------------------------------------------------------------------------
# Rewards


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("8,10|10", 1.0),
        ("|10", 1.0),  # the chain is not checked
        (" 8,10|10 ", 1.0),
        ("8,10|10<eos>", 1.0),
        ("8,10|10<eos>garbage", 1.0),
        ("8,10|11", 0.0),  # wrong
        ("8,10|1", 0.0),
        ("8,10|10|10", 0.0),  # did not stop
        ("8,10|10,3", 0.0),
        ("8,10,10", 0.0),  # no separator
        ("10", 0.0),
        ("", 0.0),
        ("|", 0.0),
    ],
)
def test_arithmetic_reward(completion, expected):
    assert embedded.arithmetic_reward([completion], answer=["10"]) == [expected]


def test_arithmetic_reward_conversational_and_kwargs():
    completions = [[{"role": "assistant", "content": "8,10|10"}], [{"role": "assistant", "content": "8|8"}]]
    out = embedded.arithmetic_reward(completions, answer=["10", "9"], prompts=["a", "b"], num_terms=[3, 2])
    assert out == [1.0, 0.0]
    assert embedded.arithmetic_reward(["|7"], answer=[7]) == [1.0]  # int answers are compared as strings


def test_format_reward():
    completions = ["8,10|10", "|7", "8,10|11", "8,10,10", "8,,10|10", "8,10|10x", "a|1", ""]
    assert embedded.arithmetic_format_reward(completions) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_extract_answer():
    assert embedded.extract_answer("8,10|10") == "10"
    assert embedded.extract_answer("8,10") is None
    assert embedded.extract_answer([{"role": "assistant", "content": "|3"}]) == "3"


# ---------------------------------------------------------------------------------------------------------------------
# Warm-up and GRPO (these train; a few seconds to a minute on 2 CPU cores)


@pytest.mark.slow
def test_random_model_scores_zero(tiny_model_path):
    assert embedded.evaluate_accuracy(tiny_model_path, n=64) == 0.0


@pytest.mark.slow
def test_warm_model_leaves_room_for_rl(warm_model_path):
    greedy = embedded.evaluate_accuracy(warm_model_path, n=256)
    sampled = embedded.evaluate_accuracy(warm_model_path, n=256, do_sample=True)
    print(f"warm-up accuracy: greedy {greedy:.3f}, sampled (T=1) {sampled:.3f}")
    # The arithmetic is learnt (greedy), sampling at T=1 and the repeated-answer habit leave room for RL.
    assert greedy >= 0.9
    assert 0.5 <= sampled <= 0.8
    assert greedy - sampled >= 0.2

    # 8 samples at temperature 1 for 32 prompts: most groups have reward variance (GRPO signal).
    ds = embedded.arithmetic_dataset(32, seed=999)
    completions = embedded.sample_completions(
        warm_model_path, list(ds["prompt"]), num_generations=8, do_sample=True, seed=1
    )
    rewards = embedded.arithmetic_reward(completions, [a for a in ds["answer"] for _ in range(8)])
    stds = [statistics.pstdev(rewards[i * 8 : (i + 1) * 8]) for i in range(32)]
    print(f"group reward std: mean {statistics.mean(stds):.3f}, groups with variance {sum(s > 0 for s in stds)}/32")
    assert sum(s > 0 for s in stds) >= 12
    # Longer problems are harder: accuracy falls with the number of terms.
    by_terms = {}
    for k, r in zip([k for k in ds["num_terms"] for _ in range(8)], rewards, strict=True):
        by_terms.setdefault(k, []).append(r)
    assert statistics.mean(by_terms[1]) > statistics.mean(by_terms[DEFAULT_MAX_TERMS])


@pytest.mark.slow
def test_warmed_up_model_path_is_cached(warm_model_path, embedded_cache):
    t = time.perf_counter()
    assert embedded.warmed_up_model_path(embedded_cache) == warm_model_path
    assert time.perf_counter() - t < 1.0


@pytest.mark.slow
@pytest.mark.parametrize("conversational", [False, True])
def test_plain_grpo_runs_on_warm_model(warm_model_path, tmp_path, conversational):
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=24,
        max_steps=3,
        logging_steps=1,
        bf16=False,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=warm_model_path,
        reward_funcs=embedded.arithmetic_reward,
        args=args,
        train_dataset=embedded.arithmetic_dataset(32, seed=1, conversational=conversational),
    )
    t = time.perf_counter()
    trainer.train()
    per_step = (time.perf_counter() - t) / 3
    print(f"plain GRPOTrainer on the warm model: {per_step:.2f} s/step (8 rollouts/step)")
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == 3
    assert all(0.0 <= h["reward"] <= 1.0 for h in logs)
    assert any(h["reward_std"] > 0 for h in logs)
    assert all(h["completions/mean_length"] <= 24 for h in logs)


# ---------------------------------------------------------------------------------------------------------------------
# The long testbed's task (counting through a cyclic alphabet)


def test_count_problem_format_and_wrap_around():
    from trl_costaware.embedded.counting import counting_completion_tokens, make_count_problem

    assert make_count_problem("c", 3) == {"prompt": "c-f=", "answer": "c,d,e,f", "solution": "c,d,e,f", "span": 3}
    assert make_count_problem("x", 0)["solution"] == "x"
    assert make_count_problem("Y", 3)["solution"] == "Y,Z,a,b"  # cyclic: after Z comes a
    assert make_count_problem("z", 1)["solution"] == "z,A"
    assert counting_completion_tokens(3) == len("c,d,e,f") + 1  # + EOS
    with pytest.raises(ValueError, match="start"):
        make_count_problem("7", 1)
    with pytest.raises(ValueError, match="span"):
        make_count_problem("a", 52)


def test_counting_dataset_lengths_and_determinism(tokenizer):
    from trl_costaware.embedded.counting import DEFAULT_MAX_SPAN, LONG_MAX_COMPLETION_LENGTH, counting_dataset

    ds = counting_dataset(2000, seed=4)
    assert ds.to_list() == counting_dataset(2000, seed=4).to_list()
    assert ds.to_list() != counting_dataset(2000, seed=5).to_list()
    assert set(ds["span"]) == set(range(DEFAULT_MAX_SPAN + 1))
    completion = [len(tokenizer(s + tokenizer.eos_token)["input_ids"]) for s in ds["solution"]]
    prompt = [len(tokenizer(p)["input_ids"]) for p in ds["prompt"]]
    assert set(prompt) == {4}
    assert min(completion) == 2 and max(completion) == 2 * (DEFAULT_MAX_SPAN + 1) < LONG_MAX_COMPLETION_LENGTH
    assert statistics.mean(prompt) / statistics.mean(p + c for p, c in zip(prompt, completion, strict=True)) < 0.1
    for row in ds.select(range(200)):
        letters = row["solution"].split(",")
        assert row["prompt"] == f"{letters[0]}-{letters[-1]}=" and len(letters) == row["span"] + 1


@pytest.mark.parametrize(
    ("completion", "expected"),
    [("c,d,e,f", 1.0), (" c,d,e,f ", 1.0), ("c,d,e,f<eos>", 1.0), ("c,d,e,f,g", 0.0), ("c,d,f", 0.0), ("", 0.0)],
)
def test_counting_reward(completion, expected):
    from trl_costaware.embedded.counting import counting_reward

    assert counting_reward([completion], ["c,d,e,f"]) == [expected]
    assert counting_reward([[{"role": "assistant", "content": completion}]], ["c,d,e,f"]) == [expected]


def test_run_on_completion_is_longer_than_the_cap_and_wrong(tokenizer):
    from trl_costaware.embedded.counting import LONG_MAX_COMPLETION_LENGTH, counting_reward, run_on_completion

    for sol in ("x", "c,d,e,f", ",".join("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMN")):
        run_on = run_on_completion(sol)
        assert run_on.startswith(sol + ",")
        assert len(tokenizer(run_on)["input_ids"]) > LONG_MAX_COMPLETION_LENGTH  # truncated at the cap when sampled
        assert counting_reward([run_on], [sol]) == [0.0]
    assert run_on_completion("Z,a").split(",")[2] == "b"


def test_long_warmup_dataset_runs_on_in_the_recipe_fraction():
    from trl_costaware.embedded.counting import counting_dataset

    recipe = WARMUP_RECIPES["long"]
    assert recipe.task == "counting"
    ds = warmup_dataset(4000, seed=3, recipe=recipe)
    solutions = counting_dataset(4000, seed=3)["solution"]
    run_on = [c != s for c, s in zip(ds["completion"], solutions, strict=True)]
    assert all(c.startswith(s) for c, s in zip(ds["completion"], solutions, strict=True))
    assert abs(statistics.mean(run_on) - recipe.run_on_fraction) < 0.03


def test_testbed_registry_and_recipes_construct():
    from trl_costaware import CostAwareGRPOConfig
    from trl_costaware.embedded.testbed import LONG_RECIPE, TESTBEDS, get_testbed

    assert set(TESTBEDS) == {"default", "long"}
    with pytest.raises(ValueError, match="testbed must be one of"):
        get_testbed("short")
    long = get_testbed("long")
    assert long.task.name == "counting" and long.reward.__name__ == "counting_reward"
    assert get_testbed("default").task.name == "arithmetic"
    rows = LONG_RECIPE["per_device_train_batch_size"] * LONG_RECIPE["steps_per_generation"]
    assert rows == 128 and rows % LONG_RECIPE["num_generations"] == 0
    for name, bed in TESTBEDS.items():
        config = CostAwareGRPOConfig(output_dir=f"/tmp/unused-{name}", cost_aware=True, **bed.recipe)
        assert config.max_completion_length == bed.task.max_new_tokens


def test_diagnose_report_flags_each_property():
    from trl_costaware.embedded.diagnose import group_advantages, report, run_properties

    adv = group_advantages([1, 0, 0, 0, 1, 1, 1, 1], 4)
    assert adv[:4].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-3) and adv[4:].abs().max() == 0
    stats = {
        "testbed": "long", "rollouts": 8, "batches": 1, "model": "m", "length_p10": 4, "length_median": 20,
        "length_p90": 40, "length_spread": 10.0, "cap": 96, "truncated": 0.5, "reward_mean": 0.5,
        "mean_length_right": 10.0, "mean_length_wrong": 30.0, "wrong_over_right": 3.0, "prompt_share": 0.1,
        "mean_rollout_cost": 30.0, "j_ideal_mean": 0.8, "j_method_mean": 0.85, "informative_rows_mean": 0.5,
    }  # fmt: skip
    runs = run_properties(
        {
            "grpo_improvement": {"mean": 0.2, "ci95": [0.12, 0.25]},
            "arms": {
                "uniform_0.25": {"ratio_vs_grpo": {"step": {"ci": [1.1, 1.0, 1.2]}}},
                "grpo": {"train_wall_s": 100},
            },
        }
    )
    text = report(stats, runs)
    assert "| rollouts truncated at the cap | 50.0% | 10-30% | NO |" in text
    assert "| p90/p10 of completion lengths | 10 | >= 6 | yes |" in text
    assert "| uniform 0.25 steps to target / GRPO | 1.1 | >= 1.2 | NO |" in text
    assert "| GRPO held-out gain (mean over seeds) | 0.2 | >= +0.15 | yes |" in text
    assert "not measured" in report(stats)
