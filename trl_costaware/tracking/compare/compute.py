r"""What a run costs as a user pays it: compute to a target from tokens and a phase split, and the break-even.

A GRPO step has three phases whose cost scales with different token counts:

- **generation + scoring**: every rollout of the generation batch, cost ∝ generated tokens ``G`` (identical for a
  cost-aware arm and GRPO at the same rollouts per step: the draw happens after scoring);
- **old / reference log-prob passes** (forward only; the old pass when TRL needs one, the reference pass when
  β > 0): ∝ the tokens of the rows they run on. `CostAwareGRPOTrainer` defers both to the kept rows, so they scale
  like the policy tokens ``P``;
- **policy update** (forward + backward on the micro-batches): ∝ ``P``.

A **split** ``(s_gen, s_pass, s_upd)``, summing to 1, is the share of each phase in the *baseline's* (GRPO's) step.
The device-free compute of a run is measured in baseline-step equivalents, with per-token weights calibrated so that
one baseline step costs exactly 1:

    w_gen = s_gen / Ḡ_base,   w_pol = (s_pass + s_upd) / P̄_base          (Ḡ, P̄: the baseline's tokens per step)
    compute(run) = w_gen · G_run + w_pol · P_run                          (cumulative tokens of the run)

so a run's compute to a target is ``w_gen · G_target + w_pol · P_target``. An arm that generates the baseline's
rollouts and keeps a fraction ``f = P̄_arm / P̄_base`` of the policy tokens has the relative step cost

    c(f) = s_gen + (s_pass + s_upd) · f

and costs more than the baseline to a target exactly when its steps to the target exceed the **break-even steps
ratio** ``1 / c(f)`` times the baseline's.

How generation scales with the batch. The weights above price generation per generated token, as if generation time
grew in proportion to the rows generated. On an accelerator it does not: decoding is memory-bound, so a step of the
decode loop costs about ``B^α`` for ``B`` rows until the device saturates. With ``α`` (`generation_alpha`), a run that
generates ``B`` rows per step against the baseline's ``B_base`` pays

    w_gen · G_run · (B / B_base)^(α − 1)

for its generation: time ∝ (mean generated tokens per row) · B^α. ``α = 1`` (compute-bound) is the per-token price
above; ``α = 0`` prices a step's generation as fixed, whatever its batch, at the same completion lengths;
`PUBLISHED_ALPHA` is `fitted_alpha` of PODS' published generation times (arXiv 2504.13818; docs/tracking.md). The
update and the old/reference passes stay priced per token (compute-bound for models of about 0.5B parameters and up).
``α`` matters only between runs that generate different rows per step.

From measured wall time instead (a run's update phase share ``u`` = (training step − generation and scoring) /
training step): with the same generation work per step, the arm's step costs ``(1 − u_base) / (1 − u_arm)`` of the
baseline's (`phase_step_cost`), free of the machine-speed differences between runs that absolute seconds carry.

Plain functions; `trl-costaware compare`, `make demo` and the benchmarks use them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Split:
    """Shares of a baseline step: generation + scoring, old/reference log-prob passes, policy update (sum 1)."""

    generation: float
    passes: float
    update: float
    name: str = ""
    source: str = ""

    def __post_init__(self):
        parts = (self.generation, self.passes, self.update)
        if any(not math.isfinite(p) or p < 0 for p in parts) or abs(sum(parts) - 1.0) > 1e-6:
            raise ValueError(f"a compute split needs shares >= 0 that sum to 1, got {parts}")

    @property
    def per_policy_token(self) -> float:
        """The share that scales with the policy tokens (passes on the kept rows + update)."""
        return self.passes + self.update

    def describe(self) -> str:
        return f"generation {self.generation:.0%}, old/ref passes {self.passes:.0%}, update {self.update:.0%}"


# Published GPU splits. verl's Qwen3-8B GRPO step (generation 55%, old log-probs 11%, reference 8%, update 26%); the
# upper end of the published generation share (77%), with the rest in verl's proportions.
GPU_VERL = Split(0.55, 0.19, 0.26, "gpu", "verl Qwen3-8B GRPO step: generation 55%, old 11%, ref 8%, update 26%")
_REST = 0.23 / 0.45
GPU_GEN77 = Split(0.77, 0.19 * _REST, 0.26 * _REST, "gpu_gen77", "generation 77% (published upper end), rest as verl")
SPLITS = {s.name: s for s in (GPU_VERL, GPU_GEN77)}
# The batch exponent of generation time: `fitted_alpha` of PODS' published generation times (docs/tracking.md).
PUBLISHED_ALPHA = 0.38


def fitted_alpha(rows: list[float], seconds: list[float]) -> float:
    """The least-squares slope of log(seconds) on log(rows): the α of generation time ∝ B^α."""
    if len(rows) != len(seconds) or len(rows) < 2 or min(rows) <= 0 or min(seconds) <= 0:
        raise ValueError(f"need >= 2 positive (rows, seconds) pairs, got {rows}, {seconds}")
    x = [math.log(r) for r in rows]
    y = [math.log(t) for t in seconds]
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxx = sum((a - mx) ** 2 for a in x)
    if sxx == 0:
        raise ValueError(f"need at least two batch sizes, got {rows}")
    return sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / sxx


def cpu_split(update_share: float, name: str = "cpu") -> Split:
    """The CPU-like split from a measured GRPO update share (no old/reference pass on the testbeds: β = 0 and
    one iteration per generation batch, so TRL skips both)."""
    if not 0.0 <= update_share <= 1.0:
        raise ValueError(f"update_share must be in [0, 1], got {update_share}")
    return Split(1.0 - update_share, 0.0, update_share, name, f"measured GRPO update share {update_share:.0%}")


def measured_update_share(phase_s: dict | None) -> float | None:
    """A run's update share u = (training step − generation and scoring) / training step, from its summed phase
    timers ``{"training_step": s, "generate_and_score": s}`` (`trl_costaware.embedded.testbed.train_run`'s
    ``phase_s``); None when the timers are missing."""
    phase_s = phase_s or {}
    step, gen = phase_s.get("training_step"), phase_s.get("generate_and_score")
    if not step or gen is None:
        return None
    return max(0.0, step - gen) / step


def parse_split(spec: str) -> Split:
    """A split by name (``gpu``, ``gpu_gen77``), as ``cpu:U`` (measured update share U), or as
    ``gen=A,passes=B,update=C`` (shares summing to 1)."""
    spec = spec.strip()
    if spec in SPLITS:
        return SPLITS[spec]
    if spec.startswith("cpu:"):
        return cpu_split(float(spec[4:]))
    parts = {}
    for item in spec.split(","):
        if "=" not in item:
            raise ValueError(
                f"compute split {spec!r}: expected a name ({', '.join(SPLITS)}), cpu:UPDATE_SHARE or "
                "gen=A,passes=B,update=C"
            )
        k, v = item.split("=", 1)
        parts[k.strip()] = float(v)
    unknown = set(parts) - {"gen", "generation", "passes", "update"}
    if unknown:
        raise ValueError(f"compute split {spec!r}: unknown phase(s) {sorted(unknown)}; phases: gen, passes, update")
    gen = parts.get("gen", parts.get("generation", 0.0))
    return Split(gen, parts.get("passes", 0.0), parts.get("update", 0.0), "custom", spec)


@dataclass(frozen=True)
class TokenWeights:
    """Per-token weights in baseline-step units: compute = gen · generated tokens · (B / B_base)^(α − 1) + policy ·
    policy tokens, with B a run's rows generated per step and `rows_per_step` the baseline's (needed when α ≠ 1)."""

    gen: float
    policy: float
    split: Split
    alpha: float = 1.0
    rows_per_step: float | None = None

    def compute(self, generated_tokens: float, policy_tokens: float, rows_per_step: float | None = None) -> float:
        gen = self.gen * generated_tokens
        if self.alpha != 1.0:
            if not (rows_per_step and self.rows_per_step):
                raise ValueError(
                    f"generation_alpha={self.alpha} prices by rows per step: the run's and the baseline's"
                )
            gen *= (rows_per_step / self.rows_per_step) ** (self.alpha - 1.0)
        return gen + self.policy * policy_tokens


def check_alpha(alpha: float) -> float:
    if not (isinstance(alpha, int | float) and math.isfinite(alpha) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"generation_alpha must be a number in [0, 1], got {alpha!r}")
    return float(alpha)


def token_weights(
    split: Split,
    gen_per_step: float,
    policy_per_step: float,
    alpha: float = 1.0,
    rows_per_step: float | None = None,
) -> TokenWeights:
    """Weights calibrated to the baseline: its step (``gen_per_step`` generated and ``policy_per_step`` policy
    tokens, ``rows_per_step`` rows generated) costs 1. w_gen = s_gen / Ḡ, w_pol = (s_pass + s_upd) / P̄; `alpha` the
    batch exponent of generation time (1: per token)."""
    if not (gen_per_step > 0 and policy_per_step > 0):
        raise ValueError(f"baseline tokens per step must be > 0, got {gen_per_step}, {policy_per_step}")
    alpha = check_alpha(alpha)
    if alpha != 1.0 and not (rows_per_step and rows_per_step > 0):
        raise ValueError(f"generation_alpha={alpha} needs the baseline's rows generated per step, got {rows_per_step}")
    return TokenWeights(
        split.generation / gen_per_step, split.per_policy_token / policy_per_step, split, alpha, rows_per_step
    )


def step_cost(kept_token_fraction: float, split: Split, gen_ratio: float = 1.0) -> float:
    """Relative step cost c = s_gen · (generated tokens per step / baseline's) + (s_pass + s_upd) · f."""
    return split.generation * gen_ratio + split.per_policy_token * kept_token_fraction


def break_even_steps_ratio(kept_token_fraction: float, split: Split, gen_ratio: float = 1.0) -> float:
    """Steps to target (arm / baseline) above which the arm costs more compute than the baseline: 1 / c."""
    return 1.0 / step_cost(kept_token_fraction, split, gen_ratio)


def phase_step_cost(update_share_arm: float, update_share_base: float) -> float:
    """Measured relative step cost from the update shares of two runs with the same generation work per step:
    (1 − u_base) / (1 − u_arm)."""
    if not (0 <= update_share_arm < 1 and 0 <= update_share_base < 1):
        raise ValueError(f"update shares must be in [0, 1), got {update_share_arm}, {update_share_base}")
    return (1.0 - update_share_base) / (1.0 - update_share_arm)
