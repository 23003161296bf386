"""A teacher as the anchor (anchor.source=teacher, train/teacher.py): config rules, the vocabulary/tokenizer check before
any weights load, where q comes from (kl.topk_from), a teacher that never changes, and a bit-identical resume."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from emapg_cli.config.loading import load_config
from emapg_cli.errors import UserError

from train_helpers import killed_and_resumed, load_weights, run, settings_of, tiny_overrides, train_cmd, tree_hash, write_dataset

TWO_MINI = ["rollout.prompts_per_step=2", "train.mini_batch_prompts=1"]


@pytest.fixture(scope="module")
def tiny_teacher(tmp_path_factory) -> Path:
    """The tiny Qwen2 of conftest's `tiny_qwen2` with other weights (seed 1): the same byte tokenizer and vocabulary."""
    from emapg_cli.models.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("teacher") / "model", arch="qwen2", seed=1)


def teacher_opts(model: Path, teacher: Path, data: Path, steps: int, **extra) -> list[str]:
    return tiny_overrides(model, data, steps=steps, **{"anchor.source": "teacher", "anchor.path": teacher,
                                                      "eval.anchor_every": 0, "data.eval": "null", **extra})


# ------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("overrides, message", [
    (["anchor.source=teacher"], "anchor.source=teacher needs anchor.path"),
    (["anchor.path=/x"], "anchor.path is a teacher's folder"),
    (["anchor.dtype=bfloat16"], "the EMA anchor's is ema.dtype"),
    (["anchor.source=teacher", "anchor.path=/x", "kl.coef=0"], "anchor.source=teacher needs kl.coef > 0"),
    (["anchor.source=teacher", "anchor.path=/x", "ema.target_distance=0.01"], "ema.target_distance sets the EMA"),
    (["anchor.source=teacher", "anchor.path=/x", "lora.r=2"], "lora.r > 0 does not support anchor.source=teacher"),
    (["anchor.source=teacher", "anchor.path=/x", "rollout.engine=vllm", "eval.anchor_every=2"], "eval.anchor_every with"),
    (["kl.topk_from=policy"], "kl.topk_from"),
    (["kl.estimator=teacher_support"], "set kl.topk_from=anchor"),
    (["kl.estimator=teacher_support_raw", "kl.topk_from=sampling"], "set kl.topk_from=anchor"),
])
def test_config_refuses(overrides, message):
    with pytest.raises(UserError) as e:
        load_config(overrides=overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_config_defaults_and_a_teacher():
    cfg = load_config()
    assert (cfg.anchor.source, cfg.anchor.path, cfg.anchor.dtype, cfg.kl.topk_from) == ("ema", None, None, None)
    cfg = load_config(overrides=["anchor.source=teacher", "anchor.path=$EMAPG_HOME/t", "anchor.dtype=bfloat16", "kl.topk_from=anchor"])
    assert (cfg.anchor.source, cfg.anchor.dtype, cfg.kl.topk_from, cfg.derived.loads_anchor) == ("teacher", "bfloat16", "anchor", True)


# ------------------------------------------------------------------------------------------ where q comes from
def test_topk_from_picks_q():
    from emapg_cli.kl import topk_source

    # the default rule, unchanged: sampling policy for reverse, anchor for forward; kl.topk_from overrides it
    assert (topk_source("reverse"), topk_source("forward")) == ("sampling", "anchor")
    assert (topk_source("reverse", "anchor"), topk_source("forward", "sampling")) == ("anchor", "sampling")
    base = ["kl.estimator=topk", "kl.k=4", "train.old_logprobs=engine", *TWO_MINI]
    default, sampling, anchor = (settings_of(load_config(overrides=base + extra), 1000)
                                 for extra in ([], ["kl.topk_from=sampling"], ["kl.topk_from=anchor"]))
    # reverse, default = sampling: q is the engine's recorded top-k (k = 4 ids recorded per token)
    assert default == sampling and (default.q_from, default.engine_topk) == ("engine", 4)
    # anchor: q is gathered in the anchor's pass; the engine records no top-k (the sampling policy's is not used)
    assert (anchor.q_from, anchor.engine_topk, anchor.anchor_pass) == ("anchor", 0, True)
    fwd = settings_of(load_config(overrides=base + ["kl.direction=forward", "kl.topk_from=sampling"]), 1000)
    assert (fwd.q_from, fwd.engine_topk) == ("engine", 4)


def test_anchor_q_is_the_anchors_top_k():
    """reference_passes with kl.topk_from=anchor: q_index is the anchor's own top-k even when the batch carries the
    engine's (sampling policy's) recorded ids, and ref_logp_q are the anchor's log-probs there."""
    from emapg_cli.train.passes import reference_passes
    from emapg_cli.train.rollout import RolloutBatch

    torch.manual_seed(0)
    V, k, B, P, R = 6, 2, 1, 1, 2
    table = torch.randn(V, V)  # "anchor": logits of the next token depend on the current token only

    class Anchor(torch.nn.Module):
        def forward(self, input_ids, attention_mask, prompt_len, response_mask, q_index=None, topk=0, **kw):
            from emapg_cli.train.logprobs import TokenStats

            logits = table[input_ids[:, P - 1:-1]]  # [B, R, V] predicting each response token
            logp = logits.log_softmax(-1)
            top = logp.topk(topk, -1).indices if topk else None  # [B, R, k]
            idx = top if q_index is None else q_index
            return TokenStats(logp=logp.gather(-1, input_ids[:, P:, None])[..., 0], topk_index=top,
                              logp_q=logp.gather(-1, idx), entropy=None)

    ids = torch.tensor([[1, 4, 2]])
    engine_q = torch.tensor([[[0, 1], [0, 1]]])  # what the engine recorded: not the anchor's top-2
    batch = RolloutBatch(input_ids=ids, attention_mask=torch.ones_like(ids), prompt_len=P, response_mask=torch.ones(B, R),
                         advantages=torch.zeros(B), sampling_logp=torch.zeros(B, R), q_index=engine_q)
    cfg = load_config(overrides=["kl.estimator=topk", f"kl.k={k}", "kl.topk_from=anchor", "train.old_logprobs=engine",
                                 "train.pack_sequences=never", "train.share_prompts=never", *TWO_MINI])
    out = reference_passes(None, Anchor(), batch, settings_of(cfg, V))
    want = table[ids[:, :-1]].log_softmax(-1).topk(k, -1).indices  # [1, 2, 2] the anchor's top-2 after tokens 1 and 4
    assert torch.equal(out.q_index, want) and not torch.equal(out.q_index, engine_q)
    assert torch.equal(out.ref_logp_q, table[ids[:, :-1]].log_softmax(-1).gather(-1, want))


# ------------------------------------------------------------------------------------------ vocabulary / tokenizer
def test_another_vocabulary_fails_at_config_time(tiny_qwen2, tmp_path):
    """A teacher whose vocabulary has 20 more ids (a tokenizer with 20 merges): exit 2, one line naming both sizes,
    before any weights load (the teacher folder has no weights at all here, so loading them would fail otherwise)."""
    from emapg_cli.models.tiny import build_byte_tokenizer, build_tiny_model

    tok = build_byte_tokenizer(corpus=["12 + 34 = 46"] * 20, vocab_size=259 + 20)
    other = tmp_path / "other"
    build_tiny_model(tok).save_pretrained(other)
    tok.save_pretrained(other)
    for weights in other.glob("*.safetensors"):
        weights.unlink()
    data = write_dataset(tmp_path / "train.jsonl")
    started = time.time()
    r = run(train_cmd(*teacher_opts(tiny_qwen2, other, data, 2), "--out", str(tmp_path / "run")))
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"has {len(tok)} ids and the policy's (model.path) 259" in lines[0], lines
    assert time.time() - started < 60 and not (tmp_path / "run" / "checkpoints").exists()


def test_another_tokenizer_of_the_same_size_is_refused(tiny_qwen2, tmp_path):
    """Same vocab_size in config.json, but token -> id maps that differ (two ids swapped): refused, one line."""
    from emapg_cli.train.teacher import check_teacher

    other = tmp_path / "other"
    shutil.copytree(tiny_qwen2, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    cfg = load_config(overrides=[f"model.path={tiny_qwen2}", "anchor.source=teacher", f"anchor.path={other}"])
    check_teacher(cfg.anchor.model_copy(update={"path": str(tiny_qwen2)}), cfg.model, 259)  # itself: accepted
    with pytest.raises(UserError, match="differs from the policy's .* token -> id map") as e:
        check_teacher(cfg.anchor, cfg.model, 259)
    assert "\n" not in str(e.value)


def test_resume_refuses_a_changed_teacher(tiny_teacher, tmp_path):
    from emapg_cli.train.teacher import check_same_teacher, load_teacher, teacher_fingerprint

    cfg = load_config(overrides=["anchor.source=teacher", f"anchor.path={tiny_teacher}"])
    teacher = load_teacher(cfg.anchor, cfg.model)
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training
    saved = {"path": str(tiny_teacher), "sha256": teacher_fingerprint(tiny_teacher)}
    check_same_teacher(saved, teacher, tmp_path / "step_1")  # the same teacher: accepted
    with pytest.raises(UserError, match="changed since"):
        check_same_teacher({**saved, "sha256": "0" * 64}, teacher, tmp_path / "step_1")
    with pytest.raises(UserError, match="EMA anchor run"):
        check_same_teacher(None, teacher, tmp_path / "step_1")
    # the fingerprint sees a one-byte change of a small file
    copy = tmp_path / "copy"
    shutil.copytree(tiny_teacher, copy)
    weights = next(copy.glob("*.safetensors"))
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 1
    weights.write_bytes(bytes(raw))
    assert teacher_fingerprint(copy) != saved["sha256"]


# ------------------------------------------------------------------------------------------ training
@pytest.fixture(scope="module")
def teacher_runs(tiny_qwen2, tiny_teacher, tmp_path_factory) -> dict:
    """tests/test_resume.py's runs with a bfloat16 teacher and q from it (kl.topk_from=anchor), 3 steps, both at once:
    a uninterrupted; b killed (SIGKILL) once its first checkpoint is complete, then resumed (the teacher re-loaded from
    its path, its fingerprint checked). Shared by the two tests below (one set of runs: CI time)."""
    tmp_path = tmp_path_factory.mktemp("teacher_runs")
    before = tree_hash(tiny_teacher)
    data = write_dataset(tmp_path / "train.jsonl")
    opts = teacher_opts(tiny_qwen2, tiny_teacher, data, 3, **{"kl.topk_from": "anchor", "anchor.dtype": "bfloat16"})
    a, b = killed_and_resumed(opts, tmp_path)
    return {"a": a, "b": b, "teacher_before": before}


def test_teacher_never_changes(teacher_runs, tiny_teacher):
    """After the runs the teacher's folder is byte-identical; the in-memory anchor's weights at the end of each run
    hash (summary's anchor_sha256_per_rank) to the teacher as loaded from disk in bfloat16 before any step; no anchor is
    saved (checkpoints, final/); checkpoints and summary name the teacher; no ema/* metric is logged (it never moves)."""
    from emapg_cli.models.loading import load_causal_lm
    from emapg_cli.train.parallel import state_hash
    from emapg_cli.train.teacher import teacher_fingerprint

    assert tree_hash(tiny_teacher) == teacher_runs["teacher_before"]
    loaded = state_hash(load_causal_lm(str(tiny_teacher), torch.bfloat16).state_dict())
    record = {"path": str(tiny_teacher), "sha256": teacher_fingerprint(tiny_teacher)}
    for name in "ab":
        run_dir = teacher_runs[name]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["anchor_sha256_per_rank"] == [loaded] and summary["teacher"] == record
        assert not (run_dir / "final" / "anchor").exists() and (run_dir / "final" / "policy").is_dir()
        for folder in (run_dir / "checkpoints").iterdir():
            assert not (folder / "anchor.pt").exists()
            assert json.loads((folder / "state.json").read_text())["teacher"] == record
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
        assert len(rows) == 3 and all(not any(key.startswith("ema/") for key in row) for row in rows)
        assert all(row["kl/value"] != 0 for row in rows)  # the KL term is on, towards the teacher


def test_teacher_run_sigkill_and_resume_is_bit_identical(teacher_runs):
    """The killed and resumed run's final policy and logged numbers equal the uninterrupted run's."""
    a, b = load_weights(teacher_runs["a"] / "final" / "policy"), load_weights(teacher_runs["b"] / "final" / "policy")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = {name: [json.loads(line) for line in (teacher_runs[name] / "metrics.jsonl").read_text().splitlines()] for name in "ab"}
    assert [r["step"] for r in rows["b"]] == [0, 1, 2, 3]
    for key in ("reward/mean", "loss/pg", "loss/kl", "kl/value", "grad/norm"):
        assert [r.get(key) for r in rows["a"]] == [r.get(key) for r in rows["b"]], key


def test_fsdp_on_several_processes_is_refused_at_launch():
    from emapg_cli.train.preflight import launch_problems

    cfg = load_config(overrides=["anchor.source=teacher", "anchor.path=/x", "train.parallel=fsdp"])
    assert [p for p in launch_problems(cfg, 2) if "anchor.source=teacher" in p]
    assert launch_problems(cfg, 1) == []  # one process: plain single-device training


def test_removed_support_renorm():
    """kl.support_renorm is gone (false was teacher_support_raw, which `train` refuses: tests/test_training_numerics.py):
    a run's config.yaml holding true still loads; false is the one-line error naming the removal."""
    from emapg_cli.config.loading import validate

    assert validate({"kl": {"support_renorm": True}}).kl == load_config().kl
    with pytest.raises(UserError, match="kl.support_renorm is gone"):
        validate({"kl": {"support_renorm": False}})