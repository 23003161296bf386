#!/usr/bin/env python
"""One prepared check of the vLLM engine on a CUDA machine with `emapg[vllm]` installed.

    python scripts/gpu_check.py [--out gpu_check.json]

1. builds a tiny Qwen2 model locally (emapg_cli.models.tiny.save_tiny; nothing is downloaded);
2. generates with VLLMEngine and times it against bare `LLM.generate` on the same requests
   (overhead %), checks group shapes, distinct samples, log-probs, seed determinism, and that
   vLLM's sampled log-probs match the transformers model's on the same tokens;
3. perturbs the weights in a transformers copy, pushes them with load_weights (through sleep
   mode), and checks that greedy output changes and matches transformers' greedy output;
4. runs `emapg eval --backend vllm` on a few items when the eval command exists.
Prints one line per measurement and a JSON summary; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed(fn, repeats: int) -> float:
    """Median wall time of `repeats` calls of fn (seconds), after CUDA work is done."""
    import torch

    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def hf_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """transformers' log-probability of each completion token given the prompt (fp32)."""
    import torch

    ids = torch.tensor([prompt + completion], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [T, V]
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, torch.tensor(completion, device="cuda")[:, None])[:, 0].tolist()


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: int) -> list[int]:
    import torch

    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos)
    new = out[0, len(prompt):].tolist()
    return new[: new.index(eos) + 1] if eos in new else new


def run_eval(model_path: Path, work: Path) -> dict:
    """`emapg eval --backend vllm` on 4 items, if the command exists (its output tail is reported)."""
    cli = [sys.executable, "-m", "emapg_cli"]
    help_ = subprocess.run([*cli, "eval", "--help"], capture_output=True, text=True)
    if help_.returncode != 0:
        return {"status": "skipped: no eval command"}
    data = work / "eval.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "question": f"What is {i} + {i}?", "answers": [str(2 * i)]}) + "\n" for i in range(4)))
    cmd = [*cli, "eval", "--model", str(model_path), "--bench", str(data), "--backend", "vllm", "--set", "data.eval_limit=4"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return {"status": "ok" if proc.returncode == 0 else f"failed rc={proc.returncode}", "wall_s": round(time.perf_counter() - t0, 1),
            "command": " ".join(cmd[2:]), "tail": (proc.stdout + proc.stderr)[-1500:],
            "help": None if proc.returncode == 0 else help_.stdout[-1500:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="Also write the JSON summary here.")
    parser.add_argument("--prompts", type=int, default=64, help="Prompts per generate call.")
    parser.add_argument("--n", type=int, default=8, help="Samples per prompt.")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="Tokens per sample.")
    parser.add_argument("--repeats", type=int, default=5, help="Timed repeats (median).")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from emapg_cli.engines.base import SamplingParams
    from emapg_cli.engines.vllm import VLLMEngine, sampling_kwargs
    from emapg_cli.models.tiny import save_tiny

    summary: dict = {"device": torch.cuda.get_device_name(0)}
    failures: list[str] = []

    def check(name: str, ok: bool, value) -> None:
        summary[name] = value
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {value}", flush=True)
        if not ok:
            failures.append(name)

    work = Path(tempfile.mkdtemp(prefix="emapg-gpu-check-"))
    # head_dim 64 (256 / 4 heads): a size every vLLM attention backend supports.
    path = save_tiny(work / "tiny", arch="qwen2", hidden=256, layers=2, heads=4, kv_heads=2, max_positions=2048)
    tok = AutoTokenizer.from_pretrained(path)
    texts = [tok.apply_chat_template([{"role": "user", "content": f"What is {i} + {i + 1}?"}], tokenize=False, add_generation_prompt=True)
             for i in range(args.prompts)]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]

    # ---- 2. generation and overhead
    import vllm
    from vllm.inputs import TokensPrompt

    summary["vllm_version"] = vllm.__version__
    t0 = time.perf_counter()
    engine = VLLMEngine(str(path), dtype="float32", gpu_memory_utilization=0.3, seed=0, max_model_len=1024)
    check("startup_s", True, round(time.perf_counter() - t0, 1))
    params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0, seed=1)
    groups = engine.generate(prompts, params)  # warm-up (and the checked output)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    sampling = [vllm.SamplingParams(**sampling_kwargs(params, i)) for i in range(len(prompts))]
    bare = timed(lambda: engine.llm.generate(requests, sampling, use_tqdm=False), args.repeats)
    ours = timed(lambda: engine.generate(prompts, params), args.repeats)
    tokens = sum(len(c.token_ids) for g in groups for c in g)
    check("bare_generate_s", True, round(bare, 4))
    check("engine_generate_s", True, round(ours, 4))
    check("engine_overhead_pct", (ours - bare) / bare < 0.10, round(100 * (ours - bare) / bare, 2))
    check("tokens_per_s", True, round(tokens / ours))
    check("group_shapes", [len(g) for g in groups] == [args.n] * len(prompts), f"{len(groups)} x {args.n}")
    distinct = statistics.mean(len({tuple(c.token_ids) for c in g}) / args.n for g in groups)
    check("distinct_samples_per_group", distinct > 0.9, round(distinct, 3))
    lp_ok = all(c.logprobs is not None and len(c.logprobs) == len(c.token_ids) and all(math.isfinite(x) and x <= 0 for x in c.logprobs)
                for g in groups for c in g)
    check("logprobs_present_finite", lp_ok, lp_ok)
    again = engine.generate(prompts[:4], params)
    check("same_seed_same_samples", [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in groups[:4]], "compared 4 groups")
    other = engine.generate(prompts[:4], SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, seed=2))
    check("other_seed_other_samples", [[c.token_ids for c in g] for g in other] != [[c.token_ids for c in g] for g in groups[:4]], "compared 4 groups")

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    diffs = [abs(a - b) for p, g in zip(prompts[:8], groups[:8]) for c in g[:2]
             for a, b in zip(c.logprobs, hf_logprobs(model, p, c.token_ids))]
    check("logprob_vs_hf_mean_abs", statistics.mean(diffs) < 1e-2, f"{statistics.mean(diffs):.2e} (max {max(diffs):.2e}, {len(diffs)} tokens)")

    # ---- 3. weight push through sleep mode
    greedy = SamplingParams(n=1, max_new_tokens=32, temperature=0.0)
    before = [g[0].token_ids for g in engine.generate(prompts[:8], greedy)]
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * p.std() * torch.randn_like(p))
    free0 = torch.cuda.mem_get_info()[0]
    engine.release_memory()
    freed = (torch.cuda.mem_get_info()[0] - free0) / 2**30
    check("sleep_freed_gib", freed > 1, round(freed, 2))
    t0 = time.perf_counter()
    engine.load_weights(model)
    check("load_weights_s", True, round(time.perf_counter() - t0, 3))
    engine.resume_memory()
    after = [g[0].token_ids for g in engine.generate(prompts[:8], greedy)]
    changed = sum(a != b for a, b in zip(after, before)) / len(after)
    check("greedy_changed_after_push", changed > 0.5, changed)
    hf = [hf_greedy(model, p, 32, tok.eos_token_id) for p in prompts[:8]]
    match = sum(a == b for a, b in zip(after, hf)) / len(after)
    check("greedy_matches_hf_after_push", match >= 0.75, match)

    # ---- 4. eval through the CLI
    engine.release_memory()  # the eval subprocess starts its own engine on this GPU
    torch.cuda.empty_cache()
    summary["eval"] = run_eval(path, work)
    print("eval:", json.dumps(summary["eval"], indent=2), flush=True)

    summary["failures"] = failures
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
