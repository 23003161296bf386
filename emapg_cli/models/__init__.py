"""Model helpers: loading a causal LM and its tokenizer (`loading`), prompt rendering (`prompts`), the prompt-sharing
layout of a pass (`prefix`), and tiny local models for tests and the toy task (`tiny`)."""
