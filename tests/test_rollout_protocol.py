"""The rollout server's wire format and checks, as pure functions (milliseconds): sampling parameters and completions
through JSON and back, bounded refusals, the push manifest, model/tokenizer fingerprints, rollout.engine_url's config."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from emapg_cli.engines.base import Completion, SamplingParams
from emapg_cli.errors import UserError
from emapg_cli.engines.rollout_protocol import (ProtocolError, check_manifest, completion_to_json, completions_from_json,
                                                manifest, params_from_json, params_to_json, token_lists)
from emapg_cli.models.fingerprint import first_difference, model_fingerprint, params_digest, tokenizer_fingerprint


def test_params_round_trip_through_json():
    p = SamplingParams(n=3, max_new_tokens=7, temperature=0.7, top_p=0.9, stop=("</a>",), seed=2**62 + 5, topk=4, min_version=-1)
    assert params_from_json(json.loads(json.dumps(params_to_json(p)))) == p
    assert params_from_json({}) == SamplingParams()  # every field defaults as the dataclass does


@pytest.mark.parametrize("bad, field", [({"n": 0}, "params.n"), ({"seed": True}, "params.seed"), ({"temperature": "1"}, "params.temperature"),
                                        ({"stop": "x"}, "params.stop"), ({"min_version": 1.5}, "params.min_version"),
                                        ({"pickle": 1}, "unknown key 'pickle'")])
def test_params_refused_naming_the_field(bad, field):
    with pytest.raises(ProtocolError, match=field.replace(".", r"\.")):
        params_from_json(bad)


def test_token_lists_checks_ids_against_the_vocabulary():
    assert token_lists([[0, 258], []], "prompts", 259) == [[0, 258], []]
    for bad in ([[259]], [[-1]], [[True]], [["1"]], [1], "x"):
        with pytest.raises(ProtocolError, match="prompts"):
            token_lists(bad, "prompts", 259)


def test_completion_round_trip_is_exact():
    # log-probs travel as float64 bytes: a value with 17 significant digits comes back bit for bit
    lp = [-0.1234567890123456789, -5.0, -1e-300]
    topk = torch.tensor([[3, 1], [0, 2], [7, 7]])  # [len 3, k 2]
    c = Completion(token_ids=[5, 6, 7], text="abc", finish_reason="stop", logprobs=lp, topk_index=topk)
    reply = {"completions": [[completion_to_json(c)]], "weights_version": 4, "wait_s": 0.25}
    rows, version, wait = completions_from_json(json.loads(json.dumps(reply)), prompts=1, n=1)
    got = rows[0][0]
    assert (got.token_ids, got.text, got.finish_reason, got.weights_version) == ([5, 6, 7], "abc", "stop", 4)
    assert got.logprobs == lp and torch.equal(got.topk_index, topk) and got.topk_index.dtype == torch.int64
    assert (version, wait) == (4, 0.25)


def test_malformed_replies_are_refused_with_one_line():
    good = completion_to_json(Completion([5, 6], "ab", "length", [-1.0, -2.0]))
    cases = [
        ({"completions": [[good]], "weights_version": 0}, 2, 1, "does not hold 1 completions for each of 2 prompts"),
        ({"completions": [[{**good, "logprobs": good["logprobs"][:-4]}]], "weights_version": 0}, 1, 1, "whole number"),
        ({"completions": [[{**good, "finish_reason": "eos"}]], "weights_version": 0}, 1, 1, "finish_reason"),
        # "AAAAAA==" is 4 bytes: one int32 id where 2 tokens x k 2 need 4
        ({"completions": [[{**good, "topk": "AAAAAA==", "k": 2}]], "weights_version": 0}, 1, 1, "1 top-k ids for 2 tokens x k 2"),
        ({"completions": [[good]]}, 1, 1, "weights_version must be an integer"),
        ([], 1, 1, 'no "completions"'),
    ]
    for reply, prompts, n, message in cases:
        with pytest.raises(ProtocolError, match=message) as e:
            completions_from_json(reply, prompts, n)
        assert "\n" not in str(e.value)


def test_manifest_must_hold_every_parameter_once_with_the_servers_dtype_and_shape():
    expected = {"a": ("float32", [2, 3]), "b": ("float32", [4])}
    named = [("a", torch.zeros(2, 3)), ("b", torch.zeros(4))]
    assert check_manifest(manifest(named), expected) == [("a", "float32", [2, 3]), ("b", "float32", [4])]
    with pytest.raises(ProtocolError, match=r"b: bfloat16 \[4\] pushed, the server holds float32 \[4\]"):
        check_manifest(manifest([named[0], ("b", torch.zeros(4, dtype=torch.bfloat16))]), expected)
    with pytest.raises(ProtocolError, match="misses parameter 'b'"):
        check_manifest(manifest(named[:1]), expected)
    with pytest.raises(ProtocolError, match="no parameter 'c'"):
        check_manifest(manifest(named + [("c", torch.zeros(1))]), expected)
    with pytest.raises(ProtocolError, match="repeats"):
        check_manifest(manifest(named + named[:1]), expected)


def test_model_fingerprint_names_the_first_difference():
    cfg = SimpleNamespace(architectures=["Qwen2ForCausalLM"], vocab_size=259, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    shapes = [("embed.weight", (259, 64)), ("norm.weight", (64,))]
    ours = model_fingerprint(cfg, shapes)
    assert first_difference(ours, model_fingerprint(cfg, list(reversed(shapes)))) is None  # order does not matter
    deeper = SimpleNamespace(**{**vars(cfg), "num_hidden_layers": 3})
    assert first_difference(ours, model_fingerprint(deeper, shapes)) == "num_hidden_layers 2 vs 3"
    assert first_difference(ours, model_fingerprint(cfg, shapes[:1])) == "parameter names or shapes"
    assert first_difference(ours, None) == "the model fingerprint is missing"
    assert params_digest([("a", (1,))]) != params_digest([("a", (2,))])


def test_tokenizer_fingerprint_sees_vocab_specials_and_template():
    class Tok:
        def __init__(self, vocab, template, eos="</s>"):
            self.vocab, self.chat_template, self.special_tokens_map = vocab, template, {"eos_token": eos}

        def get_vocab(self):
            return dict(self.vocab)

    base = Tok({"a": 0, "b": 1}, "{{ x }}")
    same = tokenizer_fingerprint(base)
    assert tokenizer_fingerprint(Tok({"b": 1, "a": 0}, "{{ x }}")) == same  # dict order does not matter
    for other in (Tok({"a": 0, "c": 1}, "{{ x }}"), Tok({"a": 0, "b": 1}, "{{ y }}"), Tok({"a": 0, "b": 1}, "{{ x }}", eos="<e>")):
        assert tokenizer_fingerprint(other) != same


def test_engine_url_config_and_refusals():
    from pydantic import ValidationError

    from emapg_cli.config.models import Config

    cfg = Config.model_validate({"rollout": {"engine_url": "http://127.0.0.1:8100/"}})
    assert cfg.rollout.engine_url == "http://127.0.0.1:8100" and cfg.rollout.engine_timeout_s == 1800.0
    assert Config().rollout.engine_url is None  # default: the engine in the trainer's process
    # a run's config.yaml holds every key at its value: it validates again (--resume), with and without a server
    for data in ({"rollout": {"engine_url": "http://h:1"}}, {}):
        dumped = Config.model_validate(data).model_dump()
        assert Config.model_validate(dumped).rollout.engine_url == dumped["rollout"]["engine_url"]
    refusals = [
        ({"rollout": {"engine_url": "127.0.0.1:8100"}}, "must be the http://HOST:PORT of a rollout server"),
        ({"rollout": {"engine_url": "http://h:1", "gpu_memory_utilization": 0.3}}, "rollout.gpu_memory_utilization sets up an engine"),
        ({"rollout": {"engine_url": "http://h:1", "hf_batch_size": 8}}, "rollout.hf_batch_size sets up an engine"),
        ({"rollout": {"engine_url": "http://h:1", "hf_fast_decode": False}}, "rollout.hf_fast_decode sets up an engine"),
        ({"rollout": {"engine_url": "http://h:1", "hf_attention": "cascade"}}, "rollout.hf_attention is gone"),
        ({"rollout": {"engine_url": "http://h:1"}, "lora": {"r": 4}}, "lora.r > 0 with rollout.engine_url"),
        ({"rollout": {"engine_timeout_s": 5}}, "set rollout.engine_url too"),
        ({"rollout": {"engine_weights_backend": "nccl"}}, "rollout.engine_weights_backend is gone"),
    ]
    for data, message in refusals:
        with pytest.raises(ValidationError, match=message):
            Config.model_validate(data)
    assert "hf_attention" not in Config.model_validate({"rollout": {"hf_attention": "sdpa"}}).rollout.model_dump()  # old runs' config.yaml


def test_engine_url_refuses_several_processes():
    from emapg_cli.config.models import Config
    from emapg_cli.train.preflight import launch_problems

    cfg = Config.model_validate({"rollout": {"engine_url": "http://h:1", "prompts_per_step": 4}, "train": {"mini_batch_prompts": 2}})
    assert launch_problems(cfg, 1) == []
    assert launch_problems(cfg, 2) == ["rollout.engine_url with several training processes is not supported yet: launch one process"]


@pytest.mark.parametrize("argv, message", [
    (["rollout", "serve", "--model", "/nonexistent/m"], "--model /nonexistent/m: no model folder there"),
    (["rollout", "serve", "--model", "/nonexistent/m", "--engine", "sglang"], "--engine must be hf or vllm, got 'sglang'"),
    (["rollout", "serve", "--model", "/nonexistent/m", "--dtype", "int8"], "--dtype must be one of float32, bfloat16, float16"),
])
def test_rollout_serve_refuses_bad_options_in_one_line(argv, message, monkeypatch, capsys):
    from emapg_cli.cli.app import main

    monkeypatch.setattr("sys.argv", ["emapg", *argv])
    monkeypatch.setenv("COLUMNS", "300")
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and message in err and len(err.splitlines()) == 1, err


def test_connect_server_checks_engine_and_log_probs(monkeypatch):
    """The setup checks after the fingerprints: rollout.engine names the server's engine, and a config that uses the
    engine's log-probs (the rollout correction) needs a server that records the full-vocabulary ones."""
    from emapg_cli.config.models import Config
    from emapg_cli.train import engine_setup

    class Fake:
        def __init__(self, url, **kw):
            self.url, self.engine_name = url, "vllm"

        def check_compatible(self, model, tokenizer):
            pass

        def full_vocab_logprobs(self, params):
            return params.top_p == 1.0  # a vLLM server started for top_p 1

    monkeypatch.setattr("emapg_cli.engines.remote.RemoteEngine", Fake)
    url = "http://h:1"
    with pytest.raises(UserError, match=r"runs the vllm engine but rollout.engine=hf: set rollout.engine=vllm"):
        engine_setup.connect_server(Config.model_validate({"rollout": {"engine_url": url}}), None, None)
    # vllm's default correction is token_truncate: fine at top_p 1, refused at 0.9 with the options to start it with
    assert engine_setup.connect_server(Config.model_validate({"rollout": {"engine_url": url, "engine": "vllm"}}), None, None).url == url
    with pytest.raises(UserError, match=r"train.rollout_correction=token_truncate need .* start it with --temperature 1 --top-p 0.9"):
        engine_setup.connect_server(Config.model_validate({"rollout": {"engine_url": url, "engine": "vllm", "top_p": 0.9}}), None, None)


