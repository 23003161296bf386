"""A local model folder checked before anything loads it: the one check behind model.path (the policy and its EMA
anchor), anchor.path (a teacher), `kl-check --model/--anchor-model`, `eval --model` and `rollout serve --model`
(through `hub.check_model_source`) and every `loading.load_causal_lm` (docs/reliability.md, "Model folders").

A folder a user points at may be broken or tampered with: its config.json a list, null, not UTF-8, with a string
vocab_size; its safetensors cut short or zeroed; a symbolic link loop. Each is one line (UserError) naming the
folder and the file, from config.json and the safetensors headers alone (kilobytes: no tensor is read). A
pytorch_model.bin is a pickle: transformers loads it with torch.load(weights_only=True), which refuses one that holds
anything but tensors (loading it could run code); `loading()` turns that refusal, and transformers' own refusal of
a config field of the wrong type, into one line as well.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import json
import math
import os
import stat
from pathlib import Path
from typing import Any, Iterator, Optional

from emapg_cli.errors import UserError, first_line
from emapg_cli.paths import expand

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLED = "pytorch_model.bin"
#: config.json and the shard index are read whole: larger ones are refused.
MAX_JSON_BYTES = 16 << 20
#: safetensors' own limit on the JSON header at the start of the file.
MAX_HEADER_BYTES = 100 << 20
#: Bytes per element of the safetensors dtypes (a dtype not listed is not size-checked).
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "C64": 8}


def _why(e: OSError) -> str:
    return "a symbolic link loop" if e.errno == errno.ELOOP else (e.strerror or type(e).__name__)


def _stat(path: Path, what: str) -> Optional[os.stat_result]:
    """`path`'s stat (following links), None when nothing is there; a link loop or an unreadable path is a UserError."""
    if not os.path.lexists(path):
        return None
    try:
        return path.stat()
    except OSError as e:
        raise UserError(f"{what} {path}: {_why(e)}") from None


def local_folder(path: str, what: str) -> Optional[Path]:
    """The local folder `path` names (~ and $EMAPG_HOME expanded); None when nothing is there (a hub id, or a missing
    path: the callers say which). A symbolic link loop, or a file where the folder belongs, is a UserError."""
    folder = expand(path)
    st = _stat(folder, what)
    if st is None:
        return None
    if not stat.S_ISDIR(st.st_mode):
        raise UserError(f"{what} {folder}: not a folder (a model is a save_pretrained folder with {CONFIG})")
    return folder


def _read_json(path: Path, what: str) -> Any:
    """A small JSON file, read whole: one UserError line when it is too large, not UTF-8 or not JSON."""
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise UserError(f"{what} {path}: larger than {MAX_JSON_BYTES >> 20} MiB")
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{what} {path}: not UTF-8 text") from None
    except (ValueError, RecursionError) as e:  # not JSON, nested too deeply, an integer of more than 4300 digits
        raise UserError(f"{what} {path}: not valid JSON ({first_line(e, 120)})") from None
    except OSError as e:
        raise UserError(f"{what} {path}: {_why(e)}") from None


def read_config(folder: Path, what: str) -> dict[str, Any]:
    """`folder`/config.json as a dict, checked: a UTF-8 JSON object whose text_config (when there) is an object and
    whose vocab_size (top level or text_config's, when there) is an integer >= 1; else one UserError line."""
    path = folder / CONFIG
    if _stat(path, what) is None:
        raise UserError(f"{what} {folder}: no {CONFIG} (a model folder is save_pretrained's layout)")
    config = _read_json(path, what)
    if not isinstance(config, dict):
        raise UserError(f"{what} {path}: a JSON {type(config).__name__ if config is not None else 'null'}, not an object")
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise UserError(f"{what} {path}: text_config is not an object")
    for key, section in (("vocab_size", config), ("text_config.vocab_size", text or {})):
        v = section.get("vocab_size", 1)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UserError(f"{what} {path}: {key} is {json.dumps(v)[:40]}, not an integer >= 1")
    return config


