"""`emapg rollout serve`: a rollout server, an engine in its own process that trainers
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
    host: Annotated[str, typer.Option("--host", help="Address to listen on (0.0.0.0: every interface). Any address but loopback needs --secret.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="TCP port (0: a free one, printed in the ready line).")] = 8100,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="float32, bfloat16 or float16: the engine's weights (pushed weights are cast to it); default bfloat16 on a GPU, float32 on CPU.")] = None,
    seed: Annotated[int, typer.Option("--seed", min=0, help="vLLM's engine seed (every request carries its own sampling seeds; hf needs none).")] = 0,
    max_model_len: Annotated[Optional[int], typer.Option("--max-model-len", min=1, help="vllm only: the longest prompt + response in tokens (default: the model's).")] = None,
    threads: Annotated[Optional[int], typer.Option("--threads", min=1, help="torch threads on CPU (default: as `train` chooses them: EMAPG_TORCH_THREADS, else the free cores).")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="hf only: sequences generated together in one generate call (the trainer's rollout.hf_batch_size in-process; the same value gives the same samples).")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0, help="vllm only: the rollouts' temperature, whose full-vocabulary log-probs the engine records exactly (the run's rollout.temperature).")] = 1.0,
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="vllm only: the rollouts' top_p (the run's rollout.top_p).")] = 1.0,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code", help="Let transformers run the model folder's own code (what a run's config calls trust_remote_code, under model).")] = False,
    secret: Annotated[Optional[str], typer.Option("--secret", envvar="EMAPG_ROLLOUT_SECRET", show_envvar=True, help="A shared secret (at least 16 characters) that every request must carry; the trainer sends its EMAPG_ROLLOUT_SECRET. Required when --host is not a loopback address. Prefer the environment variable: a command line is visible to other users.")] = None,
    max_connections: Annotated[int, typer.Option("--max-connections", min=1, max=65536, help="Connections served at once; the next ones get 503 at once.")] = 64,
    timeout_s: Annotated[float, typer.Option("--timeout", min=0.1, max=86400, help="Seconds a connection has to send each request (from connect or the previous reply; idle connections are closed after it) and to take each reply; a weight push's bytes get this plus their size at 16 MiB/s.")] = 60.0,
    max_body_bytes: Annotated[int, typer.Option("--max-body-bytes", min=1, max=1 << 40, help="Largest JSON request body (a weight push's tensors are bounded by its manifest instead).")] = 32 << 20,
    max_sequences: Annotated[int, typer.Option("--max-sequences", min=1, help="Most sequences (prompts x n) one generate request may ask for (413 above).")] = 65536,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="Largest max_new_tokens one generate request may ask for (413 above).")] = 32768,
    max_request_tokens: Annotated[int, typer.Option("--max-request-tokens", min=1, help="Most tokens one generate request may ask for in all: n x (prompt tokens + max_new_tokens), summed over its prompts (413 above).")] = 1 << 28,
    openai: Annotated[bool, typer.Option("--openai", help="Also answer OpenAI's API on the same port: GET /v1/models, POST /v1/chat/completions (the model's chat template) and /v1/completions, with token ids, engine log-probs and the weights version in each reply (docs/agents.md).")] = False,
) -> None:
    """Serve an engine over HTTP (GET /health, POST /generate, weight pushes over torch.distributed; with --openai
    OpenAI's /v1 routes too); Ctrl-C stops.

    Prints one line `rollout server ready at http://HOST:PORT ...` once it listens.
    """
    from emapg_cli.serve.request_limits import RequestLimits
    from emapg_cli.serve.rollout_server import ServerLimits, check_exposure, make_server
    from emapg_cli.serve.rollout_service import RolloutService, check_model_path, load_served
    from emapg_cli.models.loading import DTYPES
    from emapg_cli.train.threads import set_torch_threads

    if engine not in ("hf", "vllm"):
        raise UserError(f"--engine must be hf or vllm, got {engine!r:.40}")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r:.40}")
    try:
        check_exposure(host, secret)
    except ValueError as e:
        raise UserError(str(e)) from None
    limits = ServerLimits(max_body_bytes=max_body_bytes, timeout_s=timeout_s, max_connections=max_connections,
                          request=RequestLimits(max_sequences=max_sequences, max_new_tokens=max_new_tokens,
                                                max_request_tokens=max_request_tokens))
    check_model_path(model)  # before anything loads
    set_torch_threads(threads)
    served = load_served(engine, model, dtype=dtype, seed=seed, max_model_len=max_model_len, trust_remote_code=trust_remote_code,
                         batch_size=batch_size, temperature=temperature, top_p=top_p)
    rollouts = RolloutService(served)
    api = None
    if openai:
        from emapg_cli.serve.openai_service import rollout_openai
        from emapg_cli.serve.rollout_server import WAIT_TIMEOUT_S

        api = rollout_openai(rollouts, model, max_model_len, trust_remote_code, limits.request, WAIT_TIMEOUT_S)
    try:
        server = make_server(rollouts, host, port, limits, secret, openai=api)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    h, p = server.server_address[:2]
    h = f"[{h}]" if ":" in h else h  # an IPv6 address in a URL
    try:  # from the ready line on, Ctrl-C is a clean stop (a client may send it as soon as it reads the line)
        typer.echo(f"rollout server ready at http://{h}:{p} (engine {engine}, {served.fingerprint['architecture']}, "
                   f"{served.device}{f'; OpenAI API at http://{h}:{p}/v1' if api else ''}{'; a secret is required' if secret else ''}; Ctrl-C stops)")
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()

