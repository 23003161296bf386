"""`train.micro_batch_size: auto`: the largest micro-batch whose update peak, in the memory plan (`train/plan.py`),
fits the memory measured as the run starts.

The plan's update peak (`memory_terms`: the state, plus activations, logits chunks and gradients that grow with the
micro-batch b) is evaluated at the run's measured sequence length: the longest tokenised training prompt plus the
response budget (single-turn runs), or the context limit of a multi-turn environment, agent or the search agent
(their observations are not known in advance). The budget is what the device has free as the run starts (a CUDA
device: `torch.cuda.mem_get_info`; a CPU: the host's MemAvailable), less `HEADROOM` for what the plan does not count
(the allocator's fragmentation, the Python process, the tokenizer). The micro-batch is then capped at the sequences
of one mini-batch (more would not change the update) and is at least 1. Under several processes every rank takes
the smallest rank's choice, so they run the same number of micro-batches.

The plan is an upper bound on CPU (docs/performance.md: the smol step's peak RSS 8.3 GiB against a planned 24.9
GiB at the worst-case length): `auto` errs towards smaller micro-batches, never towards an out-of-memory kill.
"""

from __future__ import annotations

from typing import Any, Optional

#: The share of the measured free memory left out of the budget (what the plan does not count).
HEADROOM = 0.1


def memory_budget(device) -> tuple[int, str]:
    """(bytes the update may plan for, where the number came from), measured now on `device`."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * (1 - HEADROOM)), "free CUDA memory"
    return int(mem_available() * (1 - HEADROOM)), "MemAvailable"


def mem_available(meminfo: str = "/proc/meminfo") -> int:
    """The host's MemAvailable in bytes (Linux); a host without /proc/meminfo: os.sysconf's physical pages."""
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def run_sequence_length(cfg, train_prompts: list[list[int]]) -> int:
    """The measured T of the plan: the longest training prompt plus the response budget for a single-turn run; the
    plan's own T (a context limit) for a multi-turn one."""
    from emapg_cli.train.plan import sequence_length

    planned, max_turns, _ = sequence_length(cfg)
    single = not cfg.search.enabled and cfg.rollout.agent is None and cfg.rollout.env == "single"
    if not single or not train_prompts:
        return planned
    return min(planned, max(map(len, train_prompts)) + max_turns * cfg.rollout.max_new_tokens)


def resolve(cfg, model_config: dict[str, Any], train_prompts: list[list[int]], device, processes: int = 1,
            agree=None) -> tuple[Any, Optional[str]]:
    """(cfg with an integer train.micro_batch_size, the line that says how `auto` was resolved, or None when the
    config gave a number). `agree(b) -> b`: the smallest b over the ranks (None: one process)."""
    if cfg.train.micro_batch_size != "auto":
        return cfg, None
    from emapg_cli.train.plan import ModelShapes, fitting_micro_batch

    budget, source = memory_budget(device)
    seq_len = run_sequence_length(cfg, train_prompts)
    b = fitting_micro_batch(cfg, ModelShapes.from_hf_config(model_config), seq_len, budget, processes)
    if agree is not None:
        b = agree(b)
    line = (f"train.micro_batch_size auto: {b} (the memory plan's update peak at T = {seq_len:,} tokens within "
            f"{budget / 2**30:,.1f} GiB: {1 - HEADROOM:.0%} of the {source} as the run started)")
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"micro_batch_size": b})}), line
