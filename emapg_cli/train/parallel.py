"""How the ranks of a run share the policy and the EMA anchor: replicated (one process, DDP) or sharded (FSDP2).

The trainer talks to one strategy object and never branches on the parallelism itself. Both
strategies answer the same questions:
  wrap            turn the policy (and anchor) into the modules the trainer runs, plus the optimizer
  no_sync         skip the gradient reduction of a micro-batch that is not the last of its mini-batch
  clip_grad_norm  the global gradient norm (clipped in place)
  full_weights    a context in which a model's parameters are whole, ordinary tensors (generation,
                  pushing weights into an engine, reading the anchor's output layer)
  compute         a context for forwards of a model outside its scorer (generation): autocast to the
                  compute dtype for float32 master weights held whole; nothing otherwise
  forget_forwards drop the bookkeeping of forwards that no backward will follow (the anchor)
  replica_hashes  each rank's hash of its own copy of a model (replicated only)
  ema_tensors     the tensors the EMA averages on this rank (whole tensors, or this rank's shards)
  ema_distance    ||theta - theta_ema|| / ||theta|| over the whole model
  model_state / load_model_state / optimizer_state / load_optimizer_state
                  full (unsharded) state dicts for checkpoints and final weights; model states
                  have one format, optimizer states do not (torch's per-index state dict vs the
                  distributed API's per-name one), so a run resumes only under the strategy that
                  wrote its checkpoint (checked in train/checkpoint.py)

`sharded` uses PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`) directly rather than
accelerate's FSDP plugin: accelerate enables FSDP only on GPUs and wraps a single model, while the
anchor must be sharded exactly like the policy so that each rank averages its own shard. Every
decoder layer (the model's `_no_split_modules` classes) is one FSDP unit, and the `TokenScorer`
around the model is the root; the anchor gets the same layout (in ema.dtype). Float32 master weights
(model.master_weights) are float32 shards that FSDP2 casts to the compute dtype when it gathers them
(`MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=float32)`); gradients are reduce-scattered in
float32. Replicated master weights run their forwards under autocast instead. FSDP2 shards every
parameter along dim 0 over the same ranks, so the policy's local shard and the anchor's local shard
of a parameter cover the same elements and the EMA update needs no communication.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import Tensor, nn

from emapg_cli.errors import UserError
from emapg_cli.grpo import distance_from_norms, ema_distance, ema_norms
from emapg_cli.models.loading import compute_autocast
from emapg_cli.train.loading import ema_tensors
from emapg_cli.train.logprobs import TokenScorer


def state_hash(state: dict[str, Tensor]) -> str:
    """sha256 over a state dict (names and raw bytes, in order)."""
    import hashlib

    h = hashlib.sha256()
    for name, t in state.items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Replicated:
    """Every rank holds the whole policy, anchor and optimizer state (one process, or DDP through accelerate)."""

    name = "replicated"

    def __init__(self, accelerator):
        self.acc = accelerator
        self._compute: dict[int, torch.dtype] = {}  # id(lm) -> compute dtype of float32 master weights

    def wrap(self, policy: nn.Module, anchor: Optional[nn.Module], make_optimizer,
             compute_dtype: Optional[torch.dtype] = None):
        """(policy scorer as the update runs it, anchor scorer or None, optimizer); DDP when several processes.
        `compute_dtype`: the policy's float32 master weights compute under autocast to it (None: no autocast)."""
        if compute_dtype is not None:
            self._compute[id(policy)] = compute_dtype
        scorer, optimizer = self.acc.prepare(TokenScorer(policy, compute_dtype), make_optimizer(policy.parameters()))
        if anchor is None:
            return scorer, None, optimizer
        anchor_scorer = anchor.scorer() if hasattr(anchor, "scorer") else TokenScorer(anchor)  # a LoRA anchor swaps adapters
        return scorer, anchor_scorer.to(self.acc.device), optimizer

    def no_sync(self, scorer, last: bool):
        return contextlib.nullcontext() if last else self.acc.no_sync(scorer)

    def clip_grad_norm(self, params: list[Tensor], max_norm: float) -> float:
        norm = self.acc.clip_grad_norm_(params, max_norm)
        return float(norm) if norm is not None else 0.0

    def full_weights(self, model: nn.Module):
        return contextlib.nullcontext()

    def compute(self, model: nn.Module):
        """Autocast to the policy's compute dtype when `model` is a policy with float32 master weights."""
        return compute_autocast(self.acc.device.type, self._compute.get(id(model)))

    def forget_forwards(self, model: nn.Module) -> None:
        pass

    def replica_hashes(self, model: nn.Module) -> Optional[list[str]]:
        """Every rank's sha256 of its own copy of `model` (which data parallelism must keep identical)."""
        from accelerate.utils import gather_object

        return gather_object([state_hash(model.state_dict())])

    def ema_tensors(self, model: nn.Module) -> list[Tensor]:
        return ema_tensors(model)

    def ema_distance(self, policy: nn.Module, anchor: nn.Module) -> float:
        if hasattr(anchor, "scorer"):  # a LoRA anchor: the distance over the adapters (the only weights that move)
            return ema_distance(ema_tensors(policy), list(anchor.parameters()))
        return ema_distance(list(policy.parameters()), list(anchor.parameters()))

    def model_state(self, model: nn.Module) -> dict[str, Tensor]:
        return model.state_dict()

    def load_model_state(self, model: nn.Module, state: dict[str, Tensor]) -> None:
        model.load_state_dict(state)

    def optimizer_state(self, scorer, optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state(self, scorer, optimizer, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)


class Sharded:
    """FSDP2: parameters, gradients, AdamW state and the float32 anchor are sharded over the ranks."""

    name = "sharded"

    def __init__(self, accelerator):
        if accelerator.mixed_precision != "no":  # no autocast or grad scaler here: emapg sets the precision itself
            raise UserError(f"train.parallel=fsdp computes in model.dtype (float32 master weights: model.master_weights); "
                            f"launch with --mixed_precision no "
                            f"(got {accelerator.mixed_precision})")
        self.acc = accelerator
        self._roots: dict[int, nn.Module] = {}  # id(lm) -> its FSDP root (the TokenScorer around it)

    # ---------------------------------------------------------------- wrapping
    def _shard(self, lm: nn.Module, compute_dtype: Optional[torch.dtype] = None) -> TokenScorer:
        """FSDP2 over `lm`'s decoder layers and the `TokenScorer` root. `compute_dtype`: `lm` holds float32
        master weights; every unit all-gathers its shards cast to this dtype for forward and backward and
        reduce-scatters the gradients in float32 (the shards, their gradients and AdamW state stay float32)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        units = set(getattr(lm, "_no_split_modules", None) or ())
        layers = [m for m in lm.modules() if type(m).__name__ in units]
        if not layers:
            raise RuntimeError(f"{type(lm).__name__} names no decoder-layer class in _no_split_modules; cannot shard it")
        # No lm.to(device) first: fully_shard moves each unit's own parameters to the device as it
        # shards them, so a GPU never holds more than one whole unit (the model stays in CPU memory
        # until then; each rank loads it there, and the float32 anchor copy too).
        # reshard_after_forward=True for the root too (FSDP2's default keeps a root's weights whole
        # after forward): outside a forward every unit then holds only its shard, which the EMA
        # update and the distance rely on, and the anchor, which never runs backward, frees them.
        mp = {}
        if compute_dtype is not None:
            # the root's inputs are ids and masks, and the exact estimator's anchor states (kwargs) keep their dtype
            mp = {"mp_policy": MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32,
                                                    cast_forward_inputs=False)}
        for layer in layers:
            fully_shard(layer, reshard_after_forward=True, **mp)
        root = fully_shard(TokenScorer(lm), reshard_after_forward=True, **mp)
        # FSDP2 picks its root on the first forward it sees. Generation and the exact estimator call
        # submodules directly, so run one token through the root now to fix the root before that.
        with torch.no_grad():
            two = torch.ones(1, 2, dtype=torch.long, device=self.acc.device)  # [1, 2]: a 1-token prompt, 1 masked-out response token
            root(two, two, 1, torch.zeros(1, 1, dtype=torch.bool, device=self.acc.device), entropy=False)
        self._roots[id(lm)] = root
        return root

    def wrap(self, policy: nn.Module, anchor: Optional[nn.Module], make_optimizer,
             compute_dtype: Optional[torch.dtype] = None):
        """Shard the anchor and the policy the same way; the optimizer is built over the policy's shards.
        `compute_dtype`: the policy's float32 master weights compute in it (FSDP2 mixed precision)."""
        anchor_root = self._shard(anchor) if anchor is not None else None
        root = self._shard(policy, compute_dtype)
        return root, anchor_root, make_optimizer(root.parameters())

    def _fsdp_modules(self, model: nn.Module) -> list[nn.Module]:
        from torch.distributed.fsdp import FSDPModule

        root = self._roots.get(id(model), model)
        return [m for m in root.modules() if isinstance(m, FSDPModule)]

    # ---------------------------------------------------------------- update
    def no_sync(self, scorer, last: bool):
        """Nothing to skip: every micro-batch's gradients are reduce-scattered at once, so gradients
        stay sharded (FSDP2 without sync would hold whole, unsharded gradients until the last
        micro-batch: P x bytes(dtype) per rank, the memory sharding is for)."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, params: list[Tensor], max_norm: float) -> float:
        """torch's clip on DTensor gradients: the norm is reduced over the ranks (the same value on all)."""
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        full = getattr(norm, "full_tensor", None)
        return float(full() if full is not None else norm)

    # ---------------------------------------------------------------- whole weights
    @contextlib.contextmanager
    def full_weights(self, model: nn.Module) -> Iterator[None]:
        """All-gather every unit of `model` (the policy or the anchor) and keep it whole until exit.

        While inside, the modules hold ordinary full tensors and no forward triggers a collective,
        so ranks may generate different numbers of tokens. Costs one full copy of the model per rank.
        Every rank must enter it (the all-gathers are collectives).
        """
        modules = self._fsdp_modules(model)
        for m in modules:
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()
        try:
            yield
        finally:
            for m in modules:
                m.reshard()
                m.set_reshard_after_forward(True, recurse=False)
            self.forget_forwards(model)

    def compute(self, model: nn.Module):
        """Nothing: FSDP2's mixed precision already gathers master weights in the compute dtype (`full_weights` too)."""
        return contextlib.nullcontext()

    def forget_forwards(self, model: nn.Module) -> None:
        """Clear FSDP2's per-iteration record of forwards run by `model` without a backward.

        FSDP2 appends every unit's forward to an order list that only a backward through the root
        (or `reset_iter_state`) clears; the anchor never runs backward, and generation runs many
        forwards, so without this the lists would grow for the whole run. Call it outside any
        forward/backward of that model.
        """
        root = self._roots.get(id(model))
        if root is not None:
            root.reset_iter_state()

    # ---------------------------------------------------------------- EMA
    def ema_tensors(self, model: nn.Module) -> list[Tensor]:
        """This rank's shards of the parameters (then the replicated buffers), in module order."""
        with torch.no_grad():
            return [t.to_local() if hasattr(t, "to_local") else t for t in ema_tensors(model)]

    def ema_distance(self, policy: nn.Module, anchor: nn.Module) -> float:
        import torch.distributed as dist

        with torch.no_grad():
            local = [p.to_local() for p in policy.parameters()], [p.to_local() for p in anchor.parameters()]
        norms = ema_norms(*local).to(self.acc.device)  # [2]: this rank's sums of squares
        dist.all_reduce(norms)
        return distance_from_norms(norms)

    def replica_hashes(self, model: nn.Module) -> Optional[list[str]]:
        """None: a sharded model exists once, split over the ranks, so there are no copies to compare."""
        return None

    # ---------------------------------------------------------------- state dicts
    def model_state(self, model: nn.Module) -> dict[str, Tensor]:
        """The whole model's state dict on the main rank, in CPU memory (the others get {}). Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # gathering copies each name separately; tied parameters (embeddings / output layer) must
        # stay one tensor, as in an unsharded state dict, so save_pretrained writes them once
        first: dict[int, str] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            if id(param) in first and name in state:
                state[name] = state[first[id(param)]]
            first.setdefault(id(param), name)
        return state

    def load_model_state(self, model: nn.Module, state: dict[str, Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))

    def optimizer_state(self, scorer, optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(scorer, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_optimizer_state(self, scorer, optimizer, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(scorer, optimizer, state, options=StateDictOptions(full_state_dict=True))


def make_strategy(accelerator, parallel: str):
    """`sharded` for train.parallel=fsdp with several processes; otherwise `replicated` (FSDP over one rank is one device)."""
    if parallel == "fsdp" and accelerator.num_processes > 1:
        return Sharded(accelerator)
    return Replicated(accelerator)
