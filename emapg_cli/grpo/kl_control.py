"""The adaptive KL coefficient: a proportional controller that moves beta so the measured KL tracks a target
(Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", Sec. 2.2; verl's
`AdaptiveKLController`, `algorithm.kl_ctrl.type=adaptive`). Floats in, a float out."""

from __future__ import annotations

import math

#: The proportional error is clipped to [-ERROR_CLIP, ERROR_CLIP] (Ziegler et al.'s and verl's 0.2).
ERROR_CLIP = 0.2


def adaptive_kl_coef(beta: float, kl: float, target: float, n: int, horizon: int) -> float:
    """The next step's KL coefficient after a step that used `beta` and measured `kl`:

        e_t       = clip(KL_t / KL_target - 1, -0.2, 0.2)
        beta_t+1  = beta_t * (1 + e_t * n / horizon)

    (Ziegler et al. 2019, Sec. 2.2, with K_beta = 0.1 folded into horizon as verl and TRL write it: there
    n_steps = batch_size, and `target` / `horizon` are algorithm.kl_ctrl.target_kl / horizon.) So beta
    grows by at most a factor 1 + 0.2 n / horizon per step while the KL is above the target and shrinks by
    at most 1 - 0.2 n / horizon while it is below; KL = target leaves it unchanged.

    `n` is the number of responses the step trained on, over all ranks (verl passes the batch size, its
    number of responses); `horizon` is in responses too, so n / horizon is the fraction of the horizon
    one step covers.

    Deviations, by choice:
      * a non-finite `kl` (a skipped update, a diverged step) leaves beta unchanged: it carries no
        information about the distance to the anchor, and NaN would poison every later beta (verl
        multiplies it in);
      * the caller measures KL per token as verl does (`kl/per_token`: the mean over the trained responses of each
        one's mean KL estimate over its tokens, whatever the loss aggregation), but during the update, with the
        estimator of the loss's KL term; verl measures the rollouts' KL to the reference before the update, as an
        in-reward penalty.
    Needs target > 0, horizon >= 1 and n < 5 * horizon (so that 1 + e n / horizon > 0 and beta stays
    positive); raises ValueError otherwise.
    """
    if not target > 0:
        raise ValueError(f"target must be > 0, got {target}")
    if horizon < 1 or not 0 < n < 5 * horizon:
        raise ValueError(f"need horizon >= 1 and 0 < n < 5 * horizon, got n={n}, horizon={horizon}")
    if not math.isfinite(kl):
        return beta
    error = min(max(kl / target - 1.0, -ERROR_CLIP), ERROR_CLIP)
    return beta * (1.0 + error * n / horizon)
