"""GRPO building blocks as pure tensor functions: advantages, the PPO-clip policy loss, rollout correction, loss aggregation, the EMA update."""

from emapg_cli.grpo.advantages import grpo_advantages
from emapg_cli.grpo.aggregation import LOSS_AGG_MODES, aggregate, token_weights
from emapg_cli.grpo.ema import distance_from_norms, ema_distance, ema_norms, ema_update_
from emapg_cli.grpo.policy_loss import ppo_clip_loss
from emapg_cli.grpo.rollout_correction import CORRECTION_MODES, CorrectionStats, rollout_correction, sequence_level

__all__ = ["grpo_advantages", "aggregate", "token_weights", "LOSS_AGG_MODES", "ema_update_", "ema_distance", "ema_norms", "distance_from_norms", "ppo_clip_loss",
           "rollout_correction", "CorrectionStats", "CORRECTION_MODES", "sequence_level"]
