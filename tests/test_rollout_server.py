"""The rollout server and its client on the tiny model: health, seeded generation, versioned weight pushes over the
gloo channel, refusals of another model, of a server that is not one, of one that is down or killed mid-run, and
(slow) `emapg train` through a server against the same run in-process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import torch

from emapg_cli.engines.base import SamplingParams
from emapg_cli.errors import UserError

PROMPTS = [[10, 11, 12], [40, 41]]
PARAMS = SamplingParams(n=2, max_new_tokens=6, seed=7, topk=3)


def _serve(model_path: Path):
    """A rollout server on `model_path` in a thread of this process (port 0); (url, server)."""
    from emapg_cli.serve.rollout_server import make_server
    from emapg_cli.serve.rollout_service import RolloutService, load_served

    server = make_server(RolloutService(load_served("hf", str(model_path))), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


def _ids(rows):
    return [[c.token_ids for c in row] for row in rows]


@pytest.fixture(scope="module")
def served(tiny_qwen2):
    url, server = _serve(tiny_qwen2)
    yield url
    server.shutdown()
    server.server_close()


def test_health_generation_and_versioned_pushes(served, tiny_qwen2, one_torch_thread):
    from emapg_cli.engines.remote import RemoteEngine
    from emapg_cli.models.loading import load_causal_lm, load_tokenizer

    engine = RemoteEngine(served, timeout_s=60)
    h = engine.health
    assert (h["protocol"], h["engine"], h["weights_version"], h["records_topk"], h["dtype"]) == (2, "hf", -1, True, "float32")
    assert h["model"]["num_hidden_layers"] == 2 and len(h["tokenizer"]) == 64
    model, tokenizer = load_causal_lm(str(tiny_qwen2), "float32"), load_tokenizer(str(tiny_qwen2))
    engine.check_compatible(model, tokenizer)  # the same folder: accepted

    first = engine.generate(PROMPTS, PARAMS)
    assert _ids(engine.generate(PROMPTS, PARAMS)) == _ids(first)  # seeded per request: the same samples
    c = first[0][0]
    assert c.weights_version == -1 and len(c.logprobs) == len(c.token_ids) and c.topk_index.shape == (len(c.token_ids), 3)

    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))  # far from the loaded weights: the tiny model's samples change
    engine.push_weights(model, 1)
    changed = engine.generate(PROMPTS, PARAMS)
    assert changed[0][0].weights_version == 1 and engine.weights_version == 1
    assert _ids(changed) != _ids(first)

    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(original[n])
    engine.load_weights(model)  # = push_weights(model, 2): the loaded weights back, bit for bit over the channel
    back = engine.generate(PROMPTS, PARAMS)
    assert back[0][0].weights_version == 2 and _ids(back) == _ids(first)
    assert [c.logprobs for c in back[0]] == [c.logprobs for c in first[0]]
    assert engine.full_vocab_logprobs(PARAMS) and not engine.full_vocab_logprobs(SamplingParams(temperature=0))

    # a new trainer (or a resumed one) connects: the weights there are not its versions until it pushes its own
    other = RemoteEngine(served, timeout_s=60)
    other._connect()
    assert RemoteEngine(served).weights_version == -1
    other.push_weights(model, 0)
    assert other.generate(PROMPTS, replace(PARAMS, min_version=0))[0][0].weights_version == 0
    with pytest.raises(UserError, match="HTTP 409: another trainer connected to this rollout server since this one did"):
        engine.push_weights(model, 3)  # the replaced trainer's push: refused before any tensor is sent

    # a version that never comes: one line after the request's timeout (the server waits 0.9 of it), not a hang
    engine = other
    engine.timeout_s = 1.0
    with pytest.raises(UserError, match=r"HTTP 504: waited 0.9 s for a version >= 9; the server holds 0") as e:
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=2, min_version=9))
    assert "\n" not in str(e.value)


def test_another_model_is_refused_in_one_line(served, tmp_path, one_torch_thread):
    from emapg_cli.engines.remote import RemoteEngine
    from emapg_cli.models.loading import load_causal_lm, load_tokenizer
    from emapg_cli.models.tiny import save_tiny

    deeper = save_tiny(tmp_path / "deeper", arch="qwen2", layers=3)  # the same byte tokenizer, one more layer
    with pytest.raises(UserError, match=r"serves another model \(num_hidden_layers 3 vs 2\)") as e:
        RemoteEngine(served).check_compatible(load_causal_lm(str(deeper), "float32"), load_tokenizer(str(deeper)))
    assert "\n" not in str(e.value)


def test_not_a_rollout_server_and_nothing_listening(tmp_path):
    from emapg_cli.engines.remote import RemoteEngine

    class Other(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = json.dumps({"status": "ok", "rows": 3}).encode()  # a retriever's /health
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    other = HTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        with pytest.raises(UserError, match="answers, but not as an emapg rollout server"):
            RemoteEngine(f"http://127.0.0.1:{other.server_address[1]}")
    finally:
        other.shutdown()
        other.server_close()
    with pytest.raises(UserError, match=r"cannot reach it \(.*\); is `emapg rollout serve` running there\?"):
        RemoteEngine(f"http://127.0.0.1:{other.server_address[1]}")  # closed: nothing listens there now


def _start_server(model: Path) -> tuple[subprocess.Popen, str]:
    """`emapg rollout serve` in a subprocess on a free port; (process, url) once its ready line printed."""
    proc = subprocess.Popen([sys.executable, "-m", "emapg_cli", "rollout", "serve", "--model", str(model), "--port", "0", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("rollout server ready at http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, line.split(" at ")[1].split()[0]


@pytest.mark.slow
def test_server_subprocess_ctrl_c_and_killed_mid_run(tiny_qwen2, one_torch_thread):
    from emapg_cli.engines.remote import RemoteEngine
    from emapg_cli.models.loading import load_causal_lm

    proc, url = _start_server(tiny_qwen2)
    try:
        engine = RemoteEngine(url, timeout_s=60)
        model = load_causal_lm(str(tiny_qwen2), "float32")
        engine.push_weights(model, 0)
        assert engine.generate(PROMPTS, PARAMS)[0][0].weights_version == 0
        proc.kill()  # SIGKILL mid-run
        proc.wait(30)
        with pytest.raises(UserError, match=r"cannot reach it .*is `emapg rollout serve` running there\?") as e:
            engine.generate(PROMPTS, PARAMS)
        with pytest.raises(UserError) as e2:
            engine.push_weights(model, 1)
        for err in (e, e2):
            assert "\n" not in str(err.value) and url in str(err.value)
    finally:
        proc.kill()
    proc, url = _start_server(tiny_qwen2)  # Ctrl-C: a clean exit, nothing on stderr but the model's loading bars
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0
    assert "Traceback" not in proc.stderr.read()


@pytest.mark.slow
def test_train_through_a_server_equals_the_in_process_run(tiny_qwen2, tmp_path):
    """2 steps of the tiny run, rollouts from a server (rollout.engine_url) vs from the hf engine in the trainer's
    process: the same seed gives the same samples (seeded per row; the same weights, pushed bit for bit; one
    thread on each side), so the same final weights, bit for bit, and the same metrics. Then another trainer on
    the same server with rollout.max_staleness=1 reports the staleness it ran with."""
    from safetensors.torch import load_file

    from train_helpers import run, run_many, tiny_overrides, train_cmd, write_dataset

    data = write_dataset(tmp_path / "d.jsonl")
    proc, url = _start_server(tiny_qwen2)
    try:
        opts = tiny_overrides(tiny_qwen2, data, steps=2)
        remote, local = run_many([train_cmd(*opts, "--set", f"rollout.engine_url={url}", "--out", str(tmp_path / "remote")),
                                  train_cmd(*opts, "--out", str(tmp_path / "local"))], timeout=900)
        # then a second trainer on the same server, one step off-policy (rollout.max_staleness=1, 3 steps)
        off = run(train_cmd(*tiny_overrides(tiny_qwen2, data, steps=3), "--set", f"rollout.engine_url={url}",
                            "--set", "rollout.max_staleness=1", "--out", str(tmp_path / "off")), timeout=900)
    finally:
        proc.kill()
    assert remote.returncode == 0 and local.returncode == 0, (remote.stderr[-2000:], local.stderr[-2000:])
    assert off.returncode == 0, off.stderr[-2000:]
    # step 1 is sampled from the weights pushed at setup (version 0); step s >= 2 was generated while step s - 1
    # trained, from version s - 2: one update behind the policy (version s - 1) that trains on it
    rows = [json.loads(line) for line in (tmp_path / "off" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["rollout/staleness"], r["rollout/staleness_max"]) for r in rows if "rollout/staleness" in r] == \
        [(1, 0.0, 0.0), (2, 1.0, 1.0), (3, 1.0, 1.0)]
    for part in ("policy", "anchor"):
        a, b = (load_file(tmp_path / run / "final" / part / "model.safetensors") for run in ("local", "remote"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part
    rows = [[json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()] for run in ("local", "remote")]
    timing = ("time", "_s", "throughput", "elapsed")
    for a, b in zip(*rows):  # the server's run also logs its versions' staleness: 0, the synchronous loop
        assert {k: v for k, v in a.items() if not any(t in k for t in timing)} == \
            {k: v for k, v in b.items() if k in a and not any(t in k for t in timing)}
        assert b.get("rollout/staleness", 0.0) == 0.0
