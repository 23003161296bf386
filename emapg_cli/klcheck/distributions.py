"""The distributions kl-check measures on: per-position logits of the policy, the anchor and
(optionally) the sampling policy, all float64 [P, V].

Sources: a synthetic generator (pure tensor math, below), a user's `.npz` file
(`load_logits_npz`) and a local transformers model (`emapg_cli.klcheck.model_source`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from emapg_cli.errors import UserError, first_line
from emapg_cli.kl.exact import exact_reverse

#: The top-k size whose complement the synthetic `tail_mass` refers to.
SYNTHETIC_HEAD = 32
#: Largest |logit| accepted: beyond it, squared log-ratios overflow float64 (-1e3 already means
#: probability zero next to ordinary logits).
LOGIT_LIMIT = 1e100


@dataclass(frozen=True)
class LogitSet:
    """Unnormalised logits, float64 [P, V]; `sampling` None means on-policy (sampling = policy)."""

    policy: Tensor  # [P, V]
    anchor: Tensor  # [P, V]
    sampling: Optional[Tensor] = None  # [P, V]
    source: str = "synthetic"

    @property
    def positions(self) -> int:
        return self.policy.shape[0]

    @property
    def vocab(self) -> int:
        return self.policy.shape[1]


def check_logits(policy: Tensor, anchor: Tensor, sampling: Optional[Tensor], where: str) -> LogitSet:
    """Validate shapes and values (UserError with one line on any problem); return float64 copies."""
    arrays = {"policy": policy, "anchor": anchor} | ({"sampling": sampling} if sampling is not None else {})
    for name, a in arrays.items():
        if a.dim() != 2:
            raise UserError(f"{where}: array '{name}' must be 2-D [positions, vocab], got shape {tuple(a.shape)}")
        if not (a.dtype.is_floating_point):
            raise UserError(f"{where}: array '{name}' must hold floats, got {a.dtype}")
        if a.shape[0] < 1 or a.shape[1] < 2:
            raise UserError(f"{where}: array '{name}' needs at least 1 position and 2 vocabulary entries, got shape {tuple(a.shape)}")
        if a.shape != policy.shape:
            raise UserError(f"{where}: array '{name}' has shape {tuple(a.shape)} but 'policy' has {tuple(policy.shape)}")
        if torch.isnan(a).any():
            raise UserError(f"{where}: array '{name}' contains NaN")
        if not torch.isfinite(a).all():
            raise UserError(f"{where}: array '{name}' contains +-inf (use a large negative logit such as -1e3 for zero probability)")
        peak = float(a.abs().max())
        if peak > LOGIT_LIMIT:
            raise UserError(f"{where}: array '{name}' holds a logit of magnitude {peak:.3g} > {LOGIT_LIMIT:g} (use a large negative logit such as -1e3 for zero probability)")
    conv = {n: a.to(torch.float64) for n, a in arrays.items()}
    return LogitSet(conv["policy"], conv["anchor"], conv.get("sampling"), source=where)


#: The arrays kl-check reads from an .npz file (others are ignored, never decompressed).
NPZ_ARRAYS = ("policy", "anchor", "sampling")


def npz_shape(path: str | Path) -> tuple[int, int]:
    """(P, V) of the logits in an .npz file, from the .npy headers inside the zip only (no array is
    decompressed): every problem with the file is a UserError, one line, before any memory is used.

    Checked per array: a float dtype (no object arrays: pickles are never loaded), 2-D [P, V] with P >= 1,
    V >= 2, the same shape as `policy`, and a zip member exactly as large as its header declares
    (header + P x V x itemsize bytes), so the memory estimate made from the shape is what loading takes.
    """
    import zipfile

    import numpy as np
    from numpy.lib import format as npy

    path = Path(path)
    where = path.name
    try:
        zf = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise UserError(f"cannot read {path}: no such file") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    except (zipfile.BadZipFile, ValueError, EOFError) as e:
        raise UserError(f"cannot read {path} as .npz: not a zip file ({first_line(e)})") from None
    shapes: dict[str, tuple[int, ...]] = {}
    with zf:
        members = {info.filename[:-4]: info for info in zf.infolist() if info.filename.endswith(".npy")}
        for name in ("policy", "anchor"):
            if name not in members:
                raise UserError(f"{path}: missing array '{name}' (found: {', '.join(sorted(members))[:200] or 'none'})")
        for name in NPZ_ARRAYS:
            if name not in members:
                continue
            info = members[name]
            try:
                with zf.open(info) as fp:
                    version = npy.read_magic(fp)
                    if version == (1, 0):
                        shape, _, dtype = npy.read_array_header_1_0(fp)
                    elif version == (2, 0):
                        shape, _, dtype = npy.read_array_header_2_0(fp)
                    else:
                        raise ValueError(f"unsupported .npy format version {version}")
                    header_bytes = fp.tell()
            except Exception as e:  # zip (CRC, compression) and .npy header errors: "not readable"
                raise UserError(f"cannot read array '{name}' of {path}: {type(e).__name__}: {first_line(e)}") from None
            if dtype.hasobject or dtype.kind != "f":
                raise UserError(f"{where}: array '{name}' must hold floats, got {dtype}")
            if len(shape) != 2:
                raise UserError(f"{where}: array '{name}' must be 2-D [positions, vocab], got shape {tuple(shape)}")
            if shape[0] < 1 or shape[1] < 2:
                raise UserError(f"{where}: array '{name}' needs at least 1 position and 2 vocabulary entries, got shape {tuple(shape)}")
            if name != "policy" and tuple(shape) != shapes["policy"]:
                raise UserError(f"{where}: array '{name}' has shape {tuple(shape)} but 'policy' has {shapes['policy']}")
            declared = header_bytes + int(np.prod(shape, dtype=object)) * dtype.itemsize
            if info.file_size != declared:
                raise UserError(f"{where}: array '{name}' declares shape {tuple(shape)} of {dtype} ({declared:,} bytes with its header) "
                                f"but its zip member holds {info.file_size:,} bytes")
            shapes[name] = tuple(shape)
    return shapes["policy"]


def load_logits_npz(path: str | Path) -> LogitSet:
    """Read `policy` [P, V], `anchor` [P, V] and optional `sampling` [P, V] from an .npz file
    (their headers first checked by `npz_shape`, so the file holds what they declare)."""
    import numpy as np

    path = Path(path)
    npz_shape(path)
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {name: f[name] for name in NPZ_ARRAYS if name in f.files}
    except FileNotFoundError:
        raise UserError(f"cannot read {path}: no such file") from None
    except Exception as e:  # zip/pickle/format errors: all "not a readable .npz"
        raise UserError(f"cannot read {path} as .npz: {type(e).__name__}: {e}".splitlines()[0]) from None
    # float dtypes only: npz_shape refused any other from the same headers
    tensors = {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in arrays.items()}
    return check_logits(tensors["policy"], tensors["anchor"], tensors.get("sampling"), where=path.name)


def zipf_logits(positions: int, vocab: int, sharpness: float, tail_mass: float, generator: torch.Generator) -> Tensor:
    """Zipf-profile logits with a set tail mass, randomly permuted per position: [P, V] float64.

    Token of rank i gets logit -sharpness * log(i) (a Zipf law with exponent `sharpness`); the
    ranks beyond SYNTHETIC_HEAD (capped at V - 1) are then shifted by one constant c so that
    the mass outside the head is exactly `tail_mass`:
        c = log(T / (1 - T)) + logsumexp(head) - logsumexp(tail).
    """
    head = min(SYNTHETIC_HEAD, vocab - 1)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)  # [V]
    profile = -sharpness * torch.log(ranks)  # [V]
    shift = math.log(tail_mass / (1.0 - tail_mass)) + torch.logsumexp(profile[:head], 0) - torch.logsumexp(profile[head:], 0)
    profile[head:] += shift
    perm = torch.argsort(torch.rand(positions, vocab, generator=generator, dtype=torch.float64), dim=1)  # [P, V]
    return profile[perm]  # [P, V]


def perturb_to_kl(logits: Tensor, target_kl: float, generator: torch.Generator, iters: int = 16) -> Tensor:
    """logits + eps * N(0, 1) noise [P, V], with eps per position such that
    KL(softmax(logits) || softmax(result)) = target_kl (to ~1e-4 relative).

    Small-eps theory gives KL ~ eps^2 Var_pi(noise) / 2, so eps0 = sqrt(2 KL / Var_pi(noise));
    the KL grows monotonically with eps for a fixed noise draw, so bisection on log(eps) over
    [eps0 / 4, 4 eps0] (widened while it does not bracket) converges: 16 halvings of a factor-16
    bracket leave a relative error of 16^(2^-16) - 1 ~ 4e-5 in eps (~1e-4 in the KL).
    """
    noise = torch.randn(logits.shape, generator=generator, dtype=torch.float64)  # [P, V]
    pi = torch.softmax(logits, -1)  # [P, V]
    var = (pi * noise**2).sum(-1) - (pi * noise).sum(-1) ** 2  # [P]
    eps0 = torch.sqrt(2 * target_kl / var.clamp_min(1e-12))  # [P]
    lo, hi = torch.log(eps0 / 4), torch.log(eps0 * 4)  # [P]

    def kl_at(log_eps: Tensor) -> Tensor:
        return exact_reverse(logits, logits + log_eps.exp()[:, None] * noise)  # [P] KL(pi || softmax(perturbed))

    for _ in range(20):
        over, under = kl_at(lo) > target_kl, kl_at(hi) < target_kl
        if not (over.any() or under.any()):
            break
        lo, hi = torch.where(over, lo - 2, lo), torch.where(under, hi + 2, hi)
    for _ in range(iters):
        mid = (lo + hi) / 2
        short = kl_at(mid) < target_kl
        lo, hi = torch.where(short, mid, lo), torch.where(short, hi, mid)
    return logits + ((lo + hi) / 2).exp()[:, None] * noise


def synthetic(
    positions: int, vocab: int, *, sharpness: float, tail_mass: float, kl_size: float, sampling_kl: float, seed: int
) -> LogitSet:
    """Synthetic policy (`zipf_logits`), anchor = policy perturbed to reverse KL `kl_size` per
    position, and sampling = policy perturbed to reverse KL `sampling_kl` (0: on-policy)."""
    if vocab < 2:
        raise UserError(f"--vocab must be at least 2, got {vocab}")
    if positions < 1:
        raise UserError(f"--positions must be at least 1, got {positions}")
    if not 0.0 < tail_mass < 1.0:
        raise UserError(f"--tail-mass must be in (0, 1), got {tail_mass}")
    if sharpness < 0 or kl_size <= 0 or sampling_kl < 0:
        raise UserError("--sharpness and --sampling-kl must be >= 0 and --kl-size > 0")
    g = torch.Generator().manual_seed(seed)
    policy = zipf_logits(positions, vocab, sharpness, tail_mass, g)
    anchor = perturb_to_kl(policy, kl_size, g)
    sampling = perturb_to_kl(policy, sampling_kl, g) if sampling_kl > 0 else None
    label = f"synthetic (Zipf {sharpness:g}, tail mass {tail_mass:g}, KL {kl_size:g}" + (f", sampling KL {sampling_kl:g})" if sampling_kl > 0 else ")")
    return LogitSet(policy, anchor, sampling, source=label)
