"""A resume that changes anchor.rule (issue 40, item 4): the checkpoint holds the old rule's anchor, so a --set of
another rule is refused in one line (exit 2, nothing written) unless --allow-method-change says so, and then the plan
names the anchor the run really starts from (cli/train_cmd.py, config/anchor_rules.describe_rule)."""

from __future__ import annotations

from pathlib import Path

from emapg_cli.config.loading import load_config, to_yaml


def _fake_run(root: Path, *sets: str) -> Path:
    """A run folder as `train` leaves it after step 3: config.yaml and a checkpoint folder (its files are never read:
    the refusal comes before any checkpoint is loaded)."""
    run = root / "run"
    (run / "checkpoints" / "step_3").mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(load_config("toy", None, list(sets))))
    return run


def _files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_resume_under_another_rule_is_refused_without_the_flag(cli, emapg_home, tmp_path):
    run = _fake_run(tmp_path)  # trained with the toy preset's anchor.rule=ema
    before = _files(run)
    for rule in ("fixed", "reset"):
        out = cli("train", "--resume", str(run), "--set", f"anchor.rule={rule}")
        assert out.returncode == 2, out.stdout + out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "trained with anchor.rule=ema" in lines[0] and "--allow-method-change" in lines[0]
        assert "checkpointed at step 3" in lines[0]
        assert _files(run) == before  # config.yaml still says ema; nothing added
    # the same rule, spelled out, is no change
    same = cli("train", "--resume", str(run), "--set", "anchor.rule=ema", "--dry-run", env={"COLUMNS": "400"})
    assert same.returncode == 0, same.stderr


def test_allowed_change_says_what_the_anchor_is(cli, emapg_home, tmp_path):
    run = _fake_run(tmp_path)
    plan = cli("train", "--resume", str(run), "--set", "anchor.rule=fixed", "--allow-method-change", "--dry-run",
               env={"COLUMNS": "400"})
    assert plan.returncode == 0, plan.stderr
    text = " ".join(plan.stdout.split())
    assert "the anchor checkpointed at step 3 (anchor.rule=ema's), not the initial policy" in text
    assert "fixed: η 1 (set by the rule), the initial policy" not in text


def test_bema_run_resumed_as_ema_and_ema_as_bema(cli, emapg_home, tmp_path):
    run = _fake_run(tmp_path, "anchor.rule=bema")
    silent = cli("train", "--resume", str(run), "--set", "anchor.rule=ema")
    assert silent.returncode == 2 and "trained with anchor.rule=bema" in silent.stderr
    allowed = cli("train", "--resume", str(run), "--set", "anchor.rule=ema", "--allow-method-change", "--dry-run",
                  env={"COLUMNS": "400"})
    assert allowed.returncode == 0 and "starting from the anchor checkpointed at step 3 (anchor.rule=bema's)" in " ".join(allowed.stdout.split())
    # into bema: the checkpoint of an ema run holds no θ_0 (the initial policy), whatever the flag says
    ema_run = _fake_run(tmp_path / "b")
    into = cli("train", "--resume", str(ema_run), "--set", "anchor.rule=bema", "--allow-method-change")
    assert into.returncode == 2 and len(into.stderr.strip().splitlines()) == 1 and "θ_0" in into.stderr


def test_flag_without_resume_is_refused(cli, emapg_home, tmp_path):
    out = cli("train", "--preset", "toy", "--allow-method-change", "--dry-run")
    assert out.returncode == 2 and "--allow-method-change applies to --resume" in out.stderr


def test_a_changed_bema_burn_in_is_a_method_change(cli, emapg_home, tmp_path):
    """anchor.bema.update_after decides what θ_0 in the checkpoint is (the initial policy, or step tau's): changing
    it on resume is refused the same way."""
    run = _fake_run(tmp_path, "anchor.rule=bema")
    out = cli("train", "--resume", str(run), "--set", "anchor.bema.update_after=50")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "trained with anchor.bema.update_after=0; anchor.bema.update_after=50" in out.stderr


def test_the_settings_line_names_the_checkpointed_anchor():
    """The line a run prints as it starts (train/progress.config_line) says it too, for the ema rule as well."""
    from emapg_cli.train.progress import config_line

    cfg = load_config("toy", None, [])
    assert "checkpointed" not in config_line(cfg)
    cfg._anchor_from = "the anchor checkpointed at step 3 (anchor.rule=bema's)"
    assert "ema: η 0.9 every 5 steps, starting from the anchor checkpointed at step 3 (anchor.rule=bema's), not the " \
           "initial policy" in config_line(cfg)
