"""Readers (issue 20): plot's metrics.jsonl / summary.json checks, kl-check's .npz headers, bench's memory
lower bound, lora.r's bounds, ids past Python's 4300-digit limit, ragged --responses."""

from __future__ import annotations

import io
import json
import zipfile
from types import SimpleNamespace

import numpy as np
import pytest
from torch import nn

from emapg_cli.errors import UserError


# ---- plot: metrics.jsonl rows are skipped and counted, summary.json is refused


def test_metric_rows_skipped_counted_and_last_of_a_step_kept(tmp_path):
    from emapg_cli.plots.rows import read_metric_rows

    lines = [b'\xef\xbb\xbf{"step": 0, "reward/mean": 0.5}',  # BOM: read, not skipped
             b'[1, 2]', b'{"step": -1}', b'{"step": true}', b'{"step": 1.0}', b'{"step": 1e400}',  # 5 skipped
             b'{"step": ' + b"9" * 5000 + b'}', b'{"step": 1, "x": "\xff"}',  # 2 more: 7 skipped, first at line 2
             b'{"step": 1, "reward/mean": 0.1, "kl/value": "0.2", "entropy": true, "clip/frac": 1e400}',
             b'{"step": 1, "reward/mean": 0.2}',  # step 1 again: 1 repeat, this row kept
             b'', b'{"step": 2, "reward/mean": 0.3']  # a cut last line: the 8th skipped row
    (tmp_path / "metrics.jsonl").write_bytes(b"\n".join(lines))
    read = read_metric_rows(tmp_path / "metrics.jsonl")
    assert read.rows == [{"step": 0, "reward/mean": 0.5}, {"step": 1, "reward/mean": 0.2}]
    assert sum(read.skipped.values()) == 8 and read.first_skipped == 2 and read.repeated == 1
    assert read.skipped["no integer step >= 0"] == 4  # -1, true, 1.0, 1e400 (inf)
    assert read.skipped["not JSON"] == 2 and read.skipped["not UTF-8"] == 1 and read.skipped["not a JSON object"] == 1
    assert "skipped 8 unreadable row(s)" in read.note(tmp_path / "metrics.jsonl")


@pytest.mark.parametrize("text, needle", [
    ('["pass@1"]', "JSON object"), ('{"pass@x": 0.5}', "positive integer"), ('{"pass@1": 1.5}', "[0, 1]"),
    ('{"pass@1": true}', "pass@1"), ('{"maj@n": "0.5"}', "maj@n"), ('{"subsets": [1]}', "subsets must be an object"),
    ('{"sources": {"a": {"avg@n": 0.5, "num_items": -1}}}', "num_items"), ('{"pass@1": 1' + "0" * 5000 + "}", "integer"),
])
def test_bad_summary_is_one_line(tmp_path, text, needle):
    from emapg_cli.plots.rows import read_summary

    (tmp_path / "summary.json").write_text(text)
    with pytest.raises(UserError, match=None) as e:
        read_summary(tmp_path / "summary.json")
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_good_summary_reads(tmp_path):
    from emapg_cli.plots.rows import read_summary

    s = {"n": 4, "pass@1": 0.5, "pass@4": 0.75, "maj@n": None, "subsets": {"a": {"avg@n": 0.5, "num_items": 2}}}
    (tmp_path / "summary.json").write_text(json.dumps(s))
    assert read_summary(tmp_path / "summary.json") == s


# ---- kl-check: shapes, dtypes and member sizes from the .npy headers


