"""Config: every preset validates, sources merge in order, bad input is one line with exit code 2."""

from __future__ import annotations

import pytest
import yaml

from emapg_cli.config import Config, list_presets, load_config, preset_dir
from emapg_cli.config.loading import apply_overrides, parse_override
from emapg_cli.errors import UserError


def all_presets():
    return sorted(p.stem for p in preset_dir().glob("*.yaml"))


def test_preset_folder_has_the_documented_presets():
    assert {"olympiad", "search-qa", "toy"} <= set(list_presets())


@pytest.mark.parametrize("name", all_presets())
def test_every_preset_validates(name):
    cfg = load_config(preset=name)
    assert isinstance(cfg, Config)
    assert cfg.name == name


def test_olympiad_preset_matches_the_paper_run():
    c = load_config(preset="olympiad")
    assert c.model.path == "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
    assert (c.rollout.prompts_per_step, c.rollout.n, c.train.mini_batch_prompts) == (128, 8, 64)
    assert (c.optim.lr, c.optim.weight_decay) == (1e-6, 0.01)
    assert (c.train.clip_low, c.train.clip_high, c.train.dual_clip) == (0.2, 0.28, 3.0)
    assert c.train.loss_agg == "seq-mean-token-mean"
    assert (c.rollout.max_new_tokens, c.rollout.temperature, c.data.max_prompt_tokens) == (24576, 1.0, 4096)
    assert (c.kl.coef, c.kl.estimator, c.kl.iw, c.kl.log_ratio_clamp, c.kl.estimate_clamp) == (0.001, "k3", False, 20.0, 10.0)
    # staged lengths 8k -> 16k -> 24k, changing after the README's resume points global_step_480 and global_step_800;
    # truncated responses dropped in the 8k stage only
    assert [(c.stage_at(s).max_new_tokens, c.stage_at(s).mask_truncated) for s in (1, 480, 481, 800, 801, 1000, 1100)] == [
        (8192, True), (8192, True), (16384, False), (16384, False), (24576, False), (24576, False), (24576, False)]
    assert c.train.steps == 1000
    assert (c.reward.truncated, c.eval.n, c.eval.temperature, c.eval.top_p) == ("zero", 8, 1.0, 0.95)
    assert (c.ema.decay, c.ema.update_period) == (0.95, 10)
    # derived: 128 prompts x 8 samples = 1024 responses; 128 / 64 = 2 mini-batches
    assert c.derived.responses_per_step == 1024
    assert c.derived.mini_batches_per_step == 2


def test_search_qa_preset_matches_the_paper_run():
    c = load_config(preset="search-qa")
    assert c.model.path == "Qwen/Qwen2.5-3B"
    assert (c.rollout.prompts_per_step, c.rollout.n) == (512, 5)
    assert c.optim.betas == (0.9, 0.95) and c.optim.warmup_ratio == 0.285
    assert c.train.loss_agg == "token-mean"
    # the paper's estimator is the published Top-k construction (Algorithms 1/2), reverse, importance weighted
    assert (c.kl.estimator, c.kl.direction, c.kl.k, c.kl.iw, c.kl.coef) == ("topk_paper", "reverse", 32, True, 0.001)
    assert (c.rollout.top_p, c.train.dual_clip) == (0.95, None)
    assert (c.ema.decay, c.ema.update_period) == (0.9, 10)
    assert (c.search.max_turns, c.rollout.max_new_tokens, c.rollout.env) == (4, 500, "search")
    assert (c.rollout.top_p, c.train.dual_clip, c.optim.lr, c.rollout.reward) == (0.95, None, 1e-6, "em")
    assert (c.search.enabled, c.search.retriever, c.search.topk, c.search.max_obs_tokens) == (True, "http", 3, 500)
    assert c.data.train == "nq_hotpotqa_train"
    s = c.search  # Search-R1: retriever.topk 3, max_obs_length 500, max_start_length 2048, max_prompt_length 4096
    assert (s.enabled, s.retriever, s.topk, s.max_obs_tokens, s.max_context_tokens, s.final_turn) == (True, "http", 3, 500, 4096, True)
    assert c.data.max_prompt_tokens == 2048 and c.rollout.reward == "em"


def test_library_default_estimator_is_the_recommended_one():
    assert load_config().kl.estimator == "topk_mass"


