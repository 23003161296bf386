"""Output folders (emapg_cli.outputs) and the error path under faults: kind markers, locks, concurrent
writers, a full disk, unwritable folders, and an unexpected exception (one line + a traceback file)."""

from __future__ import annotations

import fcntl
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from emapg_cli.errors import UserError
from emapg_cli.outputs import LOCK, MARKER, claim_folder, current_folder

from test_fuzz_cli import run_inprocess, tree


# ------------------------------------------------------------------------------- claim_folder itself

def test_new_folder_gets_marker_and_lock(tmp_path):
    out = tmp_path / "a" / "b"
    with claim_folder(out, "eval", "h1") as path:
        assert path == out and current_folder() == out
        assert json.loads((out / MARKER).read_text())["command"] == "eval"
        assert json.loads((out / MARKER).read_text())["config_sha256"] == "h1"
    assert current_folder() is None
    with claim_folder(out, "eval", "h2"):  # its own kind again: fine (eval resumes), the marker stays as made
        assert json.loads((out / MARKER).read_text())["config_sha256"] == "h1"


@pytest.mark.parametrize("setup, message", [
    ({"notes.txt": "x"}, "not written by `emapg train`"),  # someone else's folder
    ({MARKER: json.dumps({"command": "eval"}), "summary.json": "{}"}, "holds the output of `emapg eval`"),
    ({MARKER: "{broken", "x": "y"}, "unreadable emapg marker"),
])
def test_foreign_folders_are_refused_without_a_byte_written(tmp_path, setup, message):
    out = tmp_path / "out"
    out.mkdir()
    for name, text in setup.items():
        (out / name).write_text(text)
    before = tree(out)
    with pytest.raises(UserError, match=message):
        with claim_folder(out, "train", "h"):
            raise AssertionError("never entered")
    assert tree(out) == before


def test_a_file_is_not_a_folder(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="not a folder"):
        with claim_folder(tmp_path / "f", "eval"):
            pass


def test_fresh_needs_an_empty_folder_and_same_config_compares_hashes(tmp_path):
    out = tmp_path / "run"
    with claim_folder(out, "train", "h1"):
        (out / "config.yaml").write_text("x")
    with pytest.raises(UserError, match="already holds"):
        with claim_folder(out, "train", "h1", fresh=True):
            pass
    with pytest.raises(UserError, match="other settings"):
        with claim_folder(out, "train", "h2", same_config=True):
            pass
    with claim_folder(out, "train", "h1", same_config=True):
        pass


def test_legacy_folders_of_the_same_kind_are_recognised(tmp_path):
    out = tmp_path / "old_eval"  # written before markers existed
    out.mkdir()
    (out / "run.json").write_text("{}")
    (out / "results.jsonl").write_text("")
    with claim_folder(out, "eval"):
        pass
    assert json.loads((out / MARKER).read_text())["command"] == "eval"


def test_second_writer_gets_a_one_line_error(tmp_path):
    out = tmp_path / "out"
    with claim_folder(out, "eval"):
        with pytest.raises(UserError, match="in use by another emapg process"):
            with claim_folder(out, "eval"):
                pass
    # the lock is the kernel's: another process holding it blocks us too, and it goes when that process dies
    fd = os.open(out / LOCK, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(UserError, match="in use"):
            with claim_folder(out, "eval"):
                pass
    finally:
        os.close(fd)
    with claim_folder(out, "eval"):
        pass


def test_a_failed_command_leaves_no_half_made_folder(tmp_path):
    out = tmp_path / "new" / "run"
    with pytest.raises(UserError):
        with claim_folder(out, "train", keep=("checkpoints",)):
            (out / "config.yaml").write_text("x")
            raise UserError("bad data")
    assert not (tmp_path / "new").exists()  # the parents it made go too
    with pytest.raises(OSError):
        with claim_folder(out, "train", keep=("checkpoints",)):
            (out / "checkpoints").mkdir()
            raise OSError(28, "No space left on device")
    assert (out / "checkpoints").is_dir()  # something worth resuming stays
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(UserError):
        with claim_folder(existing, "eval"):
            raise UserError("x")
    assert existing.is_dir()  # a folder it did not create is never removed


# --------------------------------------------------------------------------- the one error path

def test_unexpected_exception_is_one_line_and_a_traceback_file(tmp_path, monkeypatch):
    from emapg_cli.cli import prepare_cmd

    def boom(*a, **k):
        raise RuntimeError("kaboom [/bold]")

    monkeypatch.setattr(prepare_cmd, "_show_manifest", boom)
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps({"id": "1", "question": "q", "answer": "1"}) + "\n")
    code, out, err = run_inprocess(["prepare", "x", "--from", str(src), "--out", str(tmp_path / "ds")], tmp_path,
                                   {"EMAPG_HOME": str(tmp_path / "home")})
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert "RuntimeError: kaboom [/bold]" in lines[0]  # escaped: the markup is shown, not read
    log = Path(lines[0].rsplit("full traceback in ", 1)[1])
    assert log == tmp_path / "ds" / "error.log"  # the claimed folder is known, so the traceback goes there
    assert "Traceback" in log.read_text() and "kaboom" in log.read_text()