def test_plan_puts_no_engine_on_the_trainers_device_with_a_server():
    # the olympiad preset samples with vLLM: 0.5 x 80 GiB on the trainer's device in-process, none with a server
    from emapg_cli.config.loading import load_config
    from emapg_cli.train.plan import make_plan

    local = make_plan(load_config("olympiad"))
    remote = make_plan(load_config("olympiad", overrides=["rollout.engine_url=http://10.0.0.2:8100"]))
    assert "vLLM engine" in {t.name for t in local.memory} and "vLLM engine" not in {t.name for t in remote.memory}
    assert any(n.startswith("rollouts on the rollout server at http://10.0.0.2:8100") for n in remote.notes)


# ---------------------------------------------------------------------------------------------- issue 32

def test_a_hostile_servers_ids_are_refused_against_the_vocabulary():
    """Token ids and top-k ids outside [0, vocab), NaN or positive log-probs, and more tokens than max_new_tokens are
    refused (they used to reach the trainer, which indexed its embedding with them: IndexError, or a device-side
    assert on a GPU). The vocabulary here is 259 (the tiny models'): 258 is the last id."""
    def reply(**fields):
        c = {**completion_to_json(Completion([5, 258], "ab", "stop", [-1.0, -2.0], torch.tensor([[1, 2], [3, 258]]))), **fields}
        return {"completions": [[c]], "weights_version": 0}

    completions_from_json(reply(), 1, 1, vocab=259, max_tokens=2)  # every id in [0, 259), 2 tokens: accepted
    cases = [(reply(token_ids=[5, 259]), "token_ids"), (reply(token_ids=[-1, 5]), "token_ids"),
             (reply(topk=completion_to_json(Completion([5, 6], "", "stop", None, torch.tensor([[1, 259], [0, 0]])))["topk"]),
              r"top-k ids outside \[0, 259\)"),
             (reply(logprobs=completion_to_json(Completion([5, 6], "", "stop", [float("nan"), -1.0]))["logprobs"]), "NaN"),
             (reply(logprobs=completion_to_json(Completion([5, 6], "", "stop", [0.5, -1.0]))["logprobs"]), "above 0")]
    for bad, message in cases:
        with pytest.raises(ProtocolError, match=message):
            completions_from_json(bad, 1, 1, vocab=259, max_tokens=2)
    with pytest.raises(ProtocolError, match="a completion of 2 tokens for max_new_tokens 1"):
        completions_from_json(reply(), 1, 1, vocab=259, max_tokens=1)


