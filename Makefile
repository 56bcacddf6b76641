# make dev  - venv + local Postgres (wal_level=logical) + migrations + demo + `dg dev` (DEV_ARGS="--port 3001": more options of `pgstream-dagster dev`)
# make test - venv + lint + `dg check defs` / `dg list defs` + `mkdocs build --strict` + the whole test suite (what CI runs)
# make stop - stop make dev's services (dg dev, Spark Connect server, Postgres); `pgstream-dagster dev --status` lists them
# make clean - stop them, then delete .pgstream/ (the demo's data) and Dagster's local files
# make docs - serve the documentation site (docs/, mkdocs.yml) on http://127.0.0.1:8000
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: dev stop test docs docs-reference lint bench bench-replay bench-write bench-sustained bench-latency bench-latency-dev bench-record bench-backlog bench-kafka bench-redis bench-lake bench-cpu bench-streams bench-group-reader bench-delivery-pool bench-spark-source bench-backfill bench-cold-start bench-snapshot bench-failover clean

# reinstalled only when pyproject.toml changed (the stamp); says so, as it takes minutes on a fresh clone
$(STAMP): pyproject.toml
	@echo "[venv] installing pgstream-dagster and its dependencies into $(VENV) (once, and after pyproject.toml changes) ..."
	@start=$$(date +%s); \
	  test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) && \
	  $(BIN)/python -m pip install -q --upgrade pip && \
	  $(BIN)/python -m pip install -q -e '.[dev,redis,rabbitmq,nats,kafka,mqtt,aws,metrics,lake]' && \
	  touch $(STAMP) && echo "[venv] done ($$(( $$(date +%s) - start )) s)"

dev: $(STAMP)
	$(BIN)/pgstream-dagster dev $(DEV_ARGS)

stop:
	test ! -x $(BIN)/pgstream-dagster || $(BIN)/pgstream-dagster dev --stop

# the code location loads (defs folder, StreamComponents, pgstream.yaml): on a throw-away Dagster
# instance (the repo's dagster.yaml wants a Postgres), without a database (nothing connects at load)
DG_LOAD_ENV = PGSTREAM_DATABASE_URL=$${PGSTREAM_DATABASE_URL:-postgresql://localhost/pgstream} DAGSTER_HOME=$$home

test: $(STAMP)
	$(BIN)/ruff check pgstream_dagster tests bench
	$(BIN)/python -m mypy
	$(BIN)/lint-imports
	home=$$(mktemp -d) && printf 'telemetry:\n  enabled: false\n' >"$$home/dagster.yaml" && $(DG_LOAD_ENV) $(BIN)/dg check defs && $(DG_LOAD_ENV) $(BIN)/dg list defs >/dev/null; \
	  status=$$?; rm -rf "$$home"; exit $$status
	site=$$(mktemp -d) && NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir "$$site"; \
	  status=$$?; rm -rf "$$site"; exit $$status
	$(BIN)/python -m pytest

# the documentation site, rebuilt on every change
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

# the generated reference pages (docs/reference/): configuration, CLI, metrics, SQL objects
docs-reference: $(STAMP)
	$(BIN)/pgstream-dagster docs

bench: $(STAMP)
	$(BIN)/python bench/run.py

bench-replay: $(STAMP)
	$(BIN)/python bench/replay.py

bench-spark-source: $(STAMP)
	$(BIN)/python bench/spark_source.py

bench-write: $(STAMP)
	$(BIN)/python bench/write_overhead.py

bench-sustained: $(STAMP)
	$(BIN)/python bench/sustained.py

bench-latency: $(STAMP)
	$(BIN)/python bench/latency.py

bench-latency-dev: $(STAMP)
	$(BIN)/python bench/latency_dev.py

bench-failover: $(STAMP)
	$(BIN)/python bench/failover.py

bench-record: $(STAMP)
	$(BIN)/python bench/record.py

bench-backlog: $(STAMP)
	$(BIN)/python bench/backlog.py

bench-kafka: $(STAMP)
	$(BIN)/python bench/kafka.py

bench-redis: $(STAMP)
	$(BIN)/python bench/redis_sink.py

bench-lake: $(STAMP)
	$(BIN)/python bench/lake.py

bench-cpu: $(STAMP)
	$(BIN)/python bench/cpu.py

# 1, 10 and 100 streams through `dg dev`: first events, processes, RSS, CPU per event, slots (issue 30)
bench-streams: $(STAMP)
	$(BIN)/python bench/streams.py

# a reader group's reader alone, without Dagster: the group's slot peeked every 0.1 s vs one replication connection
bench-group-reader: $(STAMP)
	$(BIN)/python bench/group_reader.py

# many streams' deliveries without Dagster: a process per stream vs one process hosting them (issue 30)
bench-delivery-pool: $(STAMP)
	$(BIN)/python bench/delivery_pool.py

bench-backfill: $(STAMP)
	$(BIN)/python bench/backfill.py

bench-cold-start: $(STAMP)
	$(BIN)/python bench/cold_start.py

# the repository snapshot the daemon fetches every 60 s, at 1, 10 and 100 streams (issue 45)
bench-snapshot: $(STAMP)
	$(BIN)/python bench/snapshot.py

# stops the services first: a Postgres left running on a deleted .pgstream/ would keep its port and memory
clean: stop
	rm -rf .pgstream .dagster_home storage history schedules .logs_queue .telemetry .nux