def _npz(tmp_path, members: dict[str, bytes]):
    path = tmp_path / "l.npz"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _header(shape, descr="<f8") -> bytes:
    from numpy.lib import format as npy

    buf = io.BytesIO()
    npy.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def test_npz_shape_from_headers(tmp_path):
    from emapg_cli.klcheck.distributions import npz_shape

    path = tmp_path / "ok.npz"
    np.savez_compressed(path, policy=np.zeros((3, 5)), anchor=np.zeros((3, 5), np.float32), other=np.zeros(7, int))
    assert npz_shape(path) == (3, 5)
    # the header declares [4096, 4096] float64 = 134,217,728 bytes; the member holds the 128-byte header + 16
    lie = _npz(tmp_path, {"policy.npy": _header((4096, 4096)) + bytes(16), "anchor.npy": _header((4096, 4096)) + bytes(16)})
    with pytest.raises(UserError, match=r"declares shape \(4096, 4096\) of float64 \(134,217,856 bytes with its header\) but its zip member holds 144 bytes"):
        npz_shape(lie)
    obj = _npz(tmp_path, {"policy.npy": _header((1, 2), "|O") + b"\x80\x02N.", "anchor.npy": _header((1, 2)) + bytes(16)})
    with pytest.raises(UserError, match="'policy' must hold floats, got object"):
        npz_shape(obj)
    mismatch = _npz(tmp_path, {"policy.npy": _header((1, 2)) + bytes(16), "anchor.npy": _header((2, 2)) + bytes(32)})
    with pytest.raises(UserError, match=r"'anchor' has shape \(2, 2\) but 'policy' has \(1, 2\)"):
        npz_shape(mismatch)
    (tmp_path / "cut.npz").write_bytes(path.read_bytes()[:50])
    with pytest.raises(UserError, match="not a zip file"):
        npz_shape(tmp_path / "cut.npz")


# ---- bench: the memory lower bound


def test_bench_least_bytes_arithmetic():
    from emapg_cli.bench.head import least_bytes

    # T 10, H 4, V 100, k 3, chunk 8, float32 (s = 4):
    #   update: (10 + 100) * 4 * (4 + 4 + 3 * 4) = 440 * 20 = 8,800; logits 8 * 100 * 4 = 3,200; q 10 * 3 * 12 = 360
    assert least_bytes(10, 4, 100, 3, 8, "float32", update=True) == 8_800 + 3_200 + 360
    #   passes (no gradients): 440 * 8 = 3,520; chunk 64 > T: 10 * 100 * 4 = 4,000; 360
    assert least_bytes(10, 4, 100, 3, 64, "float32", update=False) == 3_520 + 4_000 + 360


# ---- lora.r


def test_lora_rank_bounds():
    from emapg_cli.config import Config
    from emapg_cli.train.lora import add_adapters
    from emapg_cli.train.plan import ModelShapes, check_lora_rank

    with pytest.raises(ValueError, match="less than or equal to 4096"):
        Config.model_validate({"lora": {"r": 4097}})
    shapes = ModelShapes.from_hf_config({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 259})
    check_lora_rank(shapes, 32, ["q_proj", "k_proj"])  # k_proj: 64 -> 2 kv heads x 16 = 32: r = 32 is its full rank
    with pytest.raises(UserError, match=r"lora.r = 33 exceeds .* \(k_proj: 64 -> 32\); use lora.r <= 32"):
        check_lora_rank(shapes, 33, ["q_proj", "k_proj"])
    model = nn.ModuleDict({"q_proj": nn.Linear(64, 64), "k_proj": nn.Linear(64, 32)})
    with pytest.raises(UserError, match=r"\(k_proj: 64 -> 32\); use lora.r <= 32"):  # at model build, before peft
        add_adapters(model, SimpleNamespace(r=33, target_modules=["q_proj", "k_proj"], alpha=16.0, dropout=0.0))


# ---- ids and responses


def test_int_past_the_digit_limit_is_one_line(tmp_path):
    from emapg_cli.data.schema import read_jsonl

    (tmp_path / "b.jsonl").write_text('{"id": 1}\n{"id": ' + "9" * 5000 + "}\n")
    with pytest.raises(UserError, match=r"b.jsonl:2: holds an integer of more than 4300 digits"):
        list(read_jsonl(tmp_path / "b.jsonl"))


def test_ragged_responses_refused(tmp_path):
    from emapg_cli.data.schema import Example
    from emapg_cli.evaluation.runner import load_responses

    examples = [Example(id=str(i), question="q", answers=["1"]) for i in range(3)]
    (tmp_path / "r.jsonl").write_text(json.dumps({"id": "0", "responses": ["a", "b"]}) + "\n"
                                      + json.dumps({"id": "1", "responses": ["a", "b"]}) + "\n"
                                      + json.dumps({"id": "2", "responses": ["a"]}) + "\n")
    with pytest.raises(UserError, match=r"r.jsonl:3: 1 responses, but the first row has 2"):
        load_responses(tmp_path / "r.jsonl", examples)
