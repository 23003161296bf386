"""Keep transformers' and the hub's own progress bars ("Loading weights", "Writing model shards")
out of emapg's output, which draws its own bars."""

from __future__ import annotations

import os


def quiet_transformers() -> None:
    """Turn off transformers' and huggingface_hub's tqdm bars for this process (and its children)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging

    logging.disable_progress_bar()
