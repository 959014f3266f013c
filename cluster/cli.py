"""`pdserve`: the command line. Subcommands: serve, status, chat, generate, bench, profile, plan."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from cluster.common import env
from cluster.common.roles import Mode
from cluster.common.sampling_params import SamplingParams
from cluster.common.structured_output import StructuredOutput
from cluster.engine.config import (
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from cluster.serving.cache_domains import DEFAULT_ISOLATION, ISOLATIONS
from cluster.serving.connection_limits import ConnectionLimits
from cluster.serving.request_limits import RequestLimits
from cluster.serving.tools.parsers import PARSERS
from cluster.serving.tools.template import ToolServing


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default="default",
                       help="Hugging Face checkpoint directory, .gguf file, or 'default' (SmolLM2-135M-Instruct)")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="auto: bf16 on GPUs and on CPUs with native bf16 matmuls (AMX, AVX512-BF16), else fp32")
    group.add_argument("--device", default="auto", help="auto (CUDA where there is one), cpu, cuda or cuda:N")
    group.add_argument("--max-model-len", type=int, default=0, help="context length (0: the model's)")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    group.add_argument("--num-blocks", type=int, default=0, help="KV blocks (0: from --kv-cache-memory-gb)")
    group.add_argument("--kv-cache-memory-gb", type=float, default=None,
                       help="the KV cache's size on any device (default: 2 on a CPU; on a GPU what "
                       "--gpu-memory-utilization leaves)")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="the fraction of the GPU's memory the engine may take: weights, activations, KV cache")
    group.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                       help="auto: the model's dtype; fp8 (= fp8_e4m3), fp8_e5m2: one byte per key and value (twice "
                       "the blocks, fp8's precision)")
    group.add_argument("--no-prefix-caching", action="store_true")
    group.add_argument("--host-kv-cache-gb", type=float, default=None,
                       help="a host KV tier of this size: cached blocks the pool evicts move to host memory and come "
                       "back on a prefix hit (default: off)")
    group.add_argument("--num-host-kv-blocks", type=int, default=0,
                       help="the host KV tier's size in blocks (0: from --host-kv-cache-gb)")
    group.add_argument("--host-kv-disk-dir", default="",
                       help="put the host KV tier on local disk: its blocks in a memory-mapped file in this directory "
                       "(the page cache keeps recent ones in memory), so it can be larger than the host's memory")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    group.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once")
    group.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    group.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    group.add_argument("--deterministic", action="store_true",
                       help="every token's result independent of its batch, of chunking and of resumes (slower)")
    group.add_argument("--quantization", default="none", choices=list(QUANTIZATIONS),
                       help="gguf: a .gguf model's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K weights stay packed "
                       "(about a third of bf16's memory at 4 bits); none: widened to --dtype at load, except an "
                       "int8/fp8 safetensors checkpoint (config.json's quantization_config), kept 8-bit as "
                       "compressed-tensors or fp8 do")
    group.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="ranks the model is split across, each in a process of its own (a GPU each on GPUs); "
                       "it must divide the model's attention heads and KV heads")
    group.add_argument("--speculative-config", type=speculative_json, default=None,
                       help=SPECULATIVE_HELP)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, device=args.device,
                          deterministic=args.deterministic, quantization=args.quantization,
                          tensor_parallel_size=args.tensor_parallel_size),
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                          kv_cache_memory_gb=args.kv_cache_memory_gb, kv_cache_dtype=args.kv_cache_dtype,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          enable_prefix_caching=not args.no_prefix_caching,
                          host_kv_cache_gb=args.host_kv_cache_gb, num_host_kv_blocks=args.num_host_kv_blocks,
                          host_kv_disk_dir=args.host_kv_disk_dir),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs, preemption_mode=args.preemption_mode),
        attention_backend=args.attention_backend,
        speculative=SpeculativeConfig.from_dict(args.speculative_config))


SPECULATIVE_HELP = ('speculative decoding as vLLM\'s JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                    '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or, with a draft model of the same tokenizer, '
                    '\'{"model": "PATH", "num_speculative_tokens": 4}\' (default: off)')


def speculative_json(text: str) -> dict[str, object]:
    """--speculative-config's JSON object, checked as the engine would check it."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    try:
        SpeculativeConfig.from_dict(values)
    except (ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return dict(values)


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--seed", type=int, default=None)


def add_structured_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("structured output (one at most; docs/structured-outputs.md)")
    group.add_argument("--json-schema", default=None, help="a JSON schema the answer must match (or @file)")
    group.add_argument("--json-object", action="store_true", help="the answer is a JSON object")
    group.add_argument("--regex", default=None, help="a regular expression the whole answer must match")
    group.add_argument("--choice", action="append", default=None, help="the answer is one of these (repeatable)")
    group.add_argument("--grammar", default=None, help="a Lark or GBNF grammar the answer must follow (or @file)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, structured=structured_output(args))


def structured_output(args: argparse.Namespace) -> StructuredOutput | None:
    """The form `--json-schema` & co. ask for; ValueError for two at once."""
    forms = [StructuredOutput("json", _text_or_file(args.json_schema)) if getattr(args, "json_schema", None) else None,
             StructuredOutput("json_object") if getattr(args, "json_object", False) else None,
             StructuredOutput("regex", args.regex) if getattr(args, "regex", None) else None,
             StructuredOutput.of_choices(args.choice) if getattr(args, "choice", None) else None,
             StructuredOutput("grammar", _text_or_file(args.grammar)) if getattr(args, "grammar", None) else None]
    asked = [form for form in forms if form is not None]
    if len(asked) > 1:
        raise ValueError("ask for one structured output at most (--json-schema, --json-object, --regex, --choice, "
                         "--grammar)")
    return asked[0] if asked else None


def _text_or_file(value: str) -> str:
    if not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"cannot read {value[1:]}: {error.strerror}") from None


def make_engine(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from cluster.engine.llm_engine import LLMEngine  # torch loads here, not for --help

    return LLMEngine(engine_config(args), progress=True)


def stream(engine, prompt_ids: list[int], params: SamplingParams) -> str:  # type: ignore[no-untyped-def]
    """Print tokens as they come; returns the whole answer."""
    request = engine.add_request(prompt_ids, params)
    text = ""
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request.request_id:
                sys.stdout.write(output.new_text)
                sys.stdout.flush()
                text = output.text
    sys.stdout.write("\n")
    return text


def command_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # bad values fail before the model loads
    engine = make_engine(args)
    prompt = args.prompt
    ids = engine.tokenizer.encode(prompt) if args.raw else engine.chat_prompt([{"role": "user", "content": prompt}])
    stream(engine, ids, params)
    return 0


def command_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    engine = make_engine(args)
    console = Console()
    console.print(f"[bold]pdserve chat[/] on {engine.model_name} — empty line or Ctrl-D to quit")
    return chat_loop(console, args.system, lambda messages: stream(engine, engine.chat_prompt(messages), params))


def chat_loop(console: Console, system: str, respond: Callable[[list[dict[str, str]]], str]) -> int:
    """Read user turns until an empty line or Ctrl-D; `respond` streams the answer to the history."""
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            line = console.input("[bold green]you>[/] ")
        except (EOFError, KeyboardInterrupt):
            return 0
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        console.print("[bold blue]model>[/] ", end="")
        messages.append({"role": "assistant", "content": respond(messages)})


def command_bench(args: argparse.Namespace) -> int:
    """The serving benchmark against a running server with --url or --grpc; else the offline one,
    which loads the engine here and pushes a synthetic workload through it."""
    if args.url or args.grpc:
        from cluster.bench.serving import command

        return command(args)
    from cluster.bench.offline import run_workload, synthetic_workload

    engine = make_engine(args)
    workload = synthetic_workload(args.num_requests, engine.arch.vocab_size, seed=args.seed or 0,
                                  output_cap=args.output_cap)
    started = time.monotonic()
    result = run_workload(engine, workload, f"{args.num_requests} requests")
    table = Table(title=f"pdserve bench: {engine.model_name}, {engine.dtype} ({engine.dtype_reason})")
    for key, value in result.as_dict().items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    Console().print(table)
    if args.json:
        with open(args.json, "w") as file:
            json.dump({**result.as_dict(), "wall_s": time.monotonic() - started}, file, indent=2)
    return 0


def pool_flags(args: argparse.Namespace, pool: str) -> dict[str, object]:
    """A pool's flags given on the command line: its replicas, its ranks per worker."""
    flags: dict[str, object] = {}
    replicas = getattr(args, f"num_{pool}")
    if replicas is not None:
        flags["replicas"] = replicas
    ranks = getattr(args, f"{pool}_tensor_parallel_size", None)
    if ranks is not None:
        flags["engine"] = {"tensor_parallel_size": ranks}
    return flags


def cluster_overrides(args: argparse.Namespace) -> dict[str, object]:
    """CLI flags over the YAML file: only those given on the command line."""
    overrides: dict[str, object] = {}
    if args.mode:
        overrides["mode"] = args.mode
    if args.ray_address:
        overrides["ray_address"] = args.ray_address
    redis_url = args.redis_url or os.environ.get(env.REDIS_URL)
    if redis_url:
        overrides["redis_url"] = redis_url
    if args.attach:
        overrides["attach"] = True
    if args.name:
        overrides["name"] = args.name
    if args.routers is not None:
        overrides["routers"] = args.routers
    if getattr(args, "reserved_cpus", None) is not None:
        overrides["reserved_cpus"] = args.reserved_cpus
    overrides.update(prefix_reuse_overrides(args))
    for pool in ("prefill", "decode"):
        if pool_overrides := pool_flags(args, pool):
            overrides[pool] = pool_overrides
    traces = tracing_overrides(args)
    if traces:
        overrides["tracing"] = traces
    engine = {key: getattr(args, key) for key in ("model", "dtype", "device", "kv_cache_memory_gb", "kv_cache_dtype",
                                                 "host_kv_cache_gb", "num_host_kv_blocks", "host_kv_disk_dir",
                                                 "gpu_memory_utilization",
                                                 "max_num_batched_tokens", "max_num_seqs", "deterministic",
                                                 "quantization", "tensor_parallel_size", "speculative_config")
              if getattr(args, key) is not None}
    if engine:
        overrides["engine"] = engine
    return overrides


def prefix_reuse_overrides(args: argparse.Namespace) -> dict[str, object]:
    """--local-prefill-threshold, --no-decode-prefix-reuse and --prefix-fetch, when given."""
    overrides: dict[str, object] = {}
    if getattr(args, "local_prefill_threshold", None) is not None:
        overrides["local_prefill_threshold"] = args.local_prefill_threshold
    if getattr(args, "no_decode_prefix_reuse", False):
        overrides["decode_prefix_reuse"] = False
    if getattr(args, "prefix_fetch", False):
        overrides["prefix_fetch"] = True
    return overrides


def tracing_overrides(args: argparse.Namespace) -> dict[str, object]:
    """--otlp-traces-endpoint (else $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) and the sample ratio, when given."""
    from cluster.observability.tracing import ENDPOINT_ENV

    traces: dict[str, object] = {}
    endpoint = getattr(args, "otlp_traces_endpoint", None) or os.environ.get(ENDPOINT_ENV)
    if endpoint:
        traces["endpoint"] = endpoint
    if getattr(args, "otlp_traces_sample_ratio", None) is not None:
        traces["sample_ratio"] = args.otlp_traces_sample_ratio
    return traces


def command_serve(args: argparse.Namespace) -> int:
    """Start the cluster (embedded Ray by default, or one engine here with --local) behind the
    OpenAI-compatible HTTP gateway and the gRPC API; serve until Ctrl-C or SIGTERM."""
    import asyncio
    import signal

    if bool(args.tls_cert) != bool(args.tls_key):
        print("pdserve serve: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    # gRPC's C core logs a line each time Ray forks a process while the server runs: errors only.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from cluster.engine.llm_engine import served_model_name
    from cluster.observability import tracing
    from cluster.observability.logs import configure_logging
    from cluster.ray_cluster.config import load_cluster_config
    from cluster.serving.process import DeferredService, ServeOptions, ServiceLauncher, serve
    from cluster.weights.default_model import resolve_model_path
    from cluster.weights.tokenizer import Tokenizer

    configure_logging(args.log_format, args.log_level)
    config = load_cluster_config(args.config, cluster_overrides(args))
    tracing.configure(config.tracing, "pdserve-gateway")  # the routers and workers set up their own
    if config.attach and not config.ray_address:
        raise ValueError("--attach serves the workers of a running Ray cluster: give its --ray-address")
    options = ServeOptions(host=args.host, port=args.port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                           api_key=args.api_key,
                           drain_s=args.drain_s, redis_url=config.redis_url, rate_limit_rps=args.rate_limit_rps,
                           rate_limit_tpm=args.rate_limit_tpm,
                           request_limits=RequestLimits.parse(args.request_limit), api_keys_file=args.api_keys_file,
                           trusted_proxies=args.trusted_proxies, tls_cert=args.tls_cert, tls_key=args.tls_key,
                           connections=ConnectionLimits(args.max_connections, args.request_read_timeout,
                                                        args.stream_write_timeout),
                           tools=ToolServing(args.tool_call_parser, args.exclude_tools_when_tool_choice_none),
                           prefix_cache_isolation=args.prefix_cache_isolation)
    console = Console()
    model_dir = resolve_model_path(config.engine.model.model, progress=True)
    service = DeferredService(served_model_name(config.engine.model.model), Tokenizer.from_dir(model_dir))
    backend = ServiceLauncher(config, local=args.local)

    def listening(url: str, grpc_port: int | None, operator_url: str | None) -> None:
        grpc = f", gRPC on port {grpc_port}" if grpc_port is not None else ""
        operator = f", metrics and probes on {operator_url}" if operator_url is not None else ""
        console.print(f"[bold]pdserve[/]: HTTP on {url}{grpc}{operator}; starting {backend.describe()}...")

    # Until `serve` takes the signals over (it drains), SIGTERM stops the process as Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(service, backend, options, on_listening=listening))
    tracing.shutdown()  # the last spans go out
    console.print("pdserve: stopped")
    return 0


SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8",
                "float8_e5m2": "e5m2"}


def command_status(args: argparse.Namespace) -> int:
    """Ask a running server for its workers' load and KV usage, and show them as a table."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(args.url.rstrip("/") + "/v1/workers")
    api_key = args.api_key or os.environ.get(env.API_KEY)
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            status = json.loads(response.read())
    except (urllib.error.URLError, TimeoutError) as error:
        print(f"pdserve: cannot reach {args.url}: {error}", file=sys.stderr)
        return 1
    table = Table(title=f"pdserve at {args.url}: {status['model']} ({'ready' if status['ready'] else 'NOT ready'})")
    # Short headings: the table fits 80 columns. "sent", "failed": KV transfers; "recomp": prompts
    # whose KV never came (both should stay near 0 failed, 0 recomputed).
    for column in ("worker", "role", "dtype", "run", "wait", "free KV", "KV%", "sent", "failed", "recomp"):
        left = column in ("worker", "role")
        table.add_column(column, justify="left" if left else "right", no_wrap=left)
    for w in status["workers"]:
        dtype = SHORT_DTYPES.get(w.get("dtype", ""), "?")
        if w.get("kv_cache_dtype", w.get("dtype")) != w.get("dtype"):  # weights/KV cache: an fp8 cache
            dtype += f"/{SHORT_DTYPES.get(w['kv_cache_dtype'], '?')}"
        table.add_row(w["worker_id"], w["role"], dtype, str(w["running"]), str(w["waiting"]),
                      f"{w['free_blocks']}/{w['blocks']}", f"{100 * w['kv_cache_usage']:.1f}%",
                      str(w.get("kv_transfers", 0)), str(w.get("kv_transfer_failures", 0)),
                      str(w.get("kv_recomputes", 0)))
    console = Console()
    console.print(table)
    for w in status["workers"]:
        if w.get("failure"):
            console.print(f"[red]{w['worker_id']}[/red] ({w.get('device', '?')}): {w['failure']}")
    if status.get("scaling"):
        console.print(scaling_line(status["scaling"]))
    return 0


def scaling_line(scaling: dict[str, Any]) -> str:
    """The live controller's pool sizes and its last decision, on one line."""
    spares = {pool: len(ids) for pool, ids in scaling.get("spares", {}).items() if ids}
    pools = ", ".join(f"{size} {pool}" + (f" (+{spares[pool]} warm spare{'s' * (spares[pool] > 1)})"
                                          if pool in spares else "")
                      for pool, size in sorted(scaling.get("pools", {}).items()))
    last = scaling.get("last") or {}
    said = (f"last: {last['pool']} {last['direction']} ({last['reason']}: {last['detail']}), {last['worker']}"
            if last else "no decision yet")
    return f"scaling: {pools}; {said}"


def command_stop_workers(args: argparse.Namespace) -> int:
    """End the workers a named cluster left running (`serve --name`): their requests end, their
    models unload."""
    from cluster.ray_cluster.launcher import init_ray, named_workers, stop_worker

    init_ray(args.ray_address)
    names = named_workers(args.name)
    for name in names:
        stop_worker(name)
    print(f"pdserve: stopped {len(names)} workers of {args.name}" + (f": {', '.join(names)}" if names else ""))
    return 0


def command_profile(args: argparse.Namespace) -> int:
    """Measure one engine here (cluster.planner.measure) and save the profile the planner reads."""
    from cluster.planner.measure import profile_model  # torch loads here, not for --help

    model = args.model or ("tiny" if args.quick else "default")
    profile = profile_model(model, args.dtype, quick=args.quick)
    profile.save(args.out)
    Console().print(f"pdserve profile: {profile.model} ({profile.dtype}, {profile.threads} threads) -> {args.out}; "
                    f"prefill throughput is within 90% of its best from {profile.prefill_knee()} tokens a step")
    return 0


def command_plan(args: argparse.Namespace) -> int:
    from cluster.planner.report import run_plan

    return run_plan(args, Console())


def add_planner_commands(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    profile = commands.add_parser("profile", help="measure one worker on this machine (prefill, decode and KV "
                                  "transfer times) into a JSON profile for `pdserve plan`")
    profile.add_argument("--model", default=None, help="as serve takes it (default: 'default'; with --quick the "
                         "tiny random model, 'tiny')")
    profile.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    profile.add_argument("--out", default="profile.json", help="where the profile goes")
    profile.add_argument("--quick", action="store_true", help="a small grid, one run per point: seconds, for tests")
    profile.set_defaults(handler=command_profile)
    from cluster.planner.report import add_plan_arguments  # no torch: --help stays fast

    plan = commands.add_parser("plan", help="simulate pool sizes and limits for a workload and SLOs; print the "
                               "best (highest goodput per worker) and the runner-up; --write a cluster.yaml")
    add_plan_arguments(plan)
    plan.set_defaults(handler=command_plan)


def request_limit(text: str) -> str:
    """An argparse type: `NAME=VALUE` of a known request limit (a bad one exits 2 with the reason)."""
    try:
        RequestLimits.parse([text])
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Serve LLMs on a disaggregated prefill/decode "
                                     "cluster: paged KV cache, continuous batching, Ray, UCX.")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="generate a reply to one prompt, streamed")
    generate.add_argument("prompt")
    generate.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    chat = commands.add_parser("chat", help="interactive chat with the model")
    chat.add_argument("--system", default="", help="system prompt")
    bench = commands.add_parser("bench", help="benchmark a running server (--url or --grpc: latencies, "
                                "throughput, goodput), or without them the engine offline (throughput)")
    bench.add_argument("--num-requests", type=int, default=64)
    bench.add_argument("--output-cap", type=int, default=512, help="offline: longest output")
    bench.add_argument("--json", default="", help="write the result to this JSON file")
    from cluster.bench.serving import add_arguments as add_serving_bench_arguments  # no torch: --help stays fast

    add_serving_bench_arguments(bench)
    for sub in (generate, chat, bench):
        add_engine_arguments(sub)
        add_sampling_arguments(sub)
    for sub in (generate, chat):
        add_structured_arguments(sub)
    serve = commands.add_parser("serve", help="serve the model over HTTP (OpenAI API) and gRPC from a cluster "
                                "of prefill and decode workers (embedded Ray by default)")
    serve.add_argument("--host", default="0.0.0.0", help="address both servers listen on")
    serve.add_argument("--port", type=int, default=8000, help="HTTP port (OpenAI-compatible API)")
    serve.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (-1: no gRPC server)")
    serve.add_argument("--metrics-port", type=int, default=-1,
                       help="the operator port: /metrics, /health, /ready with its reasons and /v1/workers, none of "
                       "them then on --port (0: a free port; -1: all on --port, as vLLM; docs/security.md)")
    serve.add_argument("--api-key", default=None, help="require this key (default: $PDSERVE_API_KEY, if set)")
    serve.add_argument("--drain-s", type=float, default=30.0, help="on SIGTERM, let open requests finish this long")
    serve.add_argument("--local", action="store_true", help="one engine in this process instead of a Ray cluster")
    serve.add_argument("--log-format", choices=["text", "json"], default="text",
                       help="json: one object per line with request ids and timings")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--config", default=None, help="cluster YAML file (see cluster/ray_cluster/config.py)")
    serve.add_argument("--ray-address", default="", help="join this Ray cluster instead of starting one")
    serve.add_argument("--redis-url", default="", help="shared state for KV-aware routing and rate limits "
                       "(default: $PDSERVE_REDIS_URL; none: each router keeps its own)")
    serve.add_argument("--rate-limit-rps", type=float, default=0.0, help="requests per second per API key (0: none)")
    serve.add_argument("--rate-limit-tpm", type=float, default=0.0,
                       help="prompt + max tokens per minute per API key (0: none)")
    serve.add_argument("--api-keys-file", default="", help="YAML/JSON of API keys, one tenant each with its own "
                       "rate limits (docs/security.md); with or without --api-key")
    serve.add_argument("--prefix-cache-isolation", choices=ISOLATIONS, default=DEFAULT_ISOLATION,
                       help="per-key: each API key's requests share prefix-cache blocks only with its own (no "
                       "tenant learns what another sent from cached_tokens or timing); shared: all keys share them "
                       "(docs/security.md, Prefix cache)")
    serve.add_argument("--trusted-proxies", default="", help="addresses or networks (comma-separated) whose "
                       "X-Forwarded-For is believed, e.g. the Ingress's; default: nobody's")
    serve.add_argument("--tls-cert", default="", help="PEM certificate (chain) file: HTTPS and gRPC over TLS")
    serve.add_argument("--tls-key", default="", help="the certificate's private key file (PEM)")
    serve.add_argument("--request-limit", action="append", default=[], metavar="NAME=VALUE", type=request_limit,
                       help="what one request may ask, e.g. max_stop_strings=32 (repeatable; the names and defaults: "
                       "docs/security.md)")
    serve.add_argument("--max-connections", type=int, default=4096,
                       help="per door: past this many open connections new requests are refused (HTTP 503)")
    serve.add_argument("--request-read-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="a request (headers and body; a gRPC connection's handshake) must arrive within this")
    serve.add_argument("--stream-write-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="a client that reads nothing of its stream this long is disconnected, its request aborted")
    serve.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                       help="send OpenTelemetry traces over OTLP/gRPC here, e.g. http://collector:4317 (default: "
                       "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; none: no tracing); docs/observability.md, Traces")
    serve.add_argument("--otlp-traces-sample-ratio", type=float, default=None, metavar="RATIO",
                       help="the share of requests traced, 0 to 1 (default 1; a client's sampled traceparent is "
                       "always followed)")
    serve.add_argument("--tool-call-parser", choices=["auto", *PARSERS], default="auto",
                       help="how the model writes tool calls (read under tool_choice auto); auto: the format its "
                       "chat template shows, else hermes")
    serve.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                       help="leave a request's tools out of its prompt under tool_choice none (vLLM's flag; off: "
                       "they are shown, as vLLM)")
    serve.add_argument("--mode", choices=[str(mode) for mode in Mode], default=None)
    serve.add_argument("--routers", type=int, default=None, help="router replicas (Ray actors) to spread requests over")
    serve.add_argument("--reserved-cpus", type=int, default=None,
                       help="cores of each host kept for the gateway, router and Ray: the engines compute on the rest "
                       "(0: no binding; docs/performance.md says when it pays)")
    serve.add_argument("--local-prefill-threshold", type=int, default=None, metavar="TOKENS",
                       help="a prompt whose part the decode worker does not hold cached is shorter than this is "
                       "computed on the decode worker, no prefill worker asked (default 0: never; docs/ray_cluster.md)")
    serve.add_argument("--no-decode-prefix-reuse", action="store_true",
                       help="ship every prompt's KV whole, even the blocks the decode worker holds already")
    serve.add_argument("--prefix-fetch", action="store_true",
                       help="a prefill worker takes a prompt's prefix that another worker caches from that worker over "
                       "the KV transfer instead of computing it (docs/ray_cluster.md)")
    serve.add_argument("--attach", action="store_true", help="start no workers: serve those another pdserve serve "
                       "listed in --redis-url's registry (a second gateway; needs --ray-address and --redis-url)")
    serve.add_argument("--name", default="", help="name the cluster: its workers outlive this process, and a "
                       "gateway started again with the name takes them over without loading the model again "
                       "(needs --ray-address; `pdserve stop-workers` ends them)")
    serve.add_argument("--num-prefill", type=int, default=None, help="prefill workers")
    serve.add_argument("--num-decode", type=int, default=None, help="decode workers")
    serve.add_argument("--model", default=None, help="'default', a Hugging Face model directory or a .gguf file")
    serve.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                       help="default auto: each worker takes bf16 where its CPU or GPU has it natively, else fp32")
    serve.add_argument("--device", default=None, help="every worker's: auto (CUDA where Ray has GPUs), cpu, cuda[:N]")
    serve.add_argument("--kv-cache-memory-gb", type=float, default=None,
                       help="per worker, on any device (default: 1 on CPUs; on GPUs what --gpu-memory-utilization "
                       "leaves)")
    serve.add_argument("--gpu-memory-utilization", type=float, default=None,
                       help="default 0.9: the fraction of its GPU's memory each worker may take (weights, "
                       "activations, KV cache); workers sharing a GPU (a pool's num_gpus below 1) get their "
                       "share of it")
    serve.add_argument("--kv-cache-dtype", default=None, choices=list(KV_CACHE_DTYPES),
                       help="default auto (the model's dtype); fp8 (= fp8_e4m3), fp8_e5m2: one byte per key and value")
    serve.add_argument("--host-kv-cache-gb", type=float, default=None,
                       help="per worker: a host KV tier of this size, where evicted prefix blocks wait for a hit "
                       "(default: off)")
    serve.add_argument("--num-host-kv-blocks", type=int, default=None,
                       help="per worker: the host KV tier's size in blocks (default 0: from --host-kv-cache-gb)")
    serve.add_argument("--host-kv-disk-dir", default=None,
                       help="per worker: the host KV tier on local disk, in a memory-mapped file in this directory")
    serve.add_argument("--max-num-batched-tokens", type=int, default=None)
    serve.add_argument("--max-num-seqs", type=int, default=None)
    serve.add_argument("--deterministic", action="store_const", const=True, default=None,
                       help="every token's result independent of its batch, of chunking and of whether its KV came "
                       "from a prefill, a decode or a resume: a stream resumed after a worker died keeps the text "
                       "of an undisturbed run, in any dtype (slower; CPUs only)")
    serve.add_argument("--quantization", default=None, choices=list(QUANTIZATIONS),
                       help="default none; gguf: a .gguf model's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K weights "
                       "stay packed in each worker; an int8/fp8 safetensors checkpoint stays 8-bit whatever it says "
                       "(compressed-tensors, fp8: what its config.json must declare)")
    serve.add_argument("--tensor-parallel-size", type=int, default=None,
                       help="default 1: ranks per worker of every pool, each a process on the worker's node (a GPU "
                       "each on GPUs); it must divide the model's attention heads and KV heads")
    for pool in ("prefill", "decode"):
        serve.add_argument(f"--{pool}-tensor-parallel-size", type=int, default=None,
                           help=f"ranks per {pool} worker, over --tensor-parallel-size (KV moves between pools of "
                           "other sizes whole)")
    serve.add_argument("--speculative-config", type=speculative_json, default=None,
                       help=SPECULATIVE_HELP + "; every pool's (the cluster YAML's engine.speculative_config, "
                       "or a pool's own, sets it on the decode pool alone)")
    status = commands.add_parser("status", help="show a running server's workers, their load and KV usage")
    status.add_argument("--url", default="http://127.0.0.1:8000", help="the server's HTTP address")
    status.add_argument("--api-key", default=None, help="default: $PDSERVE_API_KEY")
    status.add_argument("--timeout", type=float, default=10.0)
    status.set_defaults(handler=command_status)
    stop_workers = commands.add_parser("stop-workers", help="stop the workers of a named cluster (serve --name)")
    stop_workers.add_argument("--name", required=True)
    stop_workers.add_argument("--ray-address", required=True, help="the Ray cluster they run on")
    stop_workers.set_defaults(handler=command_stop_workers)
    add_planner_commands(commands)
    serve.set_defaults(handler=command_serve)
    generate.set_defaults(handler=command_generate)
    chat.set_defaults(handler=command_chat)
    bench.set_defaults(handler=command_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except ValueError as error:  # bad configuration or request: a message, not a traceback
        print(f"pdserve: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
