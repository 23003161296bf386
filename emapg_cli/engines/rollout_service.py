"""What a rollout server does, without its HTTP: sample from an engine, and take versioned weights from a trainer.

One lock orders generation and weight updates: a generation holds it from start to end, and a pushed version is
applied under it, so weights never change in the middle of a generation. A push streams into a staging copy (one
tensor at a time, over the trainer's `WeightChannel`) while generations go on; only the copy into the engine waits
for the lock. Pushes are received and applied in the order their manifests arrived. A generate request may ask for
exactly one version (the trainer's synchronous loop: the weights it pushed last) or for at least one
(`SamplingParams.min_version`, the asynchronous pipeline); it waits for it (counted in the reply's `wait_s`) at most
its `timeout_s`. Version labels are the trainer's: the policy after RL step s is s; a server that was never pushed
to holds -1 (the weights it loaded), and so does one a new trainer connected to (until its first push).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from emapg_cli.engines.base import Completion, SamplingParams
from emapg_cli.engines.rollout_protocol import PROTOCOL, ProtocolError, check_manifest
from emapg_cli.engines.weight_channel import SERVER, WeightChannel, join_store

#: The label of weights loaded from the model folder, before any push.
LOADED = -1


class Unavailable(Exception):
    """A request that cannot be served now (no weight channel, a version that did not come): HTTP 409/504."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class _Staged:
    """Staged tensors with the `named_parameters()` a vLLM engine's `load_weights` reads."""

    def __init__(self, tensors: dict[str, Any]):
        self.tensors = tensors

    def named_parameters(self):
        return iter(self.tensors.items())


@dataclass
class ServedModel:
    """The engine and what a trainer checks about it."""

    engine: Any
    name: str  # hf or vllm
    fingerprint: dict[str, Any]
    tokenizer_sha256: str
    params: dict[str, tuple[str, list[int]]]  # parameter name -> (dtype, shape), what a push must hold
    device: str  # where staging tensors live (cuda: an NCCL channel; cpu: gloo)
    module: Any = None  # hf: the live module whose parameters a version is copied into; vllm: None


class RolloutService:
    """The server's state: the engine, its weights' version, the weight channel and its receiver thread."""

    def __init__(self, served: ServedModel):
        self.served = served
        self.version = LOADED
        self.cond = threading.Condition()  # held by each generation and each apply
        self.channel: Optional[WeightChannel] = None
        self.channel_error = ""
        self._epoch = 0  # bumped by each connect: a receiver of an older channel stops
        self._jobs: "queue.Queue[tuple[int, int, list]]" = queue.Queue()

    def health(self) -> dict[str, Any]:
        s = self.served
        return {"status": "ok", "protocol": PROTOCOL, "engine": s.name, "model": s.fingerprint,
                "tokenizer": s.tokenizer_sha256, "weights_version": self.version, "records_topk": bool(s.engine.records_topk),
                "dtype": next(iter(s.params.values()))[0] if s.params else None, "connected": self.channel is not None,
                "device": s.device}

    def generate(self, prompts: list[list[int]], params: SamplingParams, version: Optional[int],
                 timeout_s: float) -> tuple[list[list[Completion]], int, float]:
        """(completions, the version that sampled them, seconds waited for it): waits until the weights are
        `version` (when given) and at least `params.min_version` (when given), then generates holding the lock."""
        def ready() -> bool:
            return (version is None or self.version == version) and \
                (params.min_version is None or self.version >= params.min_version)

        t0 = time.monotonic()
        with self.cond:
            if not self.cond.wait_for(ready, timeout=timeout_s):
                want = f"version {version}" if version is not None else f"a version >= {params.min_version}"
                raise Unavailable(504, f"waited {timeout_s:g} s for {want}; the server holds {self.version}"
                                       + (f" (weight channel: {self.channel_error})" if self.channel_error else ""))
            waited = time.monotonic() - t0
            return self.served.engine.generate(prompts, params), self.version, waited

    # ------------------------------------------------------------------ weights
    def connect(self, host: str, port: int, backend: str, timeout_s: float) -> int:
        """Join the trainer's store and group in a background thread (the trainer builds its end at the same time),
        then receive pushes in order; a new connect replaces the previous channel and sets the version back to
        `LOADED`: a trainer that starts (or resumes) never takes the weights of an earlier one for its own version."""
        if backend not in ("gloo", "nccl"):
            raise ProtocolError(f"backend must be gloo or nccl, got {backend!r:.20}")
        if backend == "nccl" and not self.served.device.startswith("cuda"):
            raise ProtocolError("backend nccl needs the server's engine on CUDA; this server runs on CPU (use gloo)")
        with self.cond:  # the weights held now are not this trainer's versions: its requests wait for its first push
            self.version = LOADED
        self._epoch += 1
        self.channel, self.channel_error = None, ""
        self._jobs = queue.Queue()
        threading.Thread(target=self._receive, args=(self._epoch, self._jobs, host, port, backend, timeout_s),
                         name="emapg-rollout-weights", daemon=True).start()
        return self._epoch

    def push(self, version: int, tensors: Any, session: Any = None) -> None:
        """Queue a push of `version` whose tensors follow on the channel in manifest order; `session`: what the
        pusher's connect returned (a push of a trainer that another one has replaced since is refused)."""
        if self._epoch == 0:
            raise Unavailable(409, "no weight channel: POST /weights/connect first")
        if session != self._epoch:
            raise Unavailable(409, "another trainer connected to this rollout server since this one did: one trainer per server")
        if self.channel_error:
            raise Unavailable(409, f"the weight channel failed ({self.channel_error}): connect again")
        self._jobs.put((self._epoch, version, check_manifest(tensors, self.served.params)))

    def _receive(self, epoch: int, jobs: "queue.Queue", host: str, port: int, backend: str, timeout_s: float) -> None:
        # gloo moves CPU tensors: a CUDA engine's version is staged on CPU and copied to the GPU when applied
        staging: dict[str, Any] = {}  # this channel's own: a later connect's receiver never shares it
        device = self.served.device if backend == "nccl" else "cpu"
        try:
            channel = WeightChannel(join_store(host, port, timeout_s), SERVER, backend, timeout_s)
            if epoch != self._epoch:
                return
            self.channel = channel
            while epoch == self._epoch:
                job_epoch, version, rows = jobs.get()
                if job_epoch != epoch:
                    return
                self._stage(channel, rows, staging, device)
                self._apply(version, staging, epoch)
        except Exception as e:  # the trainer went away, or timed out: recorded, reported to the next push
            if epoch == self._epoch:
                self.channel, self.channel_error = None, " ".join(str(e).split())[:200] or type(e).__name__
                with self.cond:
                    self.cond.notify_all()

    @staticmethod
    def _stage(channel: WeightChannel, rows: list, staging: dict[str, Any], device: str) -> None:
        import torch

        for name, dtype, shape in rows:
            buf = staging.get(name)
            if buf is None:
                buf = staging[name] = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            channel.recv_into(buf)

    def _apply(self, version: int, staging: dict[str, Any], epoch: int) -> None:
        """Copy the staged version into the engine, between generations (not when another trainer connected since)."""
        import torch

        with self.cond:
            if epoch != self._epoch:
                return
            module = self.served.module
            if module is not None:
                with torch.no_grad():
                    for name, p in module.named_parameters():
                        p.copy_(staging[name])
            else:
                self.served.engine.load_weights(_Staged(staging))
            self.version = version
            self.cond.notify_all()


