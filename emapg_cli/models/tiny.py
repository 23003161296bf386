"""Tiny causal LMs and a byte-level tokenizer with a chat template, built locally.

Nothing here downloads: tests, the toy task and `kl-check --model` examples build their own
models with these helpers and save them in `save_pretrained` format, so every loader in emapg
is exercised on real transformers classes (Qwen2 or Llama) without a hub.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

#: Qwen-style chat template: the question is the single user message; generation opens an
#: assistant turn and ends with <|im_end|> (the tokenizer's EOS).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_byte_tokenizer(corpus: list[str] | None = None, vocab_size: int | None = None):
    """A byte-level BPE `PreTrainedTokenizerFast` (the GPT-2/Qwen2 scheme), built locally.

    With no `corpus` it has no merges: one token per byte (256 + 3 special tokens), which makes
    digits separate tokens (good for the toy arithmetic task) and round-trips any UTF-8 text.
    With a corpus, `vocab_size` adds merges learnt from it. Byte-level BPE is also what
    transformers rebuilds for `model_type: qwen2` when loading with AutoTokenizer, so a saved
    tiny Qwen2 model round-trips exactly. EOS is <|im_end|>, padding is <|endoftext|> on the left
    (what batched generation needs).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size or len(alphabet) + len(SPECIAL_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(corpus or [""], trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_tiny_model(
    tokenizer,
    arch: Literal["qwen2", "llama"] = "qwen2",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 1024,
    seed: int = 0,
    init_std: float | None = None,
):
    """A randomly initialised Qwen2/Llama causal LM sized for CPU tests (~100k parameters).

    `init_std` sets the initialiser's standard deviation (`initializer_range`, transformers'
    default 0.02). At 0.02 a random tiny model's next-token distribution is nearly uniform and
    greedy decoding mostly repeats the last prompt token; about 0.3 gives peaked, input-dependent
    distributions, which tests comparing two implementations' greedy outputs need.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cfg_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    config = cfg_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **({} if init_std is None else {"initializer_range": init_std}),
    )
    torch.manual_seed(seed)
    return model_cls(config)


def save_tiny(path: str | Path, arch: Literal["qwen2", "llama"] = "qwen2", seed: int = 0, **model_kwargs) -> Path:
    """Build a tiny model with the byte tokenizer and save both to `path` (save_pretrained format)."""
    path = Path(path)
    tokenizer = build_byte_tokenizer()
    model = build_tiny_model(tokenizer, arch=arch, seed=seed, **model_kwargs)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


#: Special tokens of the tiny BERT encoder's WordPiece tokenizer (BERT's own names).
ENCODER_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def save_tiny_encoder(path: str | Path, texts: list[str], vocab_size: int = 1000, hidden: int = 32, layers: int = 2,
                      heads: int = 2, max_positions: int = 128, seed: int = 0) -> Path:
    """A randomly initialised tiny BERT encoder and a lower-cased WordPiece tokenizer (every character of `texts`, then
    their most frequent words up to `vocab_size`; other words are spelled in characters), saved to
    `path` in `save_pretrained` format (what the dense retriever loads, with mean pooling, like e5-base-v2).

    Tests of the dense retriever and `scripts/benchmarks/train_tiny_encoder.py` build it; nothing is downloaded.
    """
    from collections import Counter

    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    normalizer, pre = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    counts: Counter[str] = Counter(w for t in texts for w, _ in pre.pre_tokenize_str(normalizer.normalize_str(t)))
    chars = sorted({c for w in counts for c in w})
    vocab = [*ENCODER_SPECIAL_TOKENS, *chars, *(f"##{c}" for c in chars)]
    words = sorted((w for w in counts if len(w) > 1), key=lambda w: (-counts[w], w))  # most frequent first, ties by name
    vocab += words[:max(0, vocab_size - len(vocab))]  # deterministic (the WordPiece trainer breaks ties by hash order)
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer, tok.pre_tokenizer, tok.decoder = normalizer, pre, decoders.WordPiece()
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                 sep_token="[SEP]", mask_token="[MASK]", model_max_length=max_positions)
    config = BertConfig(vocab_size=len(hf), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=hidden * 4, max_position_embeddings=max_positions,
                        pad_token_id=hf.pad_token_id)
    torch.manual_seed(seed)
    path = Path(path)
    BertModel(config).save_pretrained(path)
    hf.save_pretrained(path)
    return path
