"""TRL's vLLM paths (colocate and server) with cost-aware sampling on, on CPU.

vLLM itself needs a GPU, so its engine is replaced by a stand-in; everything between the trainer and the engine is
TRL's own code: `VLLMGeneration` (weight sync, prompt dedup, slicing, `extract_logprobs`) for both modes and, for the
server mode, `VLLMClient` talking to a fake HTTP server (its `/v1/completions` JSON, parsed by TRL's `parse_logprobs`).
Only the NCCL weight transfer of the server mode is replaced (it needs vLLM's communicator); the stand-in receives the
weights through it all the same. The stand-in engine samples with the HF model it holds (loaded from the same path,
updated by every weight sync) and returns processed log-probs, as vLLM does with `logprobs_mode="processed_logprobs"`.
"""

from __future__ import annotations

import types

import pytest
import torch
from test_distributed import free_port
from testing_utils import last_metric, length_reward, make_config, weights_of
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer
from trl.generation import vllm_client as client_module
from trl.generation import vllm_generation as generation_module

from trl_costaware import CostAwareGRPOTrainer
from trl_costaware.rows.vllm_ratio import (
    NO_TOKEN_STATS,
    VLLM_IS_MODES,
    combine_ratio_stats,
    vllm_importance_sampling_ratio,
    vllm_metrics,
)


class StandInEngine:
    """Samples completions with an HF copy of the policy; counts the weight syncs it receives.

    `logp_noise` > 0 adds Gaussian noise of that scale to the log-probs it reports (a sampler that differs from the
    trainer's model, as a real vLLM does), and `nan_every` = k > 0 reports every k-th token's log-prob as NaN (a token
    vLLM could not score): both exercise every branch of TRL's importance-sampling correction.
    """

    logp_noise: float = 0.0
    nan_every: int = 0

    def __init__(self, model_path: str):
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.eos = AutoTokenizer.from_pretrained(model_path).eos_token_id
        self.generator = torch.Generator().manual_seed(0)
        self.noise = torch.Generator().manual_seed(1)
        self.reported = 0
        self.synced = 0
        self.calls = 0

    def load_weights(self, named):
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, value in named:
                params[name].copy_(value)
                self.synced += 1

    @torch.no_grad()
    def sample(self, prompt_ids: list[int], n: int, max_tokens: int, temperature: float):
        """n completions of one prompt: (token ids, log-prob of each sampled token after temperature scaling)."""
        self.calls += 1
        out = []
        for _ in range(n):
            ids, tokens, logps = list(prompt_ids), [], []
            for _ in range(max_tokens):
                logits = self.model(torch.tensor([ids])).logits[0, -1].float() / temperature
                logp = torch.log_softmax(logits, -1)
                token = int(torch.multinomial(logp.exp(), 1, generator=self.generator))
                tokens.append(token)
                reported = float(logp[token]) + self.logp_noise * float(torch.randn((), generator=self.noise))
                self.reported += 1
                logps.append(float("nan") if self.nan_every and self.reported % self.nan_every == 0 else reported)
                ids.append(token)
                if token == self.eos:
                    break
            out.append((tokens, logps))
        return out


# ---------------------------------------------------------------- colocate: a stand-in for vllm.LLM
class StandInLLM:
    engine: StandInEngine | None = None

    def __init__(self, model, **kwargs):
        StandInLLM.engine = StandInEngine(model)
        runner = types.SimpleNamespace(model=types.SimpleNamespace(load_weights=StandInLLM.engine.load_weights))
        worker = types.SimpleNamespace(model_runner=runner)
        self.llm_engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(driver_worker=worker))
        self.kwargs = kwargs

    def generate(self, prompts, sampling_params, use_tqdm=False):
        outputs = []
        for prompt in prompts:
            ids = prompt["prompt_token_ids"]
            samples = self.engine.sample(
                ids, sampling_params.n, sampling_params.max_tokens, sampling_params.temperature
            )
            completions = [
                types.SimpleNamespace(
                    token_ids=tokens,
                    logprobs=[
                        {t: types.SimpleNamespace(logprob=lp, rank=1)} for t, lp in zip(tokens, lps, strict=True)
                    ],
                )
                for tokens, lps in samples
            ]
            outputs.append(types.SimpleNamespace(prompt_token_ids=ids, outputs=completions))
        return outputs

    def reset_prefix_cache(self):
        pass


