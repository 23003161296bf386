"""What a rollout server does, without its HTTP: sample from an engine, and take versioned weights from a trainer.

One lock orders generation and weight updates: a generation holds it from start to end, and a pushed version is
applied under it, so weights never change in the middle of a generation. A push is received into a staging copy and
checked (serve/rollout_weights.py) while generations go on; only the copy into the engine waits for the lock.
A generate request may ask for exactly one version (the trainer's synchronous loop: the weights it pushed last) or
for at least one (`SamplingParams.min_version`, the asynchronous pipeline). Its deadline counts from its arrival:
waiting for the lock (another generation), for its version, and generating all happen within its `timeout_s`; a
generation also stops at the first decode step after its client left (`cancelled`). Version labels are the
trainer's: the policy after RL step s is s; a server that was never pushed to holds -1 (the weights it loaded), and
so does one a new trainer connected to (until its first push).

One trainer at a time: each `/weights/connect` draws a new random token (`secrets.token_urlsafe`), and from then on
every push and generate request must carry it; the previous trainer's requests are refused (409), and a client
that never connected cannot push.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from emapg_cli.engines.base import Cancelled, Completion, SamplingParams
from emapg_cli.engines.rollout_protocol import PROTOCOL, ProtocolError, check_manifest, tensor_bytes
from emapg_cli.serve.rollout_weights import Staging
from emapg_cli.serve.http_server import Refused

#: The label of weights loaded from the model folder, before any push.
LOADED = -1


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
    device: str  # the engine's device (reported by /health; the staging copy is in CPU memory)
    module: Any = None  # hf: the live module whose parameters a version is copied into; vllm: None


@dataclass
class _Session:
    """The trainer connected last: its token, its number (bumped by each connect)."""

    token: str
    epoch: int
    error: str = ""  # why its last version could not be applied (reported to its next request)


class RolloutService:
    """The server's state: the engine, its weights' version, the connected trainer and the staging copy."""

    def __init__(self, served: ServedModel):
        self.served = served
        self.version = LOADED
        self.cond = threading.Condition()  # held by each generation and each apply
        self.session: Optional[_Session] = None
        self.staging = Staging(served.params, self._apply)
        self._epochs = 0

    def health(self) -> dict[str, Any]:
        s = self.served
        return {"status": "ok", "protocol": PROTOCOL, "engine": s.name, "model": s.fingerprint,
                "tokenizer": s.tokenizer_sha256, "weights_version": self.version, "records_topk": bool(s.engine.records_topk),
                "dtype": next(iter(s.params.values()))[0] if s.params else None, "connected": self.session is not None,
                "device": s.device}

    # ------------------------------------------------------------------ trainers
    def check_token(self, token: Any, what: str) -> _Session:
        """The current session when `token` is its token; `Refused` 403 (no token, or no trainer connected) or 409
        (another trainer connected since)."""
        session = self.session
        if session is None:
            raise Refused(409, f"no trainer is connected to this rollout server (was it restarted?): {what} needs "
                               "POST /weights/connect first")
        if not isinstance(token, str) or not token:
            raise Refused(403, f"{what} needs the token /weights/connect returned")
        if not hmac.compare_digest(token.encode(), session.token.encode()):
            raise Refused(409, "another trainer connected to this rollout server since this one did: one trainer per server")
        return session

    def connect(self, backend: str) -> str:
        """A new session: its token. The version goes back to `LOADED` (a trainer that starts or resumes never takes
        an earlier one's weights for its own version) and the previous trainer's requests are refused from now on.
        `backend` must be http (the weights in the push's own body; the nccl channel was removed)."""
        if backend != "http":
            raise ProtocolError(f"backend must be http, got {backend!r:.20}")
        with self.cond:  # the weights held now are not this trainer's versions: its requests wait for its first push
            self.version = LOADED
            self._epochs += 1
            self.session = _Session(secrets.token_urlsafe(24), self._epochs)
            self.cond.notify_all()
        return self.session.token

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[list[int]], params: SamplingParams, version: Optional[int], timeout_s: float,
                 arrival: float, token: Any = None, cancelled: Optional[Callable[[], bool]] = None,
                 anyone: bool = False) -> tuple[list[list[Completion]], int, float]:
        """(completions, the version that sampled them, seconds waited before generating): waits until the weights are
        `version` (when given) and at least `params.min_version` (when given), then generates holding the lock; all
        within `timeout_s` of `arrival` (time.monotonic()), and stopped once `cancelled()` (the client left). Once a
        trainer connected, `token` must be its token (without one, a request samples the loaded weights). `anyone`: a
        caller other than the trainer (the OpenAI routes of `--openai`): no token, the weights held now."""
        deadline = arrival + timeout_s
        no_token = anyone or (token is None and self.session is None)
        session = None if no_token else self.check_token(token, "/generate")

        def ready() -> bool:
            return ((version is None or self.version == version)
                    and (params.min_version is None or self.version >= params.min_version)) or self._refused(session)

        if not self.cond.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise Refused(504, f"busy: another generation held the server for the whole {timeout_s:g} s of this request")
        try:
            if not self.cond.wait_for(ready, timeout=max(0.0, deadline - time.monotonic())):
                want = f"version {version}" if version is not None else f"a version >= {params.min_version}"
                raise Refused(504, f"waited {timeout_s:g} s for {want}; the server holds {self.version}")
            if self._refused(session):
                raise Refused(409, f"the weights failed ({session.error}): connect again")
            waited = time.monotonic() - arrival
            late = lambda: time.monotonic() > deadline or (cancelled is not None and cancelled())  # noqa: E731
            try:
                return self.served.engine.generate(prompts, params, cancelled=late), self.version, waited
            except Cancelled:
                raise Refused(504 if time.monotonic() > deadline else 499,
                              f"the generation passed the request's {timeout_s:g} s" if time.monotonic() > deadline
                              else "the client left: the generation was cancelled") from None
        finally:
            self.cond.release()

    def _refused(self, session: Optional[_Session]) -> bool:
        return session is not None and bool(session.error)

    # ------------------------------------------------------------------ weights
    def push(self, token: Any, version: int, tensors: Any, read_into: Optional[Callable[[Any], None]] = None,
             size: int = 0, still_wanted: Callable[[], bool] = lambda: True) -> None:
        """Take `version`: its manifest `tensors` checked against the server's parameters; the `size` bytes that follow
        must be exactly its tensors', read by `read_into` into the staging copy (after the previous version was
        applied, waiting while `still_wanted()`), checked finite, and handed to the applier."""
        session = self.check_token(token, "a push")
        if session.error:
            raise Refused(409, f"the weights failed ({session.error}): connect again")
        rows = check_manifest(tensors, self.served.params)
        expected = tensor_bytes(rows)
        if size != expected:
            raise ProtocolError(f"the push's body holds {size} bytes of tensors, its manifest {expected}")
        if read_into is None:
            raise ProtocolError("the tensors follow the manifest in the push's body")
        if not self.staging.acquire(still_wanted):
            raise Refused(499, "the pusher left while the previous version was being applied")
        try:
            self.staging.receive(rows, read_into)
            bad = self.staging.not_finite()
            if bad:
                raise Refused(422, f"version {version} refused: {bad:.80} holds NaN or Inf values; nothing was applied")
            if self.session is not session:
                raise Refused(409, "another trainer connected to this rollout server since this one did: one trainer per server")
        except BaseException:
            self.staging.release()
            raise
        self.staging.hand_over(version, session.epoch)

    def _apply(self, version: int, staging: dict[str, Any], epoch: int) -> None:
        """Copy the staged version into the engine, between generations (not when another trainer connected since);
        an engine that fails to take it is the session's error."""
        import torch

        with self.cond:
            session = self.session
            if session is None or epoch != session.epoch:
                return
            try:
                module = self.served.module
                if module is not None:
                    with torch.no_grad():
                        for name, p in module.named_parameters():
                            p.copy_(staging[name])
                else:
                    self.served.engine.load_weights(_Staged(staging))
                self.version = version
            except Exception as e:  # the engine refused the weights: reported to the trainer's next request
                session.error = f"version {version} could not be applied: {' '.join(str(e).split())[:160] or type(e).__name__}"
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
