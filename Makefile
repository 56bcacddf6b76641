# make dev  - venv + local Postgres (wal_level=logical) + migrations + demo + `dagster dev`
# make test - venv + the whole test suite (what CI runs)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: dev test lint bench bench-replay bench-write bench-sustained bench-latency bench-latency-dev bench-record bench-kafka clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,redis,rabbitmq,nats,kafka]'
	touch $(STAMP)

dev: $(STAMP)
	$(BIN)/pgstream-dagster dev

test: $(STAMP)
	$(BIN)/ruff check pgstream_dagster tests bench
	$(BIN)/python -m mypy
	$(BIN)/lint-imports
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python bench/run.py

bench-replay: $(STAMP)
	$(BIN)/python bench/replay.py

bench-write: $(STAMP)
	$(BIN)/python bench/write_overhead.py

bench-sustained: $(STAMP)
	$(BIN)/python bench/sustained.py

bench-latency: $(STAMP)
	$(BIN)/python bench/latency.py

bench-latency-dev: $(STAMP)
	$(BIN)/python bench/latency_dev.py

bench-record: $(STAMP)
	$(BIN)/python bench/record.py

bench-kafka: $(STAMP)
	$(BIN)/python bench/kafka.py

clean:
	-test -x $(BIN)/pgstream-dagster && $(BIN)/pgstream-dagster spark-connect --stop
	rm -rf .pgstream .dagster_home