def _tensor_bytes(name: str, entry: Any, where: str) -> tuple[int, int]:
    """(start, end) of one tensor's bytes in a safetensors data section, its entry checked (UserError)."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    shape = entry.get("shape") if isinstance(entry, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)
            and offsets[0] <= offsets[1] and isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise UserError(f"{where}: tensor {name[:80]!r} has no valid shape and data_offsets")
    size = DTYPE_BYTES.get(entry.get("dtype"))
    if size is not None and math.prod(shape) * size != offsets[1] - offsets[0]:
        raise UserError(f"{where}: tensor {name[:80]!r} of shape {shape} ({entry['dtype']}) spans {offsets[1] - offsets[0]:,} "
                        f"bytes, not {math.prod(shape) * size:,}")
    return offsets[0], offsets[1]


def check_safetensors(path: Path, what: str) -> None:
    """`path`'s safetensors header against the file's size, reading the header only: one UserError line for a file
    cut short, zeroed or not safetensors (the format: an 8-byte little-endian header length, a JSON header of
    {name: {dtype, shape, data_offsets}}, then the tensors' bytes, every byte belonging to one tensor)."""
    where = f"{what} {path}"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 2 <= n <= min(MAX_HEADER_BYTES, size - 8):
                raise UserError(f"{where}: not a complete safetensors file ({size:,} bytes; its header length field "
                                f"says {max(n, 0):,}): cut short, zeroed or another format")
            raw = f.read(n)
    except OSError as e:
        raise UserError(f"{where}: {_why(e)}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        header = None
    if not isinstance(header, dict):
        raise UserError(f"{where}: its safetensors header is not a JSON object (zeroed, or another format)")
    spans = [_tensor_bytes(name, entry, where) for name, entry in header.items() if name != "__metadata__"]
    data, end = size - 8 - n, max((e for _, e in spans), default=0)
    if end != data:
        raise UserError(f"{where}: holds {data:,} bytes of tensor data where its header lists {end:,} "
                        f"({'cut short' if end > data else 'bytes no tensor owns'})")


def check_weights(folder: Path, what: str) -> None:
    """The weight files transformers would read from `folder` (model.safetensors, or the shards its index lists),
    their headers checked; a weight file that is a link loop is a UserError too. A pickle (pytorch_model.bin) is
    left to torch.load(weights_only=True) (`loading`)."""
    for name in (WEIGHTS, INDEX, PICKLED):
        _stat(folder / name, what)
    if (folder / WEIGHTS).is_file():
        check_safetensors(folder / WEIGHTS, what)
        return
    if not (folder / INDEX).is_file():
        return
    index = _read_json(folder / INDEX, what)
    shards = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(shards, dict) or not all(isinstance(v, str) for v in shards.values()):
        raise UserError(f"{what} {folder / INDEX}: no weight_map of tensor name -> shard file")
    for shard in sorted(set(shards.values())):
        if Path(shard).name != shard or shard in ("", ".", ".."):
            raise UserError(f"{what} {folder / INDEX}: shard {shard[:80]!r} is not a file name in the folder")
        if _stat(folder / shard, what) is None:
            raise UserError(f"{what} {folder}: shard {shard} (listed in {INDEX}) is missing")
        check_safetensors(folder / shard, what)


def check_model_folder(path: str, what: str) -> Optional[Path]:
    """The local model folder `path` names, checked (config.json, the safetensors headers); None when nothing is
    there (a hub id, or a missing path the caller reports). Any problem is one UserError line naming `what`."""
    folder = local_folder(path, what)
    if folder is not None:
        read_config(folder, what)
        check_weights(folder, what)
    return folder


def _library_errors() -> tuple[type[BaseException], ...]:
    """safetensors' error for a file it cannot read, huggingface_hub's for a config field of the wrong type."""
    errors: list[type[BaseException]] = []
    for module, name in (("safetensors", "SafetensorError"), ("huggingface_hub.errors", "StrictDataclassError")):
        try:
            errors.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


@contextlib.contextmanager
def loading(path: str, what: str = "model") -> Iterator[None]:
    """Around transformers loading the model or tokenizer at `path`: what it refuses in a broken folder, as one line
    (a pickle torch.load(weights_only=True) will not load, a config field of the wrong type, safetensors it cannot
    read), never an internal error."""
    import pickle

    broken = _library_errors()
    try:
        yield
    except pickle.UnpicklingError:
        raise UserError(f"{what} {path}: its {PICKLED} is a pickle that holds more than tensors (torch.load with "
                        "weights_only=True refuses it: loading it could run code); use safetensors weights") from None
    except broken as e:
        raise UserError(f"{what} {path}: {first_line(e)}") from None
