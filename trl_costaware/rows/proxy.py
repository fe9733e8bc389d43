"""Loss-aware gradient-norm proxy: pure torch, no trainer in sight (derivation: docs/budget_and_proxy.md).

Row i enters TRL's policy loss as ℓ_i = −A_i · Σ_t m_it log π(y_it) / Z_i (m the loss mask, Z_i the loss type's
normaliser, `plan.LOSS_NORMALISERS`: L_i · const for the row-mean types grpo and sapo, a batch-wide constant for the
others). The norm of the token sum is modelled as the ℓ_{1/γ} norm of per-token weights u_it = 1 − π(y_it) (1 when
the sampled tokens' log-probabilities are unknown), so

    G_i = |A_i| · h_i,     h_i = (Σ_t m_it u_it^(1/γ))^γ / Z_i   (without log-probabilities: L_i^γ or L_i^(γ−1)),

γ = 1/2 by default (token gradients in unrelated directions). Rows with A_i = 0 or no loss tokens get G_i = 0.
Nothing here returns NaN or infinity for finite-or-NaN input.
"""

from __future__ import annotations

import torch

from .plan import LOSS_NORMALISERS
from .sampling import _clean

# The loss types and their normalisers are defined once, in `plan.LOSS_NORMALISERS`. Row-mean types: the divisor Z_i
# contains the row's own token count (Z_i ∝ L_i); every other type divides by a constant shared by the batch.
LOSS_TYPES = tuple(LOSS_NORMALISERS)
ROW_MEAN_LOSSES = tuple(name for name, z in LOSS_NORMALISERS.items() if z.row_length)

# Length exponent γ of the token-sum norm: ‖Σ_t ∇log π(y_t)‖ ≈ L^γ.
DEFAULT_GAMMA = 0.5
MAX_GAMMA = 2.0


def length_exponent(loss_type: str, gamma: float = DEFAULT_GAMMA) -> float:
    """Exponent e of L_i in h_i = L_i^e (no log-probabilities): γ for token-sum types, γ − 1 for row-mean types."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    return gamma - 1.0 if loss_type in ROW_MEAN_LOSSES else gamma


def _float(x: torch.Tensor) -> torch.Tensor:
    """float64 stays float64, anything else becomes float32 (float64 is not available on every device)."""
    return x if x.dtype == torch.float64 else x.float()


def token_weights(token_logps: torch.Tensor) -> torch.Tensor:
    """u_it = 1 − π(y_it) = 1 − exp(log π(y_it)), in [0, 1]; NaN log-probabilities count as u = 1 (no knowledge)."""
    logps = _float(token_logps)
    u = 1.0 - logps.clamp(max=0.0).exp()
    return torch.where(torch.isnan(logps), torch.ones_like(u), u).clamp(0.0, 1.0)


def row_factor(
    token_mask: torch.Tensor,
    loss_type: str,
    gamma: float = DEFAULT_GAMMA,
    token_logps: torch.Tensor | None = None,
) -> torch.Tensor:
    """The loss type's per-row factor h_i = (Σ_t m_it u_it^(1/γ))^γ / Z_i (module docstring), shape (N,), on the mask's
    device, float64 for a float64 mask and float32 otherwise.

    Args:
        token_mask: (N, T) loss mask m_it (1 for a token in the policy loss).
        loss_type: a TRL `loss_type`; decides whether Z_i = L_i (row-mean) or a constant (token-sum).
        gamma: length exponent γ in (0, 2]: 1/2 for token gradients in unrelated directions, 1 for aligned ones;
            above 1 when longer rows also have larger per-token gradients (length and difficulty go together).
        token_logps: optional (N, T) log-probabilities of the sampled tokens under the sampling policy; when given,
            each token counts with weight u_it = 1 − π(y_it) instead of 1.
    """
    if not 0.0 < gamma <= MAX_GAMMA:
        raise ValueError(f"gamma must lie in (0, {MAX_GAMMA}], got {gamma}")
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    mask = _clean(token_mask).clamp(min=0.0)
    if token_logps is not None:
        if token_logps.shape != token_mask.shape:
            raise ValueError(f"token_logps shape {tuple(token_logps.shape)} != token_mask shape {tuple(mask.shape)}")
        u = token_weights(token_logps.to(mask.device)).to(mask.dtype)
    else:
        u = torch.ones_like(mask)
    norm = (mask * u.pow(1.0 / gamma)).sum(-1).pow(gamma)
    if loss_type in ROW_MEAN_LOSSES:
        length = mask.sum(-1)
        norm = torch.where(length > 0, norm / length.clamp(min=1e-12), torch.zeros_like(norm))
    return norm


def loss_aware_proxy(
    advantages: torch.Tensor,
    token_mask: torch.Tensor,
    loss_type: str,
    gamma: float = DEFAULT_GAMMA,
    token_logps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gradient-norm proxy G_i = |A_i| · h_i with h_i = `row_factor(...)` (module docstring). Shape (N,), float64.

    NaN advantages (unscorable rows) give G_i = 0, as does a row with no loss tokens.
    """
    adv = _clean(advantages).double().abs()
    if adv.shape != token_mask.shape[:1]:
        raise ValueError(f"advantages shape {tuple(adv.shape)} must be (N,) with N = token_mask.shape[0]")
    return adv * row_factor(token_mask, loss_type, gamma, token_logps).to(adv.device)