def test_stages_cap_and_continue():
    c = load_config(overrides=["rollout.max_new_tokens=100", "train.mask_truncated=true",
                               "stages=[{steps: 2, max_new_tokens: 10}, {steps: 1, max_new_tokens: 500, mask_truncated: false}]"])
    # steps 1-2: 10 tokens; step 3: 500 capped at rollout.max_new_tokens = 100; after the last stage: as the last
    assert [(c.stage_at(s).max_new_tokens, c.stage_at(s).mask_truncated) for s in (1, 2, 3, 4)] == [
        (10, True), (10, True), (100, False), (100, False)]
    assert load_config(overrides=["rollout.max_new_tokens=64"]).stage_at(7).max_new_tokens == 64  # no stages


def test_sources_merge_in_order(tmp_path):
    # preset says decay 0.95; the user file says 0.9; --set says 0.99 and wins.
    user = tmp_path / "user.yaml"
    user.write_text(yaml.safe_dump({"ema": {"decay": 0.9}, "kl": {"k": 16}}))
    c = load_config(preset="olympiad", config_file=str(user), overrides=["ema.decay=0.99"])
    assert c.ema.decay == 0.99
    assert c.kl.k == 16  # from the file
    assert c.ema.update_period == 10  # untouched preset value survives the merge


def test_overrides_are_typed_by_the_model():
    assert parse_override("kl.k=64") == (["kl", "k"], 64)
    c = load_config(overrides=["kl.k=64", "kl.iw_clip=[0.5, 2]", "kl.iw=false", "model.path=/x"])
    assert c.kl.k == 64 and c.kl.iw_clip == (0.5, 2.0) and c.kl.iw is False and c.model.path == "/x"
    c = load_config(overrides=["kl.iw_clip=null"])
    assert c.kl.iw_clip is None


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("kl.kk=3", "unknown config key 'kl.kk'"),
        ("nope.x=1", "unknown config key 'nope.x'"),
        ("kl.k=abc", "kl.k"),
        ("kl.k=0", "greater than or equal to 1"),
        ("kl.coef=-1", "kl.coef"),
        ("ema.decay=1.5", "less than or equal to 1"),
        ("kl.estimator=k9", "'topk_paper'"),
        ("kl.estimator=k5", "forward KL only"),
        ("kl.iw_clip=[2,1]", "lo <= hi"),
        ("train.mini_batch_prompts=3", "must divide"),
        ("kl.k", "KEY=VALUE"),
    ],
)
def test_bad_values_raise_one_line_user_errors(override, fragment):
    with pytest.raises(UserError) as e:
        load_config(preset="olympiad", overrides=[override])
    msg = str(e.value)
    assert fragment in msg and "\n" not in msg


def test_unknown_preset_and_missing_file():
    with pytest.raises(UserError, match="unknown preset 'nope'"):
        load_config(preset="nope")
    with pytest.raises(UserError, match="config file not found"):
        load_config(config_file="/definitely/not/here.yaml")


def test_every_field_has_a_description():
    from pydantic import BaseModel

    def walk(model):
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                yield from walk(ann)
            yield f"{model.__name__}.{name}", field.description

    missing = [k for k, d in walk(Config) if not d]
    assert missing == []


def test_apply_overrides_does_not_mutate_input():
    data = {"kl": {"k": 1}}
    out = apply_overrides(data, ["kl.k=2"])
    assert data == {"kl": {"k": 1}} and out == {"kl": {"k": 2}}


def test_cli_config_show_and_errors(cli):
    r = cli("config", "show", "--preset", "olympiad", "--set", "ema.decay=0.99")
    assert r.returncode == 0, r.stderr
    shown = yaml.safe_load(r.stdout)
    assert shown["ema"]["decay"] == 0.99 and shown["kl"]["estimator"] == "k3"
    # the printed YAML is itself a valid user config
    assert Config.model_validate(shown).ema.decay == 0.99

    r = cli("config", "show", "--preset", "olympiad", "--set", "kl.kk=3")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "unknown config key 'kl.kk'" in r.stderr
    assert "Traceback" not in r.stderr


def test_presets_resolve_from_any_directory(cli, tmp_path):
    r = cli("config", "show", "--preset", "toy", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)["name"] == "toy"


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("nosuch",), "No such command 'nosuch'"),
        (("train", "--bogus"), "No such option: --bogus"),
        (("eval", "--bench", "x", "--n", "0"), "Invalid value for '--n'"),
        (("config", "show", "--preset"), "requires an argument"),
    ],
)
def test_usage_errors_are_one_line_with_exit_code_2(cli, args, fragment):
    r = cli(*args)
    assert r.returncode == 2
    assert fragment in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr


def test_bare_command_prints_help(cli):
    r = cli()
    assert r.returncode == 0 and "Usage: emapg" in r.stdout and "kl-check" in r.stdout
