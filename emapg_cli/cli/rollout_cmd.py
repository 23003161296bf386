"""`emapg rollout serve` (alias `emapg serve-rollouts`): a rollout server, an engine in its own process that trainers
reach at `rollout.engine_url` (docs/rollout_server.md)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from emapg_cli.errors import UserError

app = typer.Typer(help="Rollouts in their own process: serve an engine that trainers sample from and push weights to (rollout.engine_url).",
                  no_args_is_help=True)


@app.command("serve")
def serve(
    model: Annotated[str, typer.Option("--model", help="The policy's model folder (save_pretrained layout with its tokenizer), the run's model.path: the trainer refuses a server whose model or tokenizer differ from its own.")],
    engine: Annotated[str, typer.Option("--engine", help="The engine: hf (transformers, CPU or GPU) or vllm (the vllm extra; a CUDA GPU or vLLM's CPU build). The run's rollout.engine must name it.")] = "hf",
    host: Annotated[str, typer.Option("--host", help="Address to listen on (0.0.0.0: every interface; the HTTP control has no authentication, keep it on a trusted network).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="TCP port (0: a free one, printed in the ready line).")] = 8100,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="float32, bfloat16 or float16: the engine's weights (pushed weights are cast to it); default bfloat16 on a GPU, float32 on CPU.")] = None,
    seed: Annotated[int, typer.Option("--seed", min=0, help="vLLM's engine seed (every request carries its own sampling seeds; hf needs none).")] = 0,
    max_model_len: Annotated[Optional[int], typer.Option("--max-model-len", min=1, help="vllm only: the longest prompt + response in tokens (default: the model's).")] = None,
    threads: Annotated[Optional[int], typer.Option("--threads", min=1, help="torch threads on CPU (default: as `train` chooses them: EMAPG_TORCH_THREADS, else the free cores).")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="hf only: sequences generated together in one generate call (the trainer's rollout.hf_batch_size in-process; the same value gives the same samples).")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0, help="vllm only: the rollouts' temperature, whose full-vocabulary log-probs the engine records exactly (the run's rollout.temperature).")] = 1.0,
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="vllm only: the rollouts' top_p (the run's rollout.top_p).")] = 1.0,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code", help="Let transformers run the model folder's own code (model.trust_remote_code).")] = False,
    openai: Annotated[bool, typer.Option("--openai", help="Also answer OpenAI's API on the same port: GET /v1/models, POST /v1/chat/completions (the model's chat template) and /v1/completions, with token ids, engine log-probs and the weights version in each reply (docs/agents.md).")] = False,
) -> None:
    """Serve an engine over HTTP (GET /health, POST /generate, weight pushes over torch.distributed; with --openai
    OpenAI's /v1 routes too); Ctrl-C stops.

    Prints one line `rollout server ready at http://HOST:PORT ...` once it listens.
    """
    from emapg_cli.engines.rollout_server import make_server
    from emapg_cli.engines.rollout_service import RolloutService, check_model_path, load_served
    from emapg_cli.models.loading import DTYPES
    from emapg_cli.train.threads import set_torch_threads

    if engine not in ("hf", "vllm"):
        raise UserError(f"--engine must be hf or vllm, got {engine!r:.40}")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r:.40}")
    check_model_path(model)  # before anything loads
    set_torch_threads(threads)
    served = load_served(engine, model, dtype=dtype, seed=seed, max_model_len=max_model_len, trust_remote_code=trust_remote_code,
                         batch_size=batch_size, temperature=temperature, top_p=top_p)
    rollouts = RolloutService(served)
    api = None
    if openai:
        from emapg_cli.engines.openai_service import rollout_openai

        api = rollout_openai(rollouts, model, max_model_len, trust_remote_code)
    try:
        server = make_server(rollouts, host, port, openai=api)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    h, p = server.server_address[:2]
    try:  # from the ready line on, Ctrl-C is a clean stop (a client may send it as soon as it reads the line)
        typer.echo(f"rollout server ready at http://{h}:{p} (engine {engine}, {served.fingerprint['architecture']}, "
                   f"{served.device}{f'; OpenAI API at http://{h}:{p}/v1' if api else ''}; Ctrl-C stops)")
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()