class StandInSamplingParams:
    def __init__(self, n=1, max_tokens=16, temperature=1.0, **kwargs):
        self.n, self.max_tokens, self.temperature = n, max_tokens, temperature


# ---------------------------------------------------------------- server: a fake HTTP server for TRL's VLLMClient
class Response:
    def __init__(self, payload, status=200):
        self.status_code, self._payload, self.headers, self.text = status, payload, {}, str(payload)

    def json(self):
        return self._payload


class FakeServer:
    engine: StandInEngine | None = None
    model_path: str = ""

    @classmethod
    def route(cls, method: str, url: str, json=None, **kwargs) -> Response:
        path = "/" + url.split("/", 3)[3]
        if method == "GET" and path == "/health":
            return Response({})
        if method == "GET" and path == "/v1/models":
            return Response({"data": [{"id": "stand-in"}]})
        if method == "GET" and path == "/server_info":
            return Response({"vllm_config": {"model_config": {"logprobs_mode": "processed_logprobs"}}})
        if method == "POST" and path == "/reset_prefix_cache":
            return Response({})
        if method == "POST" and path == "/v1/completions":
            choices = []
            for ids in json["prompt"]:
                for tokens, lps in cls.engine.sample(ids, json["n"], json["max_tokens"], json["temperature"]):
                    content = [
                        {"token": f"token_id:{t}", "logprob": lp, "top_logprobs": []}
                        for t, lp in zip(tokens, lps, strict=True)
                    ]
                    choices.append({"prompt_token_ids": ids, "token_ids": tokens, "logprobs": {"content": content}})
            return Response({"choices": choices})
        return Response({"detail": "not found"}, status=404)


class FakeSession:
    def mount(self, *args):
        pass

    def get(self, url, **kwargs):
        return FakeServer.route("GET", url, **kwargs)

    def post(self, url, **kwargs):
        return FakeServer.route("POST", url, **kwargs)


fake_requests = types.SimpleNamespace(
    Session=FakeSession,
    get=lambda url, **kw: FakeServer.route("GET", url, **kw),
    exceptions=types.SimpleNamespace(RequestException=OSError),
)


@pytest.fixture
def stand_in_vllm(monkeypatch, tiny_model_path):
    """Both vLLM modes wired to the stand-in engine; returns a function giving the engine in use."""
    monkeypatch.setattr(generation_module, "is_vllm_available", lambda: True)
    monkeypatch.setattr(client_module, "is_vllm_available", lambda: True)
    # TRL's colocate mode picks MASTER_PORT from fixed candidates (29500 first) when it is unset: two xdist workers
    # can both see 29500 free and then collide (EADDRINUSE). A port the kernel hands out (bound to 0) for each test.
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setattr(generation_module, "LLM", StandInLLM, raising=False)
    monkeypatch.setattr(generation_module, "SamplingParams", StandInSamplingParams, raising=False)
    monkeypatch.setattr(client_module, "requests", fake_requests, raising=False)
    FakeServer.engine = StandInEngine(tiny_model_path)
    # The NCCL weight transfer needs vLLM's communicator: the stand-in receives the named tensors directly.
    monkeypatch.setattr(client_module.VLLMClient, "init_communicator", lambda self, device=0: None)
    monkeypatch.setattr(
        client_module.VLLMClient,
        "update_named_params",
        lambda self, metadata, params: FakeServer.engine.load_weights((n, p.detach().clone()) for n, p in params),
    )

    def engine(mode):
        return StandInLLM.engine if mode == "colocate" else FakeServer.engine

    return engine


