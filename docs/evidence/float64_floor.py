"""How far a model's float32 log-probs are from float64 ones (transformers alone), as prepared and after
tests/acceptance/vllm_check.py's perturbation (0.5 x std noise per tensor, seed 0): the rounding floor that any comparison of
two float32 engines on that model sits on (docs/smol.md, "Every path on the real model").

    python docs/evidence/float64_floor.py $EMAPG_HOME/smol/model
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path


def token_logprobs(model, ids: list[int], n: int):
    """log p of the last n tokens of `ids` under `model`, computed in float64 from its logits: [n]."""
    import torch

    from emapg_cli.kl.common import gather_logprobs

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -n - 1:-1].double()  # [n, V]
    return gather_logprobs(logits, torch.tensor(ids[-n:]))


def floor(path: str, m32, prompts: list[list[int]], eos: int) -> list[float]:
    """|float32 − float64| log-prob of 32 sampled tokens after each prompt (the float64 copy holds m32's weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    m64 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    m64.load_state_dict({k: v.double() for k, v in m32.state_dict().items()})
    torch.manual_seed(1)
    diffs: list[float] = []
    for p in prompts:
        with torch.no_grad():
            out = m32.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               do_sample=True, max_new_tokens=32, pad_token_id=eos)
        ids = out[0].tolist()
        n = len(ids) - len(p)
        diffs += (token_logprobs(m32, ids, n) - token_logprobs(m64, ids, n)).abs().tolist()
    return diffs


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from emapg_cli.models.prompts import render_prompt

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "acceptance"))
    from vllm_check import perturb

    path = sys.argv[1]
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(path)
    m32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [render_prompt(tok, f"What is {i} + {i + 1}?") for i in range(8)]  # vllm_check's prompts
    for tag in ("as prepared", "perturbed as vllm_check does"):
        if tag != "as prepared":
            perturb(m32)  # vllm_check's perturbation
        d = floor(path, m32, prompts, tok.eos_token_id)
        print(f"{tag}: float32 vs float64 log-probs: max {max(d):.2e}, mean {statistics.mean(d):.2e} ({len(d)} tokens)")


if __name__ == "__main__":
    main()
