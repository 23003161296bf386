"""Choosing torch's CPU threads (emapg_cli/train/threads.py)."""

import pytest


def test_auto_threads_leave_busy_cores_alone(monkeypatch):
    from emapg_cli.errors import UserError
    from emapg_cli.train.threads import ENV, auto_threads, choose_threads

    assert auto_threads(2, 1, 0.0) == 2  # idle 2-core machine: both
    assert auto_threads(2, 1, 1.2) == 1  # another job keeps a core busy: (2 - 1.2) // 1 = 0 -> at least 1
    assert auto_threads(16, 2, 4.0) == 6  # (16 - 4) // 2 = 6 <= the share 16 // 2 = 8
    assert auto_threads(16, 2, 0.0) == 8  # capped at the share
    monkeypatch.setenv(ENV, "3")
    assert choose_threads(5) == (3, ENV)
    monkeypatch.delenv(ENV)
    assert choose_threads(5) == (5, "train.torch_threads")
    monkeypatch.setenv(ENV, "zero")
    with pytest.raises(UserError):
        choose_threads(None)