@pytest.mark.parametrize("mode", ["colocate", "server"])
@pytest.mark.parametrize("correction", [True, False])
def test_vllm_paths_train_with_cost_aware_sampling(
    tmp_path, tiny_model_path, dataset, stand_in_vllm, monkeypatch, mode, correction
):
    """Both modes train with cost-aware sampling on; with TRL's importance-sampling correction the old-policy pass runs
    over the kept rows only (the ratio is formed per kept micro-batch by `vllm_ratio.py`), as does the reference pass;
    without it, no old-policy pass runs at all (steps aligned). Either way only the kept rows reach a forward pass:
    with the correction that saves n − m = 4 of 8 rows of no-grad policy forward per step (TRL alone runs all 8)."""
    args = make_config(
        tmp_path,
        use_vllm=True,
        vllm_mode=mode,
        vllm_importance_sampling_correction=correction,
        beta=0.05,
        max_steps=2,
        cost_aware_kept_fraction=0.5,
    )
    trainer = CostAwareGRPOTrainer(tiny_model_path, [length_reward], args=args, train_dataset=dataset)
    rows = []
    trainer.model.register_forward_pre_hook(
        lambda mod, a, kw: (
            rows.append((kw["input_ids"].shape[0], torch.is_grad_enabled())) if "labels" in kw else None
        ),
        with_kwargs=True,
    )
    before = weights_of(trainer.model)
    trainer.train()
    engine = stand_in_vllm(mode)
    assert engine.calls > 0 and engine.synced > 0  # generation went through the stand-in, weights were pushed
    assert not torch.equal(before, weights_of(trainer.model))
    m = 4  # of n = 8 generated rows
    no_grad = [r for r, grad in rows if not grad]  # policy-model passes without grad: old-policy log-probs
    # The reference model is a separate module (beta > 0, no PEFT): its passes are not in `rows`.
    assert no_grad == ([m, m] if correction else []), no_grad  # the old-policy pass for the vLLM ratio: kept rows
    assert [r for r, grad in rows if grad] == [m, m]
    assert last_metric(trainer, "cost_aware/batch_rows_kept") == m
    if correction:
        assert last_metric(trainer, "sampling/importance_sampling_ratio/mean") == pytest.approx(1.0, abs=0.05)


def test_vllm_correction_misaligned_steps_ratio_exact(tmp_path, tiny_model_path, dataset, stand_in_vllm):
    """Under the vLLM correction with misaligned steps, the old log-probs the clipped ratio uses are recomputed on the
    kept micro-batches (TRL's full-batch ones had other padding): equal to the policy pass's before the first
    update."""
    args = make_config(
        tmp_path,
        use_vllm=True,
        vllm_mode="colocate",
        steps_per_generation=4,
        gradient_accumulation_steps=2,
        max_steps=1,
    )
    trainer = CostAwareGRPOTrainer(tiny_model_path, [length_reward], args=args, train_dataset=dataset)
    pairs = []
    original_loss, original_logps = trainer._compute_loss, trainer._get_per_token_logps_and_entropies

    def loss(model, inputs):
        if not trainer._cost_aware.generation.micro_step(trainer._step % 4).noop:  # no-ops carry no kept row
            pairs.append({"old": inputs["old_per_token_logps"], "mask": inputs["completion_mask"].bool()})
        return original_loss(model, inputs)

    def logps(model, *a, **kw):
        out = original_logps(model, *a, **kw)
        if kw.get("compute_entropy") and pairs and "new" not in pairs[-1]:
            pairs[-1]["new"] = out[0].detach()
        return out

    trainer._compute_loss, trainer._get_per_token_logps_and_entropies = loss, logps
    trainer.train()
    real = sum(not step.noop for step in trainer._cost_aware.generation.micro_steps[:2])  # the one optimizer step's
    assert len(pairs) == real >= 1
    for pair in pairs:
        assert torch.equal(pair["old"][pair["mask"]], pair["new"][pair["mask"]])


# ---------------------------------------------------------------- drift guard for vllm_ratio.py
# Each generation runs under one (mode, clip_min, clip_max): every mode, with both bounds and with a missing one.
RATIO_SETTINGS = [(mode, 0.8, 1.25) for mode in VLLM_IS_MODES] + [
    ("token_mask", None, 1.25),
    ("sequence_truncate", None, 1.25),
    ("sequence_mask", 0.8, None),
]


