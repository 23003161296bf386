"""Rewards by registered name (`math`, `exact_match`, a task's alias): see `registry.get_reward`."""

from emapg_cli.rewards.registry import REWARDS, RewardFn, SafeReward, get_reward, register_reward

__all__ = ["REWARDS", "RewardFn", "SafeReward", "get_reward", "register_reward"]
