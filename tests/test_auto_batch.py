"""train.micro_batch_size=auto (train/auto_batch.py): the largest micro-batch whose planned update peak fits the
measured memory, at the run's measured length; the same run as the number it resolves to, bit for bit."""

from __future__ import annotations

import pytest

from emapg_cli.config.loading import load_config
from emapg_cli.errors import UserError
from emapg_cli.train import auto_batch
from emapg_cli.train.plan import ModelShapes, fitting_micro_batch, load_model_config, memory_terms
from train_helpers import tiny_overrides, write_dataset


def _peak(cfg, shapes, seq_len: int, b: int) -> int:
    """The plan's update peak (state + update terms) at micro-batch b: what the budget is compared with."""
    terms = memory_terms(shapes, cfg, seq_len, micro_batch=b, device_memory_bytes=2**40, master_weights=cfg.model.master_weights)
    return sum(t.bytes for t in terms if t.phase in ("state", "update"))


def test_config_takes_auto_or_a_positive_number():
    assert load_config("toy", None, ["train.micro_batch_size=auto"]).train.micro_batch_size == "auto"
    assert load_config("toy", None, ["train.micro_batch_size=3"]).train.micro_batch_size == 3
    for bad in ("0", "big"):
        with pytest.raises(UserError):
            load_config("toy", None, [f"train.micro_batch_size={bad}"])


def test_the_largest_micro_batch_whose_peak_fits(tiny_llama):
    cfg = load_config("toy", None, ["train.mini_batch_prompts=4", "rollout.n=4", f"model.path={tiny_llama}"])  # 16 sequences
    shapes = ModelShapes.from_hf_config(load_model_config(str(tiny_llama)))
    peak5 = _peak(cfg, shapes, 100, 5)
    assert _peak(cfg, shapes, 100, 6) > peak5  # the activations grow with b, so the budget decides
    assert fitting_micro_batch(cfg, shapes, 100, peak5) == 5  # exactly the peak of 5 fits
    assert fitting_micro_batch(cfg, shapes, 100, peak5 - 1) == 4  # one byte less: 4
    assert fitting_micro_batch(cfg, shapes, 100, 2**50) == 16  # capped at the mini-batch's 4 x 4
    assert fitting_micro_batch(cfg, shapes, 100, 1) == 1  # nothing fits: 1, never 0


def test_the_measured_length_is_the_longest_prompt_plus_the_responses():
    cfg = load_config("toy", None, ["rollout.max_new_tokens=16", "data.max_prompt_tokens=256"])
    assert auto_batch.run_sequence_length(cfg, [[1] * 40, [1] * 95, [1] * 7]) == 95 + 16
    assert auto_batch.run_sequence_length(cfg, []) == 256 + 16  # no prompts measured: the plan's worst case


def test_mem_available_reads_the_kernels_kilobytes(tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n")
    assert auto_batch.mem_available(str(info)) == 20_000_000 * 1024


def test_a_number_is_left_as_it_is():
    cfg = load_config("toy", None, ["train.micro_batch_size=7"])
    assert auto_batch.resolve(cfg, {}, [], "cpu") == (cfg, None)


def _train(tmp_path, name, model, monkeypatch=None, budget=None, **sets):
    from emapg_cli.train import trainer as trainer_mod
    from train_launcher import install

    install()
    if budget is not None:
        monkeypatch.setattr(auto_batch, "memory_budget", lambda device: (budget, "test budget"))
    data = write_dataset(tmp_path / "data.jsonl")
    opts = tiny_overrides(model, data, steps=2, **{"train.save_every": 0, "eval.anchor_every": 0, **sets})
    cfg = load_config(overrides=[o for o in opts if o != "--set"])
    trainer_mod.Trainer(cfg, tmp_path / name).run()
    return tmp_path / name


def test_auto_runs_as_the_number_it_resolves_to(tiny_llama, tmp_path, monkeypatch, capsys, one_torch_thread):
    import hashlib

    from emapg_cli.models.loading import load_tokenizer
    from emapg_cli.train.preflight import preflight
    from emapg_cli.train.rollout import prepare_prompts

    run_auto = _train(tmp_path, "auto", tiny_llama, **{"train.micro_batch_size": "auto"})
    said = [line for line in capsys.readouterr().err.splitlines() if "train.micro_batch_size auto:" in line]
    # tiny_overrides: mini-batches of 2 prompts x 4 = 8 sequences; this machine's memory holds all 8 of the tiny model
    assert len(said) == 1 and said[0].split("auto: ")[1].startswith("8 "), said
    # a budget that fits exactly 3 sequences at the run's measured length (its prompts, as the trainer renders them,
    # + 6 new tokens): the run uses 3, as an explicit 3 does
    cfg = load_config(overrides=[o for o in tiny_overrides(tiny_llama, tmp_path / "data.jsonl") if o != "--set"])
    _, prompts, _ = prepare_prompts(load_tokenizer(str(tiny_llama)), preflight(cfg).train, cfg.data.max_prompt_tokens,
                                    None, cfg.data.prefix_messages())
    shapes = ModelShapes.from_hf_config(load_model_config(str(tiny_llama)))
    budget = _peak(cfg, shapes, auto_batch.run_sequence_length(cfg, prompts), 3)  # memory_budget patched: no headroom
    three = _train(tmp_path, "auto3", tiny_llama, monkeypatch, budget=budget, **{"train.micro_batch_size": "auto"})
    assert "train.micro_batch_size auto: 3 " in capsys.readouterr().err
    explicit = _train(tmp_path, "three", tiny_llama, **{"train.micro_batch_size": 3})

    def weights(run):
        return hashlib.sha256((run / "final" / "policy" / "model.safetensors").read_bytes()).hexdigest()

    assert weights(three) == weights(explicit)
    assert (run_auto / "final" / "policy" / "model.safetensors").exists()


def test_the_dry_run_resolves_auto_on_its_device(tiny_llama):
    from emapg_cli.train.plan import make_plan

    cfg = load_config("toy", None, ["train.micro_batch_size=auto", f"model.path={tiny_llama}"])
    model_config = load_model_config(str(tiny_llama))
    shapes = ModelShapes.from_hf_config(model_config)
    seq_len = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens  # the plan's worst case
    tight = _peak(cfg, shapes, seq_len, 2)  # a "device" that holds exactly 2 sequences
    plan = make_plan(cfg, model_config, device_memory_gib=tight / 2**30)
    assert plan.micro_batch_size == 2
    assert any(n.startswith("train.micro_batch_size auto: 2 here") for n in plan.notes), plan.notes