def test_vllm_ratio_matches_trl_on_every_row_and_mode(tmp_path, tiny_model_path, dataset, stand_in_vllm, monkeypatch):
    """`vllm_importance_sampling_ratio` equals, exactly on CPU, the ratio TRL's own `GRPOTrainer` forms inline in
    `_generate_and_score_completions` (through its `VLLMGeneration` and the stand-in engine), on every row, for every
    mode and clip setting: on the full batch, on each row alone and on a subset of rows trimmed to their longest
    completion (what the cost-aware trainer sees in a kept micro-batch). The engine's log-probs are noisy and partly
    NaN, so clipping, masking and the NaN rule all act; a change in TRL's formula fails here."""
    monkeypatch.setattr(StandInEngine, "logp_noise", 0.15)
    monkeypatch.setattr(StandInEngine, "nan_every", 7)
    args = make_config(
        tmp_path, cls=GRPOConfig, use_vllm=True, vllm_mode="colocate", max_steps=len(RATIO_SETTINGS), beta=0.0
    )
    trainer = GRPOTrainer(tiny_model_path, [length_reward], args=args, train_dataset=dataset)
    settings, outputs = iter(RATIO_SETTINGS), []
    original = trainer._generate_and_score_completions

    def generate_and_score(inputs):
        setting = next(settings)
        trainer.vllm_importance_sampling_mode, trainer.vllm_importance_sampling_clip_min = setting[:2]
        trainer.vllm_importance_sampling_clip_max = setting[2]
        out = original(inputs)
        outputs.append((setting, {k: v.detach().clone() for k, v in out.items() if torch.is_tensor(v)}))
        return out

    trainer._generate_and_score_completions = generate_and_score
    trainer.train()
    assert [s for s, _ in outputs] == RATIO_SETTINGS
    for (mode, clip_min, clip_max), out in outputs:
        trl_ratio = out["importance_sampling_ratio"]
        old, sampling, mask = out["old_per_token_logps"], out["sampling_per_token_logps"], out["completion_mask"]
        assert "tool_mask" not in out  # no tools here: TRL's mask is the completion mask

        def ours(rows, width=None, old=old, sampling=sampling, mask=mask, mode=mode, lo=clip_min, hi=clip_max):
            width = width or mask.shape[1]
            return vllm_importance_sampling_ratio(
                old[rows, :width], sampling[rows, :width], mask[rows, :width], mode=mode, clip_min=lo, clip_max=hi
            )

        everything = torch.arange(mask.shape[0])
        assert torch.equal(ours(everything), trl_ratio), mode
        for i in everything.tolist():
            assert torch.equal(ours([i]), trl_ratio[[i]]), (mode, i)
        kept = everything[1::2]
        width = int(mask[kept].sum(1).max())
        kept_ratio = ours(kept, width)
        expected = trl_ratio[kept] if mode.startswith("sequence") else trl_ratio[kept, :width]
        assert torch.equal(kept_ratio, expected), mode
        # The noise makes every branch act: some ratios clipped (truncate) or zeroed (mask), NaN tokens at ratio 1.
        real = mask.bool() if mode.startswith("token") else torch.ones_like(trl_ratio, dtype=torch.bool)
        values = trl_ratio[real]
        if mode.endswith("mask"):
            assert (values == 0).any() and (values != 0).any(), mode
        else:
            bounds = [b for b in (clip_min, clip_max) if b is not None]
            assert any((values == torch.tensor(b)).any() for b in bounds) and (values != 1).any(), mode
        if mode.startswith("token"):
            assert (trl_ratio[mask.bool() & sampling.isnan()] == 1).all()
            assert (mask.bool() & sampling.isnan()).any()


def test_vllm_ratio_refuses_unknown_mode():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="token_truncate"):
        vllm_importance_sampling_ratio(x, x, x, mode="token", clip_min=None, clip_max=3.0)


