"""The per-element bound between two fp32 AdamW runs (megatron_peakflat.testing.adam_bound) holds for two correct
implementations fed slightly different gradients, near-zero ones included, and a wrong hyperparameter breaks it."""

from __future__ import annotations

import torch

from megatron_peakflat.testing.adam_bound import FP32_UNIT_ROUNDOFF, AdamDivergence, update_bound

BETAS, EPS, WD, N, STEPS = (0.9, 0.95), 1e-8, 0.1, 20_000, 10


def _grads(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step, (reference gradient, the other run's): magnitudes spread over 1e-12..1e-2 (Adam's eps is 1e-8),
    the other run's off by ~1e-6 relative plus 1e-11 absolute, as gradients taken at parameters a few ulps apart."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        mag = 10.0 ** (-12 + 10 * torch.rand(N, generator=gen))
        gb = mag * torch.sign(torch.randn(N, generator=gen))
        ga = gb * (1 + 1e-6 * torch.randn(N, generator=gen)) + 1e-11 * torch.randn(N, generator=gen)
        out.append((ga.float(), gb.float()))
    return out


def _run(grads, lr_scale: float = 1.0) -> float:
    """Worst |a - b| / bound over the steps: run a is ATen's fused AdamW, run b torch's single-tensor one."""
    gen = torch.Generator().manual_seed(0)
    start = 0.02 * torch.randn(N, generator=gen)
    start[:100] = 1.5  # large parameters: their rounding dominates where the gradients are equal
    pa, pb = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    oa = torch.optim.AdamW([pa], lr=2e-3 * lr_scale, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    ob = torch.optim.AdamW([pb], lr=2e-3, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    div = AdamDivergence(N, *BETAS, EPS)
    worst = 0.0
    for step, (ga, gb) in enumerate(grads, start=1):
        if step == 6:
            for o, scale in ((oa, lr_scale), (ob, 1.0)):
                o.param_groups[0]["lr"] = 1e-3 * scale
        pa.grad, pb.grad = ga.clone(), gb.clone()
        oa.step()
        ob.step()
        bound = div.update(lr=ob.param_groups[0]["lr"], grad_a=ga, grad_b=gb,
                           exp_avg_sq_b=ob.state[pb]["exp_avg_sq"], param_b=pb.detach())
        worst = max(worst, float(((pa.detach().double() - pb.detach().double()).abs() / bound).max()))
    return worst


def test_bound_holds_between_two_correct_adamws():
    assert _run(_grads(1)) <= 1.0


def test_bound_is_a_few_ulps_where_the_gradients_agree():
    """Equal gradients: the bound after one step is rounding alone, a few ulps of the parameter and of lr."""
    g = _grads(2)
    same = [(gb, gb) for _, gb in g]
    assert _run(same) <= 1.0
    div = AdamDivergence(N, *BETAS, EPS)
    p = torch.full((N,), 1.5)
    bound = div.update(lr=2e-3, grad_a=same[0][0], grad_b=same[0][0],
                       exp_avg_sq_b=(1 - BETAS[1]) * same[0][0].double() ** 2, param_b=p)
    assert float(bound.max()) <= 16 * FP32_UNIT_ROUNDOFF * (1.5 + 2e-3)


def test_bound_catches_a_wrong_learning_rate():
    """lr off by 1e-4 (relative) moves every element by ~2e-7 * |u| at step 1: far outside the bound."""
    assert _run(_grads(3), lr_scale=1 + 1e-4) > 1.0


def test_update_bound():
    """U_1 = 1, and no gradient sequence gives |m_hat / sqrt(v_hat)| above U_t (random ones, and the sequence
    g_k ~ (b1^2 / b2)^(t-k) that makes Cauchy-Schwarz an equality there)."""
    assert update_bound(1, *BETAS) == 1.0
    b1, b2 = BETAS
    gen = torch.Generator().manual_seed(4)
    for t in range(1, 30):
        g = torch.cat([torch.randn(10_000, t, generator=gen, dtype=torch.float64) *
                       10.0 ** (4 * torch.rand(10_000, t, generator=gen, dtype=torch.float64)),
                       torch.tensor([[(b1 / b2) ** (t - k) for k in range(1, t + 1)]], dtype=torch.float64)])
        w1 = torch.tensor([(1 - b1) * b1 ** (t - k) for k in range(1, t + 1)], dtype=torch.float64) / (1 - b1 ** t)
        w2 = torch.tensor([(1 - b2) * b2 ** (t - k) for k in range(1, t + 1)], dtype=torch.float64) / (1 - b2 ** t)
        ratio = (g @ w1).abs() / (g * g @ w2).sqrt()
        assert float(ratio.max()) <= update_bound(t, b1, b2) * (1 + 1e-12)
        assert float(ratio[-1]) >= update_bound(t, b1, b2) * (1 - 1e-9)  # attained: the bound is not loose