@pytest.mark.parametrize("params, code, message", [
    (SamplingParams(temperature=float("inf")), 400, "temperature"), (SamplingParams(temperature=-1.0), 400, "temperature"),
    (SamplingParams(temperature=float("-inf")), 400, "temperature"), (SamplingParams(top_p=0.0), 400, "top_p"),
    (SamplingParams(top_p=1.5), 400, "top_p"), (SamplingParams(top_p=float("nan")), 400, "top_p"),
    (SamplingParams(seed=2 ** 63), 400, "seed"), (SamplingParams(stop=("",)), 400, "stop"),
    (SamplingParams(topk=1025), 413, "topk 1025: at most 1024"),
    (SamplingParams(n=64, max_new_tokens=10 ** 8), 413, "max_new_tokens 100000000: at most 32768"),
    (SamplingParams(n=200_000, max_new_tokens=16), 413, "200000 sequences: at most 65536"),
])
def test_generation_requests_are_checked_against_the_limits(params, code, message):
    from emapg_cli.serve.request_limits import Refused, RequestLimits, check_generation

    with pytest.raises(Refused, match=message) as e:
        check_generation([[1, 2, 3]], params, RequestLimits())
    assert e.value.code == code


def test_request_tokens_count_prompts_and_new_tokens_per_sample():
    from emapg_cli.serve.request_limits import Refused, RequestLimits, check_generation

    limits = RequestLimits(max_request_tokens=100)
    # n 2 x ((3 + 2) prompt tokens + 2 prompts x 20 new tokens) = 2 x 45 = 90 <= 100: accepted
    check_generation([[1, 2, 3], [4, 5]], SamplingParams(n=2, max_new_tokens=20), limits)
    # n 2 x (5 + 2 x 23) = 102 > 100
    with pytest.raises(Refused, match="= 102 tokens: at most 100"):
        check_generation([[1, 2, 3], [4, 5]], SamplingParams(n=2, max_new_tokens=23), limits)
    with pytest.raises(Refused, match=r"prompts\[1\] is empty"):
        check_generation([[1], []], SamplingParams(), limits)


