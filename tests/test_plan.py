"""The dry-run plan: parameter counts by hand, the paper's 1.5B model, batch shapes and memory terms."""

from __future__ import annotations

import pytest
from rich.console import Console

from emapg_cli.config import load_config
from emapg_cli.errors import UserError
from emapg_cli.train.plan import GIB, KNOWN_MODELS, ModelShapes, load_model_config, make_plan, render_plan


def test_tiny_qwen2_parameter_count_by_hand(tiny_qwen2):
    # save_tiny's Qwen2: h=64, L=2, 4 heads, 2 kv heads (head_dim 16: q=64, kv=32), I=2h=128, V=259, tied.
    #   embedding                      259 * 64                  = 16,576
    #   per layer: q_proj 64*64 + 64   = 4,160
    #              k_proj 64*32 + 32   = 2,080,  v_proj the same = 2,080
    #              o_proj 64*64        = 4,096
    #              MLP 3 * 64 * 128    = 24,576
    #              2 RMSNorms 2 * 64   = 128                     -> 37,120 per layer, 74,240 for 2
    #   final norm                     64
    #   total = 16,576 + 74,240 + 64 = 90,880 (lm_head tied: no extra matrix)
    shapes = ModelShapes.from_hf_config(load_model_config(str(tiny_qwen2)))
    assert (shapes.arch, shapes.head_dim, shapes.qkv_bias, shapes.tie_embeddings) == ("qwen2", 16, True, True)
    assert shapes.params_per_layer() == 37_120
    assert shapes.n_params == 90_880
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    assert sum(p.numel() for p in model.parameters()) == 90_880


def test_llama_has_no_projection_biases():
    # The same shapes as Llama: no q/k/v biases (64 + 32 + 32 = 128 fewer per layer):
    #   37,120 - 128 = 36,992 per layer; 16,576 + 2 * 36,992 + 64 = 90,624; untied adds 259 * 64 = 16,576.
    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 259, "tie_word_embeddings": True}
    assert ModelShapes.from_hf_config(config).n_params == 90_624
    assert ModelShapes.from_hf_config({**config, "tie_word_embeddings": False}).n_params == 90_624 + 16_576
    with pytest.raises(UserError, match="no intermediate_size"):
        ModelShapes.from_hf_config({k: v for k, v in config.items() if k != "intermediate_size"})


#: The olympiad preset at the shapes of emapg's first plan (1,024 prompt + 8,192 response tokens, no
#: anchor evaluation), which the hand counts below use; the preset itself is 4,096 + 24,576 (its
#: longest stage) and evaluates the anchor every 20 steps.
OLY_8K = ["data.max_prompt_tokens=1024", "rollout.max_new_tokens=8192", "eval.anchor_every=0"]


def olympiad(overrides=(), **kw):
    return load_config("olympiad", overrides=[*OLY_8K, *overrides], **kw)


def test_olympiad_plan_matches_the_paper_model_and_hand_counts():
    plan = make_plan(olympiad())
    # DeepSeek-R1-Distill-Qwen-1.5B has ~1.777B parameters including both embedding matrices.
    assert plan.model_source == "built-in table"
    assert abs(plan.n_params - 1.78e9) / 1.78e9 < 0.02
    assert plan.n_params == 1_777_088_000  # 2 * 151,936 * 1,536 + 28 * 46,797,824 + 1,536
    # Shapes: 128 prompts x 8 = 1,024 sequences of <= 1,024 + 8,192 = 9,216 tokens.
    assert (plan.responses_per_step, plan.seq_len, plan.tokens_per_step) == (1024, 9216, 9_437_184)
    # 64 prompts per mini-batch -> 2 mini-batches; 512 sequences / 8 per micro-batch = 64 micro-batches; 1,000 RL steps.
    assert (plan.mini_batches_per_step, plan.micro_batches_per_mini_batch, plan.optimizer_steps_total) == (2, 64, 2000)
    terms = {t.name: t.bytes for t in plan.memory}
    p = 1_777_088_000
    # model.dtype bfloat16 with master weights (the default): fp32 parameters and gradients, bf16 autocast copies
    assert terms["policy weights"] == terms["gradients"] == 4 * p
    assert terms["working copy"] == 2 * p
    assert terms["AdamW moments"] == 8 * p and terms["EMA anchor"] == 4 * p
    assert terms["vLLM engine"] == 40 * GIB  # 0.5 x 80 GiB
    # train.logit_chunk null: c = 256 MiB // (4 x 151,936) = 268,435,456 // 607,744 = 441 rows, each holding the
    # bf16 head output (2 B) and its fp32 copy that becomes the softmax (4 B)
    assert terms["logits"] == 441 * 151_936 * (4 + 2) == 402_022_656
    assert terms["head gradient"] == 151_936 * 1_536 * 4  # the fused layer's fp32 dW buffer
    assert "top-k extras" not in terms  # k3: no top-k set, anchor in its own pass
    assert plan.update_peak_bytes == sum(b for t, b in terms.items() if t != "vLLM engine")
    # state: weights 4P + moments 8P + anchor 4P = 16 B/param, + vLLM
    assert plan.rollout_peak_bytes == 16 * p + 40 * GIB
    assert not any("master" in n for n in plan.notes)


