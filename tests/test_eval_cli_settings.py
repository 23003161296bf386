"""`emapg eval` with --preset/--config/--set: typed options reach the config as typed (a path with ` #` is not cut at
the YAML comment), and with --set alone eval's own defaults fill what the --set items leave out."""

from __future__ import annotations

from pathlib import Path

from emapg_cli.cli.eval_cmd import _flag_overrides, _origin
from emapg_cli.config.loading import load_config


def test_typed_path_with_hash_and_yaml_chars_reaches_the_config_unchanged(tmp_path):
    for name in ("my #1 template.txt", "*star.txt", "!tag: x.txt"):
        path = tmp_path / name
        got = _flag_overrides({"prompt_template": Path(path), "reward": "f1"}, {"prompt_template", "reward"})
        cfg = load_config("toy", None, got)
        # unquoted, YAML would read `.../my` (the rest a comment), an alias `*star.txt`, or a tag
        assert cfg.search.prompt_template == str(path.absolute()), got
        assert cfg.rollout.reward == "f1"


def test_origin_of_an_option():
    given, set_keys = {"n"}, {"eval.temperature", "search"}
    assert _origin("n", given, set_keys, "--preset toy") == "typed"
    assert _origin("temperature", given, set_keys, "--preset toy") == "--set"  # eval.temperature named by --set
    assert _origin("topk", given, set_keys, "") == "--set"  # `--set search={...}` covers search.topk
    assert _origin("top_p", given, set_keys, "--preset toy") == "--preset toy"  # the preset (and Config's defaults)
    assert _origin("top_p", given, set_keys, "") == "eval's default"  # --set alone: eval's own top_p 0.9
