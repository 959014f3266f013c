"""The engine core runs with torch and its few light companions alone.

A GPU machine may hold nothing but torch, triton, transformers, safetensors, tokenizers, jinja2,
pyyaml, numpy and a handful of others: none of the serving stack (Ray, UCX, the HTTP and gRPC
doors, Redis, OpenTelemetry), no grammars (llguidance), no GGUF reader. So the engine, the model,
the kernels and the safetensors loader must import and generate there, and the optional parts must
load only where they are used, refusing with the missing package's name.

Each check runs in a fresh interpreter where those packages are absent: their names map to None in
`sys.modules`, which is how Python marks a module as not importable (`import` raises
ModuleNotFoundError and `importlib.util.find_spec` answers None, as for a package never installed;
a finder that raised from `find_spec` instead would break the libraries that probe for optional
packages with it, transformers among them).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

# Not installed on the GPU machine, and never needed to generate on one engine. msgpack (KV frame
# headers), starlette and accelerate are absent there too.
ABSENT = ("llguidance", "ray", "ucxx", "gguf", "fastapi", "starlette", "pydantic", "redis", "opentelemetry",
          "uvicorn", "grpc", "msgpack", "accelerate")

HIDE = f"import sys\nfor name in {ABSENT!r}:\n    sys.modules[name] = None\n"

GENERATE = textwrap.dedent("""
    import json
    import tempfile
    from pathlib import Path

    from cluster.common.sampling_params import SamplingParams
    from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig
    from cluster.engine.llm_engine import LLMEngine
    from cluster.weights.synthetic import build_tiny_llama_checkpoint

    path = build_tiny_llama_checkpoint(Path(tempfile.mkdtemp()) / "tiny")
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(path), dtype="float32", device="cpu"),
                                    cache=CacheConfig(block_size=4, num_blocks=64)))
    outputs = engine.generate([[5, 17, 33, 9], "Hello world"],
                              SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    loaded = sorted({name.split(".")[0] for name, module in sys.modules.items() if module is not None})
    print(json.dumps({"tokens": [output.token_ids for output in outputs], "loaded": loaded}))
""")


ROOT = Path(__file__).resolve().parents[2]
# The `gpu`-marked tests a GPU machine with only those packages runs (docs/kernels.md says how).
GPU_TESTS = ("tests/model/test_cuda.py", "tests/worker/test_kv_staging.py")


def run_without_absent(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", HIDE + code], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_the_check_hides_the_packages() -> None:
    result = run_without_absent("import llguidance")
    assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr


def test_the_engine_generates_with_torch_alone() -> None:
    result = run_without_absent(GENERATE)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert [len(ids) for ids in report["tokens"]] == [5, 5]
    loaded = set(report["loaded"])
    assert {"torch", "safetensors", "tokenizers"} <= loaded
    assert not loaded & set(ABSENT)


def test_a_grammar_without_llguidance_names_the_package() -> None:
    code = GENERATE.split("outputs =")[0] + textwrap.dedent("""
        from cluster.common.structured_output import StructuredOutput
        try:
            engine.add_request("Hello", SamplingParams(max_tokens=4, structured=StructuredOutput("regex", "a+")))
        except ImportError as error:
            print("refused:", error)
    """)
    result = run_without_absent(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused:" in result.stdout and "llguidance" in result.stdout.split("refused:", 1)[1]


def test_the_kernels_and_loader_import_with_torch_alone() -> None:
    modules = ("pdserve_kernels.reference", "pdserve_kernels.torch_decode", "pdserve_kernels.torch_prefill",
               "pdserve_kernels.cpu_fused", "cluster.weights.loader", "cluster.weights.synthetic",
               "cluster.model.runner", "cluster.model.cuda_graphs", "cluster.model.attention.triton_backend")
    result = run_without_absent("".join(f"import {module}\n" for module in modules))
    assert result.returncode == 0, result.stderr[-3000:]


def test_a_gguf_file_without_gguf_names_the_package() -> None:
    code = textwrap.dedent("""
        from pathlib import Path
        from cluster.weights.loader import read_gguf
        try:
            read_gguf(Path("model.gguf"))
        except ImportError as error:
            print("refused:", error)
    """)
    result = run_without_absent(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused:" in result.stdout and "'gguf'" in result.stdout


def test_the_gpu_tests_load_without_the_absent_packages() -> None:
    arguments = ["--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu", *GPU_TESTS]
    result = run_without_absent(f"import pytest\nsys.exit(pytest.main({arguments!r}))")
    assert result.returncode == 0, result.stdout[-3000:]
    assert all(path in result.stdout for path in GPU_TESTS)