def test_combine_ratio_stats_of_no_micro_batch_is_a_rank_without_a_token():
    """A rank's statistics from its micro-batches' (sums, extremes), and from none at all (a rank whose positions are
    all no-ops): the statistics of no token, which `vllm_metrics` counts as TRL counts a rank without a token (0).
    Before `combine_ratio_stats`, `_log_vllm_ratio` stacked an empty list there (tests/test_vllm_distributed.py)."""
    per_micro = torch.tensor([[1.0, 4.0, 0.5, 0.9, 4.2, 4.0, 1.2], [2.0, 2.0, 1.5, 0.7, 2.1, 2.0, 1.1]])
    combined = combine_ratio_stats(per_micro)
    assert combined.tolist() == pytest.approx([3.0, 6.0, 1.5, 0.7, 6.3, 6.0, 1.2])
    none = combine_ratio_stats(torch.empty((0, 7)))
    assert none.tolist() == list(NO_TOKEN_STATS) and none.dtype == torch.float32
    d_mean, d_max, r_min, r_mean, r_max = vllm_metrics(torch.stack([combined, none]))
    assert d_mean == pytest.approx(3.0 / 6.0 / 2) and d_max == pytest.approx(1.5)
    assert (r_min, r_max) == (0.0, pytest.approx(1.2)) and r_mean == pytest.approx(6.3 / 6.0 / 2)
    with pytest.raises(ValueError, match="7"):
        combine_ratio_stats(torch.zeros(7))


def _row_key(prompt_ids, prompt_mask, completion_ids, completion_mask):
    return (
        tuple(prompt_ids[prompt_mask.bool()].tolist()),
        tuple(completion_ids[completion_mask.bool()].tolist()),
    )


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_vllm_kept_rows_ratio_equals_trl_full_batch(
    tmp_path, tiny_model_path, dataset, stand_in_vllm, monkeypatch, mode
):
    """The ratio each kept row carries into the cost-aware loss is the one plain `GRPOTrainer` computes for that row on
    the full batch (same seed, same stand-in engine, so the same rollouts; rows matched by their tokens). Equal up to
    float noise: the old-policy log-probs come from a pass over other padding."""
    monkeypatch.setattr(StandInEngine, "logp_noise", 0.15)
    monkeypatch.setattr(StandInEngine, "nan_every", 7)
    common = dict(use_vllm=True, vllm_mode="colocate", vllm_importance_sampling_mode=mode, max_steps=1, beta=0.0)
    common.update(vllm_importance_sampling_clip_min=0.8, vllm_importance_sampling_clip_max=1.25)
    reference = {}
    plain = GRPOTrainer(
        tiny_model_path,
        [length_reward],
        args=make_config(tmp_path / "plain", cls=GRPOConfig, **common),
        train_dataset=dataset,
    )
    original = plain._generate_and_score_completions

    def generate_and_score(inputs):
        out = original(inputs)
        for i in range(out["completion_ids"].shape[0]):
            key = _row_key(
                out["prompt_ids"][i], out["prompt_mask"][i], out["completion_ids"][i], out["completion_mask"][i]
            )
            reference[key] = (out["importance_sampling_ratio"][i], out["completion_mask"][i].bool())
        return out

    plain._generate_and_score_completions = generate_and_score
    plain.train()

    kept = []
    trainer = CostAwareGRPOTrainer(
        tiny_model_path,
        [length_reward],
        args=make_config(tmp_path / "ca", cost_aware_kept_fraction=0.5, **common),
        train_dataset=dataset,
    )
    original_loss = trainer._compute_loss

    def loss(model, inputs):
        for i in range(inputs["completion_ids"].shape[0]):
            key = _row_key(
                inputs["prompt_ids"][i],
                inputs["prompt_mask"][i],
                inputs["completion_ids"][i],
                inputs["completion_mask"][i],
            )
            kept.append((key, inputs["importance_sampling_ratio"][i].detach().clone()))
        return original_loss(model, inputs)

    trainer._compute_loss = loss
    trainer.train()
    assert len(kept) == 4
    for key, ratio in kept:
        assert key in reference, "the two trainers generated different rollouts"
        expected, row_mask = reference[key]
        if mode.startswith("token"):
            width = ratio.shape[0]
            assert not row_mask[width:].any()
            expected, ratio = expected[:width][row_mask[:width]], ratio[row_mask[:width]]
        torch.testing.assert_close(ratio, expected, rtol=1e-5, atol=1e-6)
    assert any((ratio != 1).any() for _, ratio in kept)  # the noise reached the kept rows' ratio