def check_model_path(model_path: str) -> None:
    """One line (UserError) for a `--model` that cannot load: a local path without a model folder, or a hub id that
    is neither cached nor reachable."""
    from emapg_cli.errors import UserError
    from emapg_cli.models.hub import check_model_source
    from emapg_cli.paths import expand

    if not model_path.strip():
        raise UserError("--model is empty: give the model folder (save_pretrained layout, with its tokenizer)")
    if model_path.startswith((".", "/", "~", "$")) and not (expand(model_path) / "config.json").is_file():
        raise UserError(f"--model {expand(model_path)}: no model folder there (config.json, save_pretrained layout)")
    check_model_source(model_path, "--model")


def load_served(engine: str, model_path: str, *, dtype: Optional[str] = None, seed: int = 0,
                max_model_len: Optional[int] = None, trust_remote_code: bool = False, batch_size: int = 256,
                temperature: float = 1.0, top_p: float = 1.0) -> ServedModel:
    """The engine on the saved model at `model_path` (`engines.make_engine`: `hf`, or `vllm` imported only here)
    with its fingerprints and the parameters a push must hold (vLLM: read from the model's config on the meta
    device, in transformers' names, the ones its weight loader takes)."""
    import torch

    from emapg_cli.engines import make_engine
    from emapg_cli.models.fingerprint import module_fingerprint, tokenizer_fingerprint
    from emapg_cli.models.loading import DTYPES, load_tokenizer, model_ref

    check_model_path(model_path)
    eng = make_engine(engine, model_path, seed=seed, dtype=dtype, max_model_len=max_model_len, trust_remote_code=trust_remote_code,
                      batch_size=batch_size, temperature=temperature, top_p=top_p)
    if engine == "hf":
        module, tokenizer = eng.model, eng.tokenizer
        reference, device = module, str(next(module.parameters()).device)
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        module, tokenizer = None, load_tokenizer(model_path, trust_remote_code)
        config = AutoConfig.from_pretrained(model_ref(model_path), trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            reference = AutoModelForCausalLM.from_config(config, torch_dtype=DTYPES[eng.dtype] if isinstance(eng.dtype, str) else eng.dtype,
                                                         trust_remote_code=trust_remote_code)
        device = "cuda" if torch.cuda.is_available() else "cpu"
    params = {n: (str(p.dtype).removeprefix("torch."), list(p.shape)) for n, p in reference.named_parameters()}
    return ServedModel(engine=eng, name=engine, fingerprint=module_fingerprint(reference),
                       tokenizer_sha256=tokenizer_fingerprint(tokenizer), params=params, device=device, module=module)