def test_unexpected_exception_without_a_folder_uses_a_temp_file(tmp_path, monkeypatch):
    from emapg_cli.config import loading

    def boom(*a, **k):
        raise KeyError("kaboom")

    monkeypatch.setattr("emapg_cli.outputs._last", [])  # no folder claimed by this process
    monkeypatch.setattr(loading, "to_yaml", boom)  # `config show` (which imports it when it runs) writes no folder
    code, out, err = run_inprocess(["config", "show"], tmp_path, {})
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "KeyError" in lines[0], err
    log = Path(lines[0].rsplit("full traceback in ", 1)[1])
    assert log.parent == Path(tempfile.gettempdir()) and "Traceback" in log.read_text()
    log.unlink()


# --------------------------------------------------------------------- concurrent writers, full disk

def _bench(tmp_path: Path, items: int) -> tuple[Path, Path]:
    bench, responses = tmp_path / "bench.jsonl", tmp_path / "resp.jsonl"
    bench.write_text("".join(json.dumps({"id": str(i), "question": f"{i}+{i}?", "answers": [str(2 * i)], "source": "t", "meta": {}})
                             + "\n" for i in range(items)))
    responses.write_text("".join(json.dumps({"id": str(i), "responses": [f"\\boxed{{{2 * i}}}", "\\boxed{x}"]}) + "\n"
                                 for i in range(items)))
    return bench, responses


def _eval_cmd(bench, responses, out):
    return [sys.executable, "-m", "emapg_cli", "eval", "--bench", str(bench), "--responses", str(responses), "--out", str(out),
            "--grader-workers", "1"]


def _env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}


def test_two_concurrent_evals_on_one_folder(tmp_path):
    items = 3000  # grading takes seconds, so the two runs overlap
    bench, responses = _bench(tmp_path, items)
    out = tmp_path / "out"
    procs = [subprocess.Popen(_eval_cmd(bench, responses, out), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], [(p.returncode, r[1][-500:]) for p, r in zip(procs, results)]
    loser = results[[p.returncode for p in procs].index(2)][1].strip().splitlines()
    assert len(loser) == 1 and "in use by another emapg process" in loser[0]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == items and len({r["id"] for r in rows}) == items  # one row per item
    assert all(len(r["responses"]) == 2 for r in rows)  # x 2 samples
    assert json.loads((out / "summary.json").read_text())["avg@n"] == 0.5  # right, wrong per item


def _limit_file_size(limit: int):
    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


def test_disk_full_is_one_line_and_the_rerun_completes(tmp_path):
    bench, responses = _bench(tmp_path, 400)  # results.jsonl grows past 20 kB
    out = tmp_path / "out"
    r = subprocess.run(_eval_cmd(bench, responses, out), env=_env(), capture_output=True, text=True, timeout=300,
                       preexec_fn=_limit_file_size(20_000))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "File too large" in lines[0] and str(out) in lines[0], lines[0]
    assert not list(out.glob("*.tmp"))  # no temporary file left behind
    # what was written is usable: the rerun (no limit) resumes and ends with one row per item
    r = subprocess.run(_eval_cmd(bench, responses, out), env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(int(r["id"]) for r in rows) == list(range(400))


def test_disk_full_on_a_new_folder_leaves_nothing(tmp_path):
    bench, responses = _bench(tmp_path, 5)
    out = tmp_path / "new" / "out"
    r = subprocess.run(_eval_cmd(bench, responses, out), env=_env(), capture_output=True, text=True, timeout=300,
                       preexec_fn=_limit_file_size(0))  # not even the marker fits
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "File too large" in lines[0], r.stderr[-2000:]
    assert not (tmp_path / "new").exists()


# ---------------------------------------------------------------------------- unwritable folders

def _unwritable(tmp_path: Path) -> Path:
    """A folder this process cannot write into: a read-only folder, or under /sys when we are root
    (root writes through file modes; /sys refuses even root)."""
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        return ro
    target = Path("/sys/emapg-test")
    try:
        target.mkdir()
    except OSError:
        return target
    target.rmdir()
    pytest.skip("no unwritable location: running as root and /sys is writable")


@pytest.mark.parametrize("args", [
    ["eval", "--bench", "bench.jsonl", "--responses", "resp.jsonl", "--out", "{ro}/out"],
    ["prepare", "x", "--from", "bench.jsonl", "--out", "{ro}/ds"],
    ["prepare", "x", "--from", "bench.jsonl"],  # EMAPG_HOME itself is unwritable
    ["kl-check", "--vocab", "50", "--positions", "2", "--samples", "64", "--batches", "4", "--plot", "{ro}/p.png"],
    ["kl-check", "--vocab", "50", "--positions", "2", "--samples", "64", "--batches", "4", "--json", "{ro}/r.json"],
    ["train", "--set", "model.path={model}", "--out", "{ro}/run"],
    ["ablate", "--preset", "toy", "--grid", "kl.k=1,2", "--out", "{ro}/sweep"],
], ids=["eval", "prepare", "emapg-home", "kl-check-plot", "kl-check-json", "train", "ablate"])
def test_unwritable_output_is_one_line(tmp_path, args, tiny_llama):
    work = tmp_path / "work"
    work.mkdir()
    _bench(work, 3)
    # train's model.path is the tiny model (an empty folder would be refused first: no config.json)
    ro = _unwritable(tmp_path)
    argv = [a.replace("{ro}", str(ro)).replace("{model}", str(tiny_llama)) for a in args]
    before = tree(tmp_path)
    r = subprocess.run([sys.executable, "-m", "emapg_cli", *argv], cwd=work, env={**_env(), "EMAPG_HOME": str(ro / "home")},
                       capture_output=True, text=True, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert str(ro) in lines[0] and any(w in lines[0] for w in ("Permission denied", "not permitted", "Read-only", "cannot write")), lines[0]
    assert tree(tmp_path) == before
