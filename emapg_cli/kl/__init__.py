"""KL estimators (pure tensor functions): exact, K1-K5, K3++, Top-k (paper, unbiased, mass-corrected), truncated,
and the distillation estimators of `tail` (tail token, sample-corrected, ResOPD control variate, teacher support)."""

from emapg_cli.kl.common import gather_logprobs, importance_weight, topk_membership
from emapg_cli.kl.registry import ESTIMATORS, INFO, check_estimator, kl_per_token, topk_source

__all__ = [
    "ESTIMATORS", "INFO", "check_estimator", "kl_per_token", "topk_source",
    "gather_logprobs", "importance_weight", "topk_membership",
]
