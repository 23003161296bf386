"""Shared pieces of the training tests: a tiny arithmetic dataset, the CLI launcher, tiny-run overrides."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

LAUNCHER = str(Path(__file__).with_name("train_launcher.py"))


def write_dataset(path: Path, n: int = 12) -> Path:
    """`n` rows {id, question "a+b", answer} in the canonical JSONL schema."""
    rows = [{"id": f"q{i}", "question": f"{i % 7}+{i % 5}", "answer": str(i % 7 + i % 5)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_overrides(model: Path, data: Path, steps: int = 3, **extra: object) -> list[str]:
    """--set options for a few-second run: 4 prompts x 4 responses of <= 6 tokens, 2 mini-batches."""
    values = {
        "model.path": model, "data.train": data, "data.eval": data, "data.eval_limit": 4,
        "rollout.reward": "test_digit", "rollout.prompts_per_step": 4, "rollout.n": 4, "rollout.max_new_tokens": 6,
        # most tiny-model responses hit the 6-token cap: grade them (not 0) so advantages, and the pg path, are non-zero
        "reward.truncated": "grade",
        "train.steps": steps, "train.mini_batch_prompts": 2, "train.micro_batch_size": 4, "train.save_every": 1,
        "train.keep_checkpoints": 0, "optim.lr": 0.01, "kl.estimator": "topk", "kl.k": 8, "kl.coef": 0.1,
        "ema.decay": 0.5, "ema.update_period": 1, "eval.max_new_tokens": 4, "eval.anchor_every": 2,
    }
    values.update(extra)
    out: list[str] = []
    for k, v in values.items():
        out += ["--set", f"{k}={v}"]
    return out


def train_cmd(*args: str) -> list[str]:
    return [sys.executable, LAUNCHER, "train", *args]


def env() -> dict[str, str]:
    """One thread per process: the test processes share two cores."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run(cmd: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env())


def run_many(cmds: list[list[str]], timeout: float = 180) -> list[subprocess.CompletedProcess]:
    """Independent `run(cmd)`s, two at a time (results in the order given): CI has two cores and the test
    process waits idle on each subprocess (`env()` gives every process one thread)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda cmd: run(cmd, timeout=timeout), cmds))


def killed_and_resumed(opts: list[str], tmp_path: Path) -> tuple[Path, Path]:
    """Run `train *opts` twice at once: into tmp_path/b, killed with SIGKILL as soon as its first checkpoint is
    complete, then resumed; into tmp_path/a, uninterrupted (on the other core). Returns (a, b), both finished."""
    import signal
    import time

    a, b = tmp_path / "a", tmp_path / "b"
    victim = subprocess.Popen(train_cmd(*opts, "--out", str(b)), env=env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    reference = subprocess.Popen(train_cmd(*opts, "--out", str(a)), env=env(), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (b / "checkpoints" / "step_1" / "state.json").exists() and victim.poll() is None:
        assert time.time() < deadline
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    _, ref_err = reference.communicate(timeout=180)
    assert reference.returncode == 0, ref_err[-2000:]
    assert not (b / "final").exists(), "the run finished before it could be killed"
    resumed = run(train_cmd("--resume", str(b)))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    return a, b


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def tree_hash(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` by relative path (to show a command changed nothing)."""
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a launcher's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OneProcess:
    """The Accelerator methods the update and finite_step use, for one process on CPU."""

    device, num_processes = torch.device("cpu"), 1

    def backward(self, loss):
        loss.backward()

    def no_sync(self, model):
        return contextlib.nullcontext()

    def clip_grad_norm_(self, params, max_norm):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)


