"""Whether a model reference can load before anything tries: a local folder, the Hugging Face cache, or the hub.

Without network and without HF_HUB_OFFLINE, transformers retries a hub id for most of a minute and then fails with
a message that names neither the model nor the fix. `check_model_source` answers in a fraction of a second, before
any download starts: a hub id that is not in the local cache loads only when the hub can be reached (a TCP connect
to HF_ENDPOINT, 3 s at most; skipped behind an HTTP(S) proxy, which transformers then uses), else one line names
the model and asks for a local folder. With HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set, the cache is all there is.
"""

from __future__ import annotations

import os
import socket
from functools import lru_cache
from urllib.parse import urlparse

from emapg_cli.errors import UserError

#: Seconds the hub reachability check may take.
CONNECT_TIMEOUT_S = 3.0

_TRUE = ("1", "ON", "YES", "TRUE")


def offline() -> bool:
    """HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE set to a true value (huggingface_hub's own rule)."""
    return any(os.environ.get(k, "").upper() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def in_cache(repo_id: str) -> bool:
    """The hub id's config.json is in the local Hugging Face cache (False for a string that is no valid hub id)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # noqa: BLE001 - an invalid repo id, an unreadable cache: not cached
        return False


def hub_reachable(timeout: float = CONNECT_TIMEOUT_S) -> bool:
    """A TCP connection to the hub's host opens within `timeout` seconds (True behind a proxy: not ours to test)."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname, url.port or (80 if url.scheme == "http" else 443)
    return True if not host else _connects(host, port, timeout)


@lru_cache(maxsize=8)
def _connects(host: str, port: int, timeout: float) -> bool:
    """One TCP connect per host and process: train asks for the model, its tokenizer and its config in turn."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def path_like(path: str) -> bool:
    """`path` names a local path, not a hub id: it starts with /, ., ~ or $, holds a backslash or more than one /,
    or its one / follows a folder that exists here (`models/x` beside a `models/` folder)."""
    return (path.startswith((".", "/", "~", "$")) or path.count("/") > 1 or "\\" in path
            or ("/" in path and os.path.isdir(path.split("/")[0])))


def check_model_source(path: str, what: str = "model") -> None:
    """Raise one UserError line, fast, when `path` is a hub id (or a bare name) that is neither a local folder, nor in
    the local cache, nor one the hub can serve now (module doc), or a local path (`path_like`) with no folder there.
    A local folder is checked as `folder.check_model_folder` checks it (config.json, the safetensors headers). `what` names the setting in the message (model.path, --model)."""
    from emapg_cli.models.folder import check_model_folder

    if check_model_folder(path, what) is not None or in_cache(path):
        return
    if path_like(path):  # a local path with nothing there, never a hub id (transformers: "Repo id must be ...")
        from emapg_cli.paths import DEFAULT_HOME, expand, prepare_hint

        unset = "" if os.environ.get("EMAPG_HOME") else f"; EMAPG_HOME is unset (emapg's default is {DEFAULT_HOME})"
        raise UserError(f"{what} {expand(path)}: no such model folder{prepare_hint(expand(path))}{unset}")
    why = ("HF_HUB_OFFLINE is set" if offline() else
           None if hub_reachable() else f"the hub ({urlparse(os.environ.get('HF_ENDPOINT') or 'https://huggingface.co').hostname}) cannot be reached")
    if why is not None:
        raise UserError(f"{what} '{path}' is not a local folder nor in the Hugging Face cache, and {why}: pass a local "
                        f"model folder (save_pretrained format), or download it first (huggingface-cli download {path})")