def test_plan_without_master_weights_is_the_lossy_bf16_one():
    plan = make_plan(olympiad(["model.master_weights=false"]))
    terms = {t.name: t.bytes for t in plan.memory}
    p = 1_777_088_000
    assert terms["policy weights"] == terms["gradients"] == 2 * p  # bf16, updated in place
    assert terms["AdamW moments"] == 8 * p and terms["EMA anchor"] == 4 * p and "working copy" not in terms
    assert plan.rollout_peak_bytes == 14 * p + 40 * GIB  # weights 2P + moments 8P + anchor 4P + vLLM
    assert any("master_weights=false" in n and "lossy" in n for n in plan.notes)
    # ema.dtype=bfloat16: the anchor is held in bf16, 2 B/param
    bf16_anchor = {t.name: t.bytes for t in make_plan(olympiad(["ema.dtype=bfloat16"])).memory}
    assert bf16_anchor["EMA anchor"] == 2 * p


def test_largest_micro_batch_that_fits_a_smaller_device():
    # Without master weights, on 40 GiB = 42,949,672,960 B: state 14P = 24,879,232,000, gradients 2P =
    # 3,554,176,000, one logits chunk 402,022,656 and the fp32 head gradient 933,494,784 leave 13,180,747,520 B;
    # each sequence's checkpointed activations take 9,216 x (28 x 1,536 + 48,896) x 2 = 1,693,974,528 B and one
    # layer's float32 attention mask 9,216 x 9,216 x 4 = 339,738,624 B, 2,033,713,152 B in all -> 6 sequences (6.48).
    plan = make_plan(olympiad(["model.master_weights=false"]), device_memory_gib=40)
    assert plan.max_micro_batch_fit == 6
    assert "micro_batch_size <= 6 fits (now 8)" in " ".join(plan.notes)
    # With master weights: state 16P = 28,433,408,000, fp32 gradients 4P = 7,108,352,000 and the bf16 working
    # copy 2P = 3,554,176,000, with the same chunk and head gradient, leave 2,518,219,520 B -> 1 sequence (1.24);
    # on 80 GiB (85,899,345,920 B) 45,467,892,480 B -> 22 (22.36).
    assert make_plan(olympiad(), device_memory_gib=40).max_micro_batch_fit == 1
    assert make_plan(olympiad(), device_memory_gib=80).max_micro_batch_fit == 22


def test_no_anchor_without_kl_and_topk_extras_with_topk():
    no_kl = make_plan(olympiad(["kl.coef=0"]))
    assert {t.name for t in no_kl.memory}.isdisjoint({"EMA anchor"})
    exact = make_plan(olympiad(["kl.estimator=exact"]))
    # exact: 8 fp32 [c, V] buffers (both models' logits, autograd's) -> c = 268,435,456 // (8 x 4 x 151,936) = 55
    assert next(t.bytes for t in exact.memory if t.name == "logits") == 55 * 151_936 * (8 * 4 + 2)
    topk = make_plan(olympiad(["kl.estimator=topk", "kl.k=32"]))
    extras = next(t for t in topk.memory if t.name == "top-k extras")
    assert extras.bytes == 8 * 9216 * 32 * 16  # b x T x k x (4 + 4 + 8)


def test_gradient_checkpointing_keeps_layer_inputs_only():
    on = make_plan(olympiad())
    off = make_plan(olympiad(["model.gradient_checkpointing=false"]))
    a = 48_896  # 4h + 4q + 3kv + 4I = 6,144 + 6,144 + 768 + 35,840 for h=q=1,536, kv=256, I=8,960
    act = lambda plan: next(t.bytes for t in plan.memory if t.name == "activations")  # noqa: E731
    assert act(on) == 8 * 9216 * (28 * 1536 + a) * 2
    assert act(off) == 8 * 9216 * 28 * a * 2


