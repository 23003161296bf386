"""How often the base SmolLM2-135M answers in reasoning-gym's format, and correctly, under each chat prefix
(docs/smol.md, "The answer format"): greedy and sampled (4 per item), on the first N held-out items of the smol
preset's tasks (seed 1, the preset's test seed).

    python docs/evidence/smol_prompt_scan.py --prefixes none,one,one_instructed,two --items 48 --temperature 0.7

Prints one JSON line per (prefix, task): greedy format rate and accuracy, sampled format rate and accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import time

QUESTION = "{question}\nAnswer with <answer>...</answer> and nothing else."  # datasets/reasoning_gym_data.py's template
FRANCE, WEEK = "What is the capital of France?", "How many days are in a week?"
PREFIXES = {
    "none": [],
    "one": [{"role": "user", "content": FRANCE}, {"role": "assistant", "content": "<answer>Paris</answer>"}],
    "one_week": [{"role": "user", "content": WEEK}, {"role": "assistant", "content": "<answer>7</answer>"}],
    # the preset's: the demonstration asked with the same instruction as the rows
    "one_instructed": [{"role": "user", "content": QUESTION.format(question=FRANCE)},
                       {"role": "assistant", "content": "<answer>Paris</answer>"}],
    "two": [{"role": "user", "content": FRANCE}, {"role": "assistant", "content": "<answer>Paris</answer>"},
            {"role": "user", "content": WEEK}, {"role": "assistant", "content": "<answer>7</answer>"}],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.expandvars("$EMAPG_HOME/smol/model"), help="The prepared model folder.")
    ap.add_argument("--prefixes", default=",".join(PREFIXES), help=f"Comma-separated, of: {', '.join(PREFIXES)}.")
    ap.add_argument("--items", type=int, default=48, help="Held-out items per task.")
    ap.add_argument("--temperature", type=float, default=0.7, help="Temperature of the sampled answers.")
    ap.add_argument("--threads", type=int, default=2, help="torch threads.")
    args = ap.parse_args()

    import reasoning_gym as rg
    import torch
    from reasoning_gym.utils import extract_answer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from emapg_cli.engines.base import SamplingParams
    from emapg_cli.engines.hf import HFEngine
    from emapg_cli.toy.smol_prepare import TASKS, TEST_SEED

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32), tok, batch_size=64)
    for name in args.prefixes.split(","):
        for task, config in TASKS:
            data = rg.create_dataset(task, size=args.items, seed=TEST_SEED, **config)
            entries = list(data)
            prompts = [tok(tok.apply_chat_template(PREFIXES[name] + [{"role": "user", "content": QUESTION.format(question=e["question"])}],
                                                   add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"]
                       for e in entries]
            start = time.perf_counter()
            greedy = engine.generate(prompts, SamplingParams(n=1, max_new_tokens=16, temperature=0.0))
            sampled = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=16, temperature=args.temperature))

            def rates(groups):
                answers = [(extract_answer(s.text), e) for e, g in zip(entries, groups) for s in g]
                return (sum(a is not None for a, _ in answers) / len(answers),
                        sum(data.score_answer(a, e) >= 1 for a, e in answers) / len(answers))

            (gf, ga), (sf, sa) = rates(greedy), rates(sampled)
            print(json.dumps({"prefix": name, "task": task, "greedy_format": round(gf, 3), "greedy_accuracy": round(ga, 3),
                              "sampled_format": round(sf, 3), "sampled_accuracy": round(sa, 3),
                              "s": round(time.perf_counter() - start, 1)}), flush=True)


if __name__ == "__main__":
    main()
