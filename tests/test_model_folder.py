"""Broken or tampered model folders are one line wherever a model is read (issue 32, item 11; models/folder.py):
the policy (train/preflight.py model_config, models/loading.py), a teacher (train/teacher.py), `kl-check --model`
(klcheck/model_source.py), `eval --model` and `rollout serve --model` (models/hub.py check_model_source).
The real CLI over every case and command is the slow probe one_line:model_folders_one_line."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from emapg_cli.errors import UserError

from probes.one_line import broken_model_folders  # the probe's cases: one builder for both


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """The probe's broken copies of a tiny model (a pickle that would create a folder, config.json a list / null /
    not UTF-8 / with a string vocab_size, safetensors cut in half / zeroed / a link loop, a folder that is a link
    loop) and a few more: {name: (folder, words its one-line error holds)}."""
    root = tmp_path_factory.mktemp("broken")
    out = broken_model_folders(root)
    good = root / "tiny"
    weights = (good / "model.safetensors").read_bytes()

    def copy(name: str, words: str) -> Path:
        shutil.copytree(good, root / name)
        out[name] = (root / name, words)
        return root / name

    copy("cfg-text-vocab-bool", "text_config.vocab_size is true").joinpath("config.json").write_text(
        json.dumps({**json.loads((good / "config.json").read_text()), "text_config": {"vocab_size": True}}))
    n = struct.unpack("<Q", weights[:8])[0]  # a header that is no JSON: 0xff bytes over it
    copy("st-header-garbage", "header is not a JSON object").joinpath("model.safetensors").write_bytes(
        weights[:8] + b"\xff" * n + weights[8 + n:])
    copy("st-trailing", "bytes no tensor owns").joinpath("model.safetensors").write_bytes(weights + b"\0" * 8)
    d = copy("shard-outside", "is not a file name in the folder")
    (d / "model.safetensors").rename(d / "shard.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../../etc/passwd"}}))
    d = copy("shard-missing", "shard-00001.safetensors (listed in model.safetensors.index.json) is missing")
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "shard-00001.safetensors"}}))
    (root / "a-file").write_text("not a folder")
    out["a-file"] = (root / "a-file", "not a folder")
    return out


CASES = ["pickle", "cfg-list", "cfg-null", "cfg-latin1", "cfg-vocab-str", "cfg-text-vocab-bool", "st-truncated", "st-zeroed",
         "st-header-garbage", "st-trailing", "st-link-loop", "shard-outside", "shard-missing", "dir-link-loop", "a-file"]


def _one_line(call, what: str, words: str) -> None:
    with pytest.raises(UserError) as e:
        call()
    line = str(e.value)
    assert "\n" not in line and what in line and words in line, line


@pytest.mark.parametrize("name", CASES)
def test_policy_loading_is_one_line(broken, name):
    """load_causal_lm (policy, teacher, hf engines, kl-check): a pickle (refused by weights_only) and everything the
    folder check finds; before, UnpicklingError, TypeError, SafetensorError, StrictDataclassFieldValidationError
    escaped as internal errors (and a link loop blamed the hub)."""
    from emapg_cli.models.loading import load_causal_lm

    folder, words = broken[name]
    _one_line(lambda: load_causal_lm(str(folder), "float32", what="model.path"), "model.path", words)
    assert not (folder.parent / "PWNED").exists(), "the pickle ran"


@pytest.mark.parametrize("name", [c for c in CASES if c != "pickle"])
def test_every_reader_of_a_model_folder_checks_it(broken, name):
    """The checks before any weights load, in each command's words: train's preflight (model.path, and a teacher's
    anchor.path), eval/rollout serve (check_model_source), kl-check (its folder check)."""
    from emapg_cli.klcheck.model_source import logits_from_model
    from emapg_cli.models.hub import check_model_source
    from emapg_cli.train.preflight import model_config
    from emapg_cli.train.teacher import teacher_folder

    folder, words = broken[name]
    _one_line(lambda: model_config(str(folder)), "model.path", words)
    _one_line(lambda: teacher_folder(str(folder)), "anchor.path", words)
    _one_line(lambda: check_model_source(str(folder), "--model"), "--model", words)
    _one_line(lambda: logits_from_model(str(folder), None, None, 4, 0.05, 0), "--model/--anchor-model", words)


def test_good_folder_passes_and_sharded_weights_are_checked_shard_by_shard(tiny_llama, tmp_path):
    """The tiny model passes every check; split into a shard index + shard, it still passes, and a cut shard is named."""
    from emapg_cli.models.folder import check_model_folder

    assert check_model_folder(str(tiny_llama), "model.path") == tiny_llama
    assert check_model_folder(str(tmp_path / "no-such-folder"), "model.path") is None  # the callers say "missing"
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_llama, sharded)
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00001.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    assert check_model_folder(str(sharded), "model.path") == sharded
    shard = sharded / "model-00001-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])
    _one_line(lambda: check_model_folder(str(sharded), "model.path"), "model-00001-of-00001.safetensors", "cut short")
