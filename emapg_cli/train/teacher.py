"""A teacher as the anchor (anchor.source=teacher): checked against the policy before any weights load, loaded
frozen, fingerprinted so a resume can tell it is the same model.

The teacher is never updated (the trainer skips the EMA step for it), never saved in checkpoints or final/ (a
checkpoint's state.json records `teacher`: its path and `teacher_fingerprint`), and may run in a lower precision
than the policy (anchor.dtype).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Optional

from emapg_cli.errors import UserError
from emapg_cli.paths import expand, prepare_hint

#: The attribute of a loaded teacher module holding {"path", "sha256"} (`is_teacher`, `teacher_record`).
TEACHER_ATTR = "emapg_teacher"
#: `teacher_fingerprint` reads each file whole up to this size, else its first and last FINGERPRINT_EDGE bytes.
FINGERPRINT_EDGE = 1 << 20


def teacher_fingerprint(folder: Path) -> str:
    """sha256 over every regular file of the teacher's folder, in name order: its name, its size, and its bytes --
    all of them for a file up to 2 MiB (config, tokenizer, a toy model's weights), else its first and last MiB.

    A choice of speed over completeness: hashing a 16 GB checkpoint whole on every start and resume would take a
    minute, while a retrained or replaced model changes sizes, the config, or the bytes at the ends of its weight
    files (safetensors' header, which lists every tensor's offsets, is at the start). An edit in the middle of a large
    weight file that keeps its size goes unseen."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(folder).iterdir() if p.is_file()):
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            if size <= 2 * FINGERPRINT_EDGE:
                digest.update(f.read())
            else:
                digest.update(f.read(FINGERPRINT_EDGE))
                f.seek(size - FINGERPRINT_EDGE)
                digest.update(f.read(FINGERPRINT_EDGE))
    return digest.hexdigest()


def teacher_folder(path: str) -> Path:
    """anchor.path expanded (~, $EMAPG_HOME), a local model folder, checked (`models.folder.check_model_folder`:
    config.json, the safetensors headers); a one-line UserError otherwise."""
    from emapg_cli.models.folder import check_model_folder

    folder = check_model_folder(path, "anchor.path") or expand(path)
    if not (folder / "config.json").is_file():
        raise UserError(f"anchor.path {folder}: no teacher checkpoint there (a save_pretrained folder with "
                        f"config.json){prepare_hint(folder)}")
    return folder


def _tokenizer_view(tok) -> tuple[Any, ...]:
    """What must agree between two tokenizers for the teacher's log-probs to score the policy's tokens: the id of
    every token string, and the special tokens (BOS/EOS/PAD/..., by string and id)."""
    specials = sorted((str(name), str(value)) for name, value in tok.special_tokens_map.items())
    return tok.get_vocab(), specials, tok.all_special_ids


def check_teacher(anchor_cfg, model_cfg, policy_vocab: Optional[int], vocab: Optional[int] = None) -> None:
    """The teacher shares the policy's vocabulary and tokenizer: config.json's vocab_size (the output layer's size)
    and the tokenizers' token -> id maps and special tokens. Reads config.json and the tokenizer files only (no
    weights), so a mismatch is one line at once (exit 2). `policy_vocab`, `vocab`: the policy's and the teacher's
    config.json vocab_size (`preflight.vocab_size`; None: not compared)."""
    folder = teacher_folder(anchor_cfg.path)
    if policy_vocab is not None and vocab is not None and vocab != policy_vocab:
        raise UserError(f"anchor.path {folder}: the teacher's vocabulary has {vocab} ids and the policy's (model.path) "
                        f"{policy_vocab}: a teacher must share the policy's tokenizer and vocabulary")
    from emapg_cli.models.loading import load_tokenizer

    try:
        teacher_tok = load_tokenizer(str(folder), model_cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"anchor.path {folder}: its tokenizer does not load ({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})") from None
    policy_tok = load_tokenizer(model_cfg.path, model_cfg.trust_remote_code)
    mine, theirs = _tokenizer_view(policy_tok), _tokenizer_view(teacher_tok)
    if mine != theirs:
        what = "token -> id map" if mine[0] != theirs[0] else "special tokens"
        raise UserError(f"anchor.path {folder}: the teacher's tokenizer ({len(teacher_tok)} tokens) differs from the "
                        f"policy's ({len(policy_tok)} tokens) in its {what}: a teacher must share the policy's tokenizer")


def load_teacher(anchor_cfg, model_cfg):
    """The teacher causal LM from anchor.path in anchor.dtype (null: model.dtype), in eval mode, without gradients,
    tagged with its path and fingerprint (`teacher_record`). Never updated."""
    from emapg_cli.models.loading import load_causal_lm

    folder = teacher_folder(anchor_cfg.path)
    record = {"path": str(folder), "sha256": teacher_fingerprint(folder)}
    teacher = load_causal_lm(str(folder), anchor_cfg.dtype or model_cfg.dtype, trust_remote_code=model_cfg.trust_remote_code,
                             what="anchor.path")
    teacher.eval().requires_grad_(False)
    setattr(teacher, TEACHER_ATTR, record)
    return teacher


def teacher_record(model) -> Optional[dict[str, str]]:
    """{"path", "sha256"} of a teacher loaded by `load_teacher`; None for any other model (an EMA anchor)."""
    return getattr(model, TEACHER_ATTR, None) if model is not None else None


def check_same_teacher(saved: Optional[dict[str, Any]], teacher, checkpoint: Path) -> None:
    """On resume: the checkpoint's recorded teacher (`saved`, from its state.json) is the one loaded now
    (same fingerprint), or a one-line UserError."""
    now = teacher_record(teacher)
    if now is None:
        if saved is not None:
            raise UserError(f"{checkpoint} was trained with a teacher anchor ({saved.get('path')}): resume with anchor.source=teacher")
        return
    if not isinstance(saved, dict):
        raise UserError(f"{checkpoint} holds an EMA anchor run's state, not a teacher's: resume with anchor.source=ema")
    if saved.get("sha256") != now["sha256"]:
        raise UserError(f"the teacher at {now['path']} changed since {checkpoint} was written (fingerprint "
                        f"{str(saved.get('sha256'))[:12]} then, {now['sha256'][:12]} now): restore it, or start a new run")
