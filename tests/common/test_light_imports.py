"""The front doors, metrics and the SDK load neither torch nor Ray: checked in a fresh interpreter, as
a gateway process would import them (import-linter checks the imports we write; this checks what
actually loads, third-party packages' own imports included)."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "ray", "triton", "ucxx", "transformers")
LIGHT_MODULES = [
    "cluster.serving.http.gateway",
    "cluster.serving.grpc.server",
    "cluster.serving.cluster_service",
    "cluster.serving.metered_service",
    "cluster.observability.metrics",
    "cluster.client",
    "cluster.common.events",
]


def loaded_after_import(module: str, app: bool = False) -> set[str]:
    """The top-level packages in sys.modules after importing `module` (and building the HTTP app)."""
    build = ("from cluster.serving.http.gateway import build_app\n"
             "class NoTemplate:\n    chat_template = None\n"
             "class Nothing:\n    model_name = 'm'\n    max_model_len = 8\n    tokenizer = NoTemplate()\n"
             "    ready = False\n"
             "build_app(Nothing(), api_key='')\n") if app else ""
    code = f"import sys, importlib\nimportlib.import_module({module!r})\n{build}print(' '.join(sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return {name.split(".")[0] for name in result.stdout.split()}


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_light_modules_load_no_torch_or_ray(module: str) -> None:
    assert not loaded_after_import(module) & set(HEAVY)


def test_the_http_app_loads_no_torch_or_ray() -> None:
    loaded = loaded_after_import("cluster.serving.http.gateway", app=True)
    assert "fastapi" in loaded  # the check itself works: what the gateway needs did load
    assert not loaded & set(HEAVY)


def test_the_check_sees_torch_where_it_loads() -> None:
    assert "torch" in loaded_after_import("cluster.engine.llm_engine")