def test_push_header_round_trip_and_bounds():
    from emapg_cli.engines.rollout_protocol import header_length, parse_push_header, push_header, tensor_bytes

    rows = [["w", "float32", [2, 3]], ["b", "bfloat16", [5]]]
    raw = push_header(7, "tok", rows)
    n = header_length(raw[:8], 1000)
    assert n == len(raw) - 8 and parse_push_header(raw[8:]) == (7, "tok", rows)
    assert tensor_bytes([("w", "float32", [2, 3]), ("b", "bfloat16", [5])]) == 2 * 3 * 4 + 5 * 2  # = 34
    with pytest.raises(ProtocolError, match="at most 10"):
        header_length(raw[:8], 10)
    for bad in (b"[]", b'{"version": 1, "token": "t"}', b"not json", b'{"version": true, "token": "t", "tensors": []}'):
        with pytest.raises(ProtocolError):
            parse_push_header(bad)


@pytest.mark.parametrize("host, secret, message", [
    ("0.0.0.0", None, "--host 0.0.0.0 listens beyond this machine"), ("::", None, "listens beyond"),
    ("192.0.2.1", None, "listens beyond"), ("myhost", None, "listens beyond"),
    ("127.0.0.1", "short", "at least 16 characters"), ("0.0.0.0", "x" * 15, "at least 16 characters"),
])
def test_a_server_off_loopback_needs_a_secret(host, secret, message):
    from emapg_cli.serve.rollout_server import check_exposure

    with pytest.raises(ValueError, match=message):
        check_exposure(host, secret)


