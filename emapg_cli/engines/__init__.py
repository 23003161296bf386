"""Generation engines behind one small interface (`base.Engine`): `hf` (transformers) and `vllm`."""
