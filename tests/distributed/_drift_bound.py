"""How far two fp32 runs may drift apart when they differ only in the order of their sums.

A run on 2 ranks and its 1-process reference add the same numbers in another order (each rank's
half batch then a reduce-scatter, against one batch; a sharded norm for clipping, against one
norm), so their gradients differ by a few fp32 ulps of the step's largest entry. The weights then
differ a little, which changes the next step's gradients by about as much again. We take the
gradients of the two runs to differ by at most ``delta = K_ULPS * ulp(max |g|)`` at every step:
the measured worst is 6 ulps (tests/distributed/test_muon_sharded.py, stage 2 against one process,
third step, earlier steps' weight differences included); 16 leaves room for other CPUs' kernels.

**Adam** divides each entry's update by that entry's own gradient scale. With bias-corrected
moments ``m = sum_i c_i g_i`` and ``s = sqrt(v) = sqrt(sum_i d_i g_i^2)`` (``c_i``, ``d_i`` the
weights of the two averages, each summing to 1), the update is ``u = m / (s + eps)``. A change of
at most ``delta`` in every ``g_i`` moves ``m`` by at most ``delta`` and ``s`` (a weighted l2 norm)
by at most ``delta``, so

    |du| <= (1 + U) * delta / (max(s - delta, 0) + eps),    U = sqrt(sum_i c_i^2 / d_i) >= |u|

(Cauchy-Schwarz), and never more than ``2 U``. An entry whose gradient is large against ``delta``
moves by almost nothing; one whose gradient is as small as the noise (an embedding row seen once,
Qwen2's ``k_proj.bias``, whose exact gradient is zero) may be pushed ``lr * U`` either way by
rounding alone: no fixed atol holds for it on every CPU, while a fixed atol wide enough for it
would hide real errors everywhere else. The bound of an entry is ``sum_t lr_t |du_t|``
(decoupled weight decay only shrinks a difference). An entry whose gradient has been exactly zero
so far (a token absent from every batch) has no terms to reorder: zero in both runs, no drift.

**Muon** normalises a whole matrix (``X = U / ||U||_F``, a change of ``eps`` relative to
``||U||`` moves ``X`` by at most ``2 eps``), then applies the quintic ``p(x) = a x + b x^3 + c x^5``
to its singular values 5 times. On ``[0, 1.21]``, the range the iteration keeps them in,
``|p'| <= 3.97``, which bounds how much each iteration can enlarge a perturbation (the divided
differences of ``p``). With noise of ``K_ULPS`` fp32 ulps relative to the matrix (gradient order
and the fp32 iteration's own rounding alike), one step moves a weight by at most
``lr * 2 * 3.97**5 * sqrt(max(1, rows / cols)) * K_ULPS * 2**-24``.
"""

from __future__ import annotations

import math

import torch

K_ULPS = 16
NS_GAIN = 2 * 3.97**5  # normalisation x 5 quintic iterations, see above


def gradient_noise(grads) -> float:
    """``delta``: K_ULPS fp32 ulps of the largest gradient entry (clipped, as the optimizer sees it)."""
    top = max(float(g.detach().abs().max()) for g in grads if g is not None and g.numel())
    if top == 0.0:
        return 0.0
    return K_ULPS * 2.0 ** (math.floor(math.log2(top)) - 23)


def _update_bound_factor(step: int, betas: tuple[float, float]) -> float:
    """``U = sqrt(sum_i c_i^2 / d_i)`` after ``step`` steps: a bound on Adam's ``|m / s|``."""
    b1, b2 = betas
    total = 0.0
    for i in range(1, step + 1):
        c = (1 - b1) * b1 ** (step - i) / (1 - b1**step)
        d = (1 - b2) * b2 ** (step - i) / (1 - b2**step)
        total += c * c / d
    return math.sqrt(total)


def adam_step_drift(exp_avg_sq: torch.Tensor, step: int, lr: float, betas: tuple[float, float], eps: float,
                    delta: float) -> torch.Tensor:
    """Per entry, how far one Adam(W) step of torch's formula may move a weight apart (see above).

    ``exp_avg_sq`` and ``step`` are the optimizer's state *after* the step (the gradient included).
    """
    u = _update_bound_factor(step, betas)
    s = (exp_avg_sq.detach().float() / (1 - betas[1] ** step)).sqrt()
    drift = (1 + u) * delta / ((s - delta).clamp(min=0) + eps)
    drift = drift.clamp(max=2 * u) * lr
    return torch.where(exp_avg_sq == 0, torch.zeros_like(drift), drift)


def muon_step_drift(lr: float, shape: torch.Size) -> float:
    """How far one Muon step may move an entry of a matrix of ``shape`` apart (see above)."""
    rows, cols = shape[-2], shape[-1]
    return lr * NS_GAIN * math.sqrt(max(1.0, rows / cols)) * K_ULPS * 2.0**-24


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor | float, name: str, steps: int) -> None:
    """``|got - want| <= bound`` entry-wise, plus the rounding of the ``steps`` updates themselves
    (one ulp of each weight per step)."""
    tol = bound + steps * 2.0**-23 * want.abs()
    excess = (got - want).abs() - tol
    if bool((excess > 0).any()):
        i = int(excess.flatten().argmax())
        raise AssertionError(
            f"{name}: entry {i} differs by {float((got - want).abs().flatten()[i]):.3g}, more than the "
            f"{float(torch.as_tensor(tol).expand_as(want).flatten()[i]):.3g} that reduction order explains "
            f"({int((excess > 0).sum())} of {want.numel()} entries)")