def test_unknown_hub_model_and_local_folder(tmp_path, tiny_llama):
    plan = make_plan(olympiad(["model.path=someone/some-model"]))
    assert plan.model is None and plan.memory == ()
    assert plan.model_source == "unknown model: pass a local path"
    assert plan.tokens_per_step == 9_437_184  # shapes of the run still planned
    assert load_model_config("someone/some-model") is None
    assert load_model_config(str(tiny_llama))["model_type"] == "llama"
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json"):
        load_model_config(str(tmp_path / "empty"))
    assert "Qwen/Qwen2.5-3B" in KNOWN_MODELS


def test_search_qa_plan_counts_turns_and_qwen_3b():
    plan = make_plan(load_config("search-qa"))
    assert plan.n_params == 3_085_938_688  # 151,936 * 2,048 (tied) + 36 * 77,076,992 + 2,048
    assert plan.seq_len == 4096  # search.max_context_tokens: prompt (<= 2048), 4 + 1 turns of 500 and observations


def test_render_plan_prints_the_numbers(tiny_qwen2):
    # pinned shapes, independent of the toy preset's tuning:
    # tokens per step <= prompts x n x (max prompt + max response) = 16 x 8 x (1024 + 32) = 135,168
    sizes = ["rollout.prompts_per_step=16", "rollout.n=8", "data.max_prompt_tokens=1024", "rollout.max_new_tokens=32",
             "train.mini_batch_prompts=8"]
    plan = make_plan(load_config("toy", overrides=[f"model.path={tiny_qwen2}", *sizes]), load_model_config(str(tiny_qwen2)))
    console = Console(record=True, width=200)
    console.print(render_plan(plan))
    text = console.export_text()
    assert "Plan: toy" in text and "135,168" in text and "update peak" in text and "config.json" in text
    assert "90,880 params" in text


def test_fsdp_plan_divides_the_state_by_the_ranks():
    p = 1_777_088_000
    ddp = {t.name: t.bytes for t in make_plan(olympiad(), processes=8).memory}
    single = {t.name: t.bytes for t in make_plan(olympiad()).memory}
    assert ddp == single  # ddp replicates everything: the per-device estimate does not change
    plan = make_plan(olympiad(["train.parallel=fsdp"]), processes=8)
    terms = {t.name: t.bytes for t in plan.memory}
    # fp32 master weights and gradients 4P / 8 = 888,544,000 B each; fp32 moments 8P / 8 = P; anchor 4P / 8 = P / 2;
    # no working copy: FSDP2 gathers each unit in bf16 (the gathered units below)
    assert terms["policy weights"] == terms["gradients"] == 888_544_000
    assert terms["AdamW moments"] == p and terms["EMA anchor"] == p // 2 and "working copy" not in terms
    lossy = {t.name: t.bytes for t in make_plan(olympiad(["train.parallel=fsdp", "model.master_weights=false"]),
                                               processes=8).memory}
    assert lossy["policy weights"] == lossy["gradients"] == 444_272_000  # bf16: 2P / 8
    # root unit = untied embeddings + output layer 2 x 151,936 x 1,536 = 466,747,392, + final norm 1,536;
    # plus two decoder layers of 46,797,824: (466,748,928 + 93,595,648) x 2 B = 1,120,689,152
    assert terms["gathered units"] == 1_120_689_152
    assert terms["policy gathered"] == 2 * p and "anchor gathered" not in terms  # k3 reads the anchor in its own pass
    exact = {t.name: t.bytes for t in make_plan(olympiad(["train.parallel=fsdp", "kl.estimator=exact"]),
                                                processes=8).memory}
    assert exact["anchor gathered"] == 4 * p
    assert (plan.processes, plan.parallel) == (8, "fsdp")


def test_fsdp_plan_is_per_rank():
    # 64 prompts per mini-batch over 8 ranks = 8 prompts x 8 responses = 64 sequences per rank / 8 per micro-batch
    plan = make_plan(olympiad(["train.parallel=fsdp"]), processes=8)
    assert plan.micro_batches_per_mini_batch == 8
    assert any("of 128 per step on each rank" in n for n in plan.notes)  # 1,024 responses / 8 ranks
    odd = make_plan(olympiad(), processes=3)
    assert any("not a multiple of 3 processes" in n for n in odd.notes)
    # evaluating the anchor gathers the whole fp32 anchor (4 B/param) in the rollout phase, more than the bf16 policy
    anchor_eval = make_plan(olympiad(["train.parallel=fsdp", "eval.anchor_every=10"]), processes=8)
    terms = {t.name: t.bytes for t in anchor_eval.memory}
    assert terms["anchor gathered (eval)"] == 4 * 1_777_088_000 and "policy gathered" not in terms