def assert_layout_equals_padded(model, ids, attn, p: int, resp, **layout) -> None:
    """`token_stats` with `layout` (pack=True or share=True) gives the padded pass's values and gradients: the
    no-grad pass's log-probs, top-k ids and log-probs at them, then a fused loss (a fixed weighted sum of the
    log-probs) and the gradient of every parameter, to 1e-5 relative in float32."""
    from emapg_cli.train.logprobs import token_stats

    mask = resp.bool()
    a = token_stats(model, ids, attn, p, resp, topk=4, temperature=0.7)
    b = token_stats(model, ids, attn, p, resp, topk=4, temperature=0.7, **layout)
    torch.testing.assert_close(b.logp[mask], a.logp[mask], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.logp_q[mask], a.logp_q[mask], rtol=1e-5, atol=1e-6)
    assert torch.equal(b.topk_index[mask], a.topk_index[mask])
    w = torch.randn(int(mask.sum()), generator=torch.Generator().manual_seed(1))  # [N]

    def loss_fn(s, e, logp, logp_q, logits=None, ref_logits=None):
        return logp * w[s:e], {}

    grads = []
    model.train()
    for kw in ({}, layout):
        model.zero_grad()
        out = token_stats(model, ids, attn, p, resp, loss_fn=loss_fn, **kw)
        out.loss.backward()
        grads.append((out.loss.detach(), [q.grad.clone() for q in model.parameters()]))
    (la, ga), (lb, gb) = grads
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-6)
    for x, y in zip(gb, ga):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def settings_of(cfg, vocab: int = 2**31):
    """The trainer's step settings of `cfg` (`train.settings.step_settings`, what the passes and the update take);
    `vocab` caps kl.k (default: no cap)."""
    from emapg_cli.train.settings import step_settings

    return step_settings(cfg, vocab)


#: How long the other machines of a launch may take to fail after one has (launch_machines).
FAILED_PEER_GRACE_S = 60


def launch_machines(args: list[str], root: Path, port: int, machines: int = 2, extra_env: dict[str, str] | None = None,
                    timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """`train_launcher.py ARGS` launched as `machines` machines of one process each, all on this host: one
    `accelerate launch --num_machines N --machine_rank R --main_process_ip 127.0.0.1` per machine (torchrun's static
    rendezvous, gloo), the command docs/multi_gpu.md ("Several machines") gives. Machine R runs in `root/machineR`
    (its working folder, so a relative --out is node-local there) with its own TMPDIR `root/machineR/tmp` (node-local
    temporary files). Returns each machine's finished process, output read from files (a pipe that fills would
    stall one machine and, through the collectives, the other). Once one machine has failed, the others get
    `FAILED_PEER_GRACE_S` to fail with their own message and are then killed (returncode -9): torchrun's exit barrier
    would hold a finished machine for 300 s waiting for a dead peer, and the test would end in a bare timeout instead
    of the failed machine's exit code and log."""
    procs = []
    for rank in range(machines):
        node = root / f"machine{rank}"
        (node / "tmp").mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", str(machines),
               "--num_processes", str(machines), "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
               "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no", LAUNCHER, *args]
        with open(node / "stdout.txt", "w") as out, open(node / "stderr.txt", "w") as err:
            procs.append(subprocess.Popen(cmd, cwd=node, stdout=out, stderr=err, text=True, start_new_session=True,
                                          env={**env(), "TMPDIR": str(node / "tmp"), **(extra_env or {})}))
    deadline, failed_at = time.monotonic() + timeout, None
    while None in [p.poll() for p in procs]:  # a list, not any(): every process polled (a dead one is reaped)
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now - failed_at > FAILED_PEER_GRACE_S):
            for p in procs:  # the launcher and its workers (a session each)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, 9)
            if failed_at is None:
                raise subprocess.TimeoutExpired(procs[0].args, timeout)
            break
        time.sleep(0.2)
    done = []
    for rank, proc in enumerate(procs):
        proc.wait()
        node = root / f"machine{rank}"
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, (node / "stdout.txt").read_text(),
                                                (node / "stderr.txt").read_text()))
    return done


def tiny_sweep_sets(model: Path, folder: Path, **extra: object) -> list[str]:
    """`--set` words for a study shrunk onto the tiny model: 8 addition questions (data.jsonl in `folder`), 2 RL steps
    of 2 prompts x 2 responses of <= 4 tokens, an evaluation after each, the anchor updated every step."""
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "question": f"{i % 7}+{i % 5}", "answers": [str(i % 7 + i % 5)]}) + "\n"
                            for i in range(8)))
    sets = {"model.path": str(model), "data.train": str(data), "data.eval": str(data), "data.eval_limit": 4,
            "rollout.prompts_per_step": 2, "rollout.n": 2, "rollout.max_new_tokens": 4, "eval.max_new_tokens": 4,
            "train.steps": 2, "eval.every": 1, "train.mini_batch_prompts": 2, "train.micro_batch_size": 4, "kl.k": 4,
            "ema.update_period": 1, **extra}
    return [w for k, v in sets.items() for w in ("--set", f"{k}={v}")]
