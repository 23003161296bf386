"""Run the real `emapg` CLI with one extra, test-only reward (`test_digit`) registered by name.

Used as `python tests/train_launcher.py train ...` and as the script of `accelerate launch`.
`test_digit` scores 1 when a response contains an ASCII digit: random tiny models hit it about
a quarter of the time, so GRPO groups have non-zero advantages and the policy-gradient path runs.
`test_nan` scores nan, so every optimizer step is skipped (the skipped-steps window stops the run).
"""

from __future__ import annotations

import sys


def test_digit(responses, examples):
    return [float(any(ch.isdigit() for ch in r)) for r in responses]


def test_nan(responses, examples):
    """nan for every response: the advantages, hence every loss, are non-finite (skipped optimizer steps)."""
    return [float("nan")] * len(responses)


def install() -> None:
    """Register `test_digit` and `test_nan` in the reward registry (the trainer looks rewards up there by name)."""
    from emapg_cli.rewards import register_reward

    register_reward("test_digit", lambda: test_digit)
    register_reward("test_nan", lambda: test_nan)


if __name__ == "__main__":
    install()
    from emapg_cli.cli.app import main

    sys.argv[0] = "emapg"
    main()
