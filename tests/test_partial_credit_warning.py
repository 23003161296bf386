"""reasoning-gym's partial credit is gameable (issue 40, item 5): an answer holding the gold inside it scores
len(gold)/len(answer), so `12` against gold `1` scores 1/2 = 0.5, and a doubled gold `77` against `7` scores 1/2 too.
The smol preset trains on reward.credit=solved (no warning); with partial, `train` and `--dry-run` say so in one line."""

from __future__ import annotations

from emapg_cli.config.loading import load_config
from emapg_cli.train.preflight import config_warnings


def _gameable(warnings: list[str]) -> list[str]:
    return [w for w in warnings if "partial credit" in w]


def test_the_warning_follows_the_credit():
    assert _gameable(config_warnings(load_config("smol", None, []))) == []  # the preset: credit solved
    partial = _gameable(config_warnings(load_config("smol", None, ["reward.credit=partial"])))
    assert len(partial) == 1 and "reward.credit=solved" in partial[0] and "\n" not in partial[0]
    # another reward's partial credit is what it means (the toy's maths reward is 0/1 anyway): no warning
    assert _gameable(config_warnings(load_config("toy", None, []))) == []


def test_dry_run_prints_it(cli, emapg_home):
    out = cli("train", "--preset", "smol", "--set", "reward.credit=partial", "--dry-run", env={"COLUMNS": "400"})
    assert out.returncode == 0, out.stderr
    lines = [x for x in out.stdout.splitlines() if x.startswith("warning: rollout.reward=reasoning-gym trains on partial")]
    assert len(lines) == 1
    quiet = cli("train", "--preset", "smol", "--dry-run", env={"COLUMNS": "400"})
    assert quiet.returncode == 0 and "trains on partial credit" not in quiet.stdout