def test_loopback_needs_no_secret():
    from emapg_cli.serve.rollout_server import check_exposure

    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        check_exposure(host, None)
    check_exposure("0.0.0.0", "x" * 16)


def test_engine_timeout_is_bounded_naming_the_key():
    """rollout.engine_timeout_s=1e15 used to pass the config and stop training with an OverflowError (a socket timeout
    that does not fit); it is refused at config time, naming the key."""
    from emapg_cli.config.models import Config

    with pytest.raises(ValueError, match="engine_timeout_s"):
        Config.model_validate({"rollout": {"engine_url": "http://h:1", "engine_timeout_s": 1e15}})
    Config.model_validate({"rollout": {"engine_url": "http://h:1", "engine_timeout_s": 86400}})


def test_staging_finds_nan_and_inf_but_not_a_sum_that_overflowed():
    """A pushed version is refused when a tensor holds NaN or Inf; one whose values are finite but sum past float32's
    range (10 x 3e38 = 3e39 > 3.4e38) is not: the fast check (the sum) falls back to the elementwise one."""
    from emapg_cli.serve.rollout_weights import Staging

    staging = Staging({}, lambda *a: None)
    staging.tensors = {"a": torch.full((10,), 3e38), "b": torch.zeros(4, dtype=torch.bfloat16)}
    assert staging.not_finite() is None
    for bad in (float("nan"), float("inf"), float("-inf")):
        staging.tensors["b"][2] = bad
        assert staging.not_finite() == "b"
    staging.tensors["b"][2] = 0.0
    staging.tensors["a"][9] = float("inf")
    assert staging.not_finite() == "a"