def test_launch_problems_are_one_list_for_the_trainer_and_the_plan():
    """train/preflight.py launch_problems: what the trainer refuses is what the dry-run notes (one function)."""
    from emapg_cli.train.preflight import check_launch, launch_problems

    cfg = load_config("toy", overrides=["rollout.prompts_per_step=6", "train.mini_batch_prompts=6", "train.parallel=fsdp",
                                        "train.share_prompts=always"])
    assert launch_problems(cfg, 1) == [] and len(launch_problems(cfg, 3)) == 1  # 6 = 2 x 3: only the fsdp refusal
    assert launch_problems(cfg, 3)[0].startswith("train.share_prompts=always runs each prompt's layers twice")
    four = launch_problems(cfg, 4)  # 6 % 4 = 2: both batch sizes, then the fsdp refusal
    assert four[:2] == ["rollout.prompts_per_step (6) is not a multiple of 4 processes",
                        "train.mini_batch_prompts (6) is not a multiple of 4 processes"] and len(four) == 3
    notes = make_plan(cfg, processes=4).notes
    assert all(f"{line} (the trainer refuses this)" in notes for line in four)
    assert launch_problems(cfg, 1, accelerate_fsdp=True)[0].startswith("emapg shards the policy and the anchor itself")
    check_launch(cfg, 1)  # nothing to refuse
    with pytest.raises(UserError, match=r"^rollout.prompts_per_step \(6\) is not a multiple of 4 processes$"):
        check_launch(cfg, 4)  # the trainer: the first problem, one line


def test_attention_masks_are_counted():
    """Each decoder layer saves a float32 [b, 1, T, T] attention mask for its backward: T more elements per token per
    layer, which A (activation_elems_per_token_per_layer) leaves out. olympiad: b = 8, T = 1,024 + 8,192 = 9,216, L = 28.
    Checkpointed (the preset): one layer's at a time, 8 x 9,216 x 9,216 x 4 B = 2,717,908,992 B (2.53 GiB);
    without: 28 of them, 76,101,451,776 B (70.9 GiB)."""
    on = {t.name: t.bytes for t in make_plan(olympiad()).memory}
    off = {t.name: t.bytes for t in make_plan(olympiad(["model.gradient_checkpointing=false"])).memory}
    assert on["attention masks"] == 8 * 9216 * 9216 * 4 == 2_717_908_992
    assert off["attention masks"] == 28 * 2_717_908_992 == 76_101_451_776


def test_auto_counts_the_masks_where_they_pass_the_headroom():
    """SmolLM2-135M's shapes (h 576, L 30, 9/3 heads of 64, I 1,536) in float32 without checkpointing, T = 1,200: per
    token per layer the activations are A x 4 B = 11,328 x 4 = 45,312 B (4h + 4q + 3kv + 4I = 2,304 + 2,304 + 576 +
    6,144) and the mask 1,200 x 4 = 4,800 B more, 10.6% of them: more than auto's 10% headroom. Each micro-batch row
    adds (45,312 + 4,800) x 30 x 1,200 B = 1,804,032,000 B of activations and masks (plus its share of the logits)."""
    from emapg_cli.train.plan import activation_elems_per_token_per_layer, memory_terms

    smol = ModelShapes(arch="llama", hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, intermediate=1536,
                       vocab=49152, tie_embeddings=True, qkv_bias=False)
    assert activation_elems_per_token_per_layer(smol) == 11_328
    cfg = load_config("smol", None, ["model.gradient_checkpointing=false"])
    one, two = ({t.name: t.bytes for t in memory_terms(smol, cfg, 1200, micro_batch=b, device_memory_bytes=2**40,
                                                         master_weights=True)} for b in (1, 2))
    assert one["attention masks"] == 1200 * 1200 * 30 * 4 == 172_800_000
    assert (two["activations"] + two["attention masks"]) - (one["activations"] + one["attention masks"]) == 1_804_032_000
    assert one["attention masks"] / one["activations"] == pytest.approx(1200 / 11_328) and 1200 / 11_328 > 0.10
