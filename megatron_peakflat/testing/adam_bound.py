"""How far two correct fp32 AdamW runs may drift apart, element by element, from their own tensors.

Two AdamW implementations that round differently (torch's single-tensor AdamW and ATen's fused kernel) give
parameters that differ by a few ulps after one step. From the second step on, the gradients differ too (they are
taken at those slightly different parameters, and a gradient clip scales them by slightly different norms), and
Adam divides each gradient by its own running RMS: where that RMS is small, a tiny gradient difference moves
the update by a large fraction of ``lr``. So a fixed bound on ``max|a - b| / max|b|`` over a tensor is not a
property of the optimizer: it depends on how near zero the unluckiest element's gradient happens to be, which
changes with the thread count, the CPU's vector width or the BLAS (a fixed 1e-5 held on one machine with one
intra-op thread and failed at 1.6e-5 with two).

``AdamDivergence`` bounds ``|theta_a - theta_b|`` per element by what follows from the two runs' gradients and
the reference's second moment alone, with u = 2^-24 (fp32 unit roundoff), per step t (1-based):

- ``|u_t| <= U_t`` for any gradients (Cauchy-Schwarz on m_hat / sqrt(v_hat)):
  ``U_t = (1-b1)/(1-b1^t) * sqrt((1-b2^t)/(1-b2)) * sqrt(sum_{k<t} (b1^2/b2)^k)`` (1 at t=1, <1.2 at b=(.9,.95)).
- ``m_hat`` and ``sqrt(v_hat)`` are weighted means (an L1 and an L2 one, weights summing to 1) of the
  gradients so far, so each moves by at most ``D_t = max_{r<=t} |g_a,r - g_b,r|``; then
  ``|u_a - u_b| <= (1 + U_t) * D_t / (sqrt(v_hat_b) + eps)`` and always ``<= 2 U_t``.
- Rounding of the moments: ``m`` (a lerp) carries an absolute error ``<= u (1 + 4(1-b1)) / (1-b1) * G_t`` after
  the bias correction (G_t = max_{r<=t} |g_b,r|), added to D_t for each run; ``v`` (positive terms) a relative
  ``<= 4 t u``, so ``sqrt(v_hat)`` ``(2t + 1) u`` per run; the update's own arithmetic (sqrt, bias corrections
  possibly in fp32, divisions, eps) ``(6 + t/(1-b1^t) + t/(1-b2^t)) u`` relative per run.
- ``theta_t = theta_{t-1} (1 - lr wd) - lr u_t``: the difference carries over (``1 - lr wd <= 1``), each run
  rounds three times per step at the parameter's magnitude (the fp32 decay factor, the product, the
  subtraction: ``<= 3 u (|theta_t| + lr U_t)``).

The bound adds these up over the steps. It is exact arithmetic on the runs' own tensors, with no constant fitted
to a run; at step 1, where both runs see the same gradients, it is rounding only (a few ulps).
"""

from __future__ import annotations

import math

import torch

__all__ = ["AdamDivergence", "update_bound"]

FP32_UNIT_ROUNDOFF = 2.0 ** -24


def update_bound(step: int, beta1: float, beta2: float) -> float:
    """U_t: the largest |m_hat / (sqrt(v_hat) + eps)| any gradient sequence can give at ``step`` (1-based)."""
    r = beta1 * beta1 / beta2
    geometric = sum(r ** k for k in range(step))
    return (1 - beta1) / (1 - beta1 ** step) * math.sqrt((1 - beta2 ** step) / (1 - beta2)) * math.sqrt(geometric)


class AdamDivergence:
    """Per-element bound on |theta_a - theta_b| between two fp32 AdamW runs from the same start (see the module
    docstring), fed step by step with the gradients each run's AdamW received, the reference's ``exp_avg_sq``
    after the step and the reference's new parameters. All tensors are flat fp32 of one shape; kept in fp64."""

    def __init__(self, numel: int, beta1: float, beta2: float, eps: float):
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        z = lambda: torch.zeros(numel, dtype=torch.float64)  # noqa: E731
        self.bound, self.grad_gap, self.grad_max = z(), z(), z()
        self.step = 0
        self.saturated = torch.zeros(numel, dtype=torch.bool)
        """Elements where Adam's normalisation made the bound fall back to 2 U_t: it says nothing finer there."""

    def update(self, *, lr: float, grad_a: torch.Tensor, grad_b: torch.Tensor, exp_avg_sq_b: torch.Tensor,
               param_b: torch.Tensor) -> torch.Tensor:
        """Advance one step; return the bound after it (fp64, flat)."""
        u = FP32_UNIT_ROUNDOFF
        self.step += 1
        t, b1, b2 = self.step, self.beta1, self.beta2
        ga, gb = grad_a.detach().double().reshape(-1), grad_b.detach().double().reshape(-1)
        self.grad_gap = torch.maximum(self.grad_gap, (ga - gb).abs())
        self.grad_max = torch.maximum(self.grad_max, torch.maximum(ga.abs(), gb.abs()))
        U = update_bound(t, b1, b2)
        m_rounding = 2 * u * (1 + 4 * (1 - b1)) / (1 - b1) * self.grad_max  # both runs
        gap = self.grad_gap + m_rounding
        rms = (exp_avg_sq_b.detach().double().reshape(-1) / (1 - b2 ** t)).sqrt()
        sensitivity = (1 + U) * gap / (rms + self.eps)
        relative = 2 * ((2 * t + 1) + 6 + t / (1 - b1 ** t) + t / (1 - b2 ** t)) * u * U  # both runs
        self.saturated |= sensitivity + relative >= 2 * U
        du = torch.clamp(sensitivity + relative, max=2 * U)
        theta = param_b.detach().double().reshape(-1).abs() + self.bound  # covers |theta_a| too
        self.bound = self.bound + lr * du + 2 * 3 * u * (theta + lr * U)  # both runs
        return self.bound
