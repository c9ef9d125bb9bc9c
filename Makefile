# Switchyard build and test entry points. `make run` and `make test` are the
# README's two commands.
GO ?= go
BIN := bin
export CGO_ENABLED ?= 1

.PHONY: all build run test test-short lint vet fmt bench bench-smoke fuzz-smoke e2e bench-pd bench-overhead bench-ceiling bench-kv bench-flow bench-relay bench-warmup bench-compare bench-profile-pd chaos deps clean dashboard-snapshot dashboard-json interop interop-deps

all: build

build:
	$(GO) build -o $(BIN)/ ./cmd/...

deps:
	./scripts/install-deps.sh

# Router + a simulated 1P1D MoRI-IO WRITE fleet discovered over ZMQ.
run: build
	./scripts/run-demo.sh

# The whole test suite, in timed stages (scripts/test.sh): install, lint,
# unit tests, e2e, short chaos, czmq, the real-engine tier when installed,
# fuzz and bench smoke. STAGES="unit e2e" make test runs only those.
test:
	./scripts/test.sh

test-short:
	$(GO) test -count=1 -short ./...

lint: vet
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	@./scripts/grep-bans.sh

vet:
	$(GO) vet ./...
	$(GO) vet -tags czmq ./internal/discovery/zmq/

fmt:
	gofmt -w $$(git ls-files '*.go')

bench:
	$(GO) test -run='^$$' -bench=. -benchmem ./...

bench-smoke:
	$(GO) test -run='^$$' -bench=. -benchtime=1x ./... > /dev/null

# Benchmark scenarios (docs/BENCHMARKS.md): build the binaries once, start the
# router and simulated workers as children, write the results under
# $(BENCH_OUT). SCENARIO_FLAGS adds flags, e.g. SCENARIO_FLAGS=--quick.
BENCH_OUT ?= docs/bench
SCENARIO_FLAGS ?=

bench-pd:
	$(GO) build -o $(BIN)/ ./cmd/...
	$(BIN)/sybench scenario pd --bin-dir $(BIN) --out-dir $(BENCH_OUT) $(SCENARIO_FLAGS)

bench-overhead:
	$(GO) build -o $(BIN)/ ./cmd/...
	$(BIN)/sybench scenario overhead --bin-dir $(BIN) --out-dir $(BENCH_OUT) $(SCENARIO_FLAGS)

bench-ceiling:
	$(GO) build -o $(BIN)/ ./cmd/...
	$(BIN)/sybench scenario ceiling --bin-dir $(BIN) --out-dir $(BENCH_OUT) $(SCENARIO_FLAGS)

bench-flow:
	$(GO) build -o $(BIN)/ ./cmd/...
	$(BIN)/sybench scenario flow --bin-dir $(BIN) --out-dir $(BENCH_OUT) $(SCENARIO_FLAGS)

# Per-event relay latency and CPU (docs/bench/relay.md); vllm-router is the
# third target when scripts/install-peers.sh has installed it.
bench-relay:
	$(GO) build -o $(BIN)/ ./cmd/...
	$(BIN)/sybench scenario relay --bin-dir $(BIN) --out-dir $(BENCH_OUT) \
		$$([ -x .venv-peers/bin/vllm-router ] && echo --vllm-router .venv-peers/bin/vllm-router) \
		$$(command -v nginx > /dev/null || [ -x /usr/sbin/nginx ] && echo --nginx) $(SCENARIO_FLAGS)

KV_TOKENIZER ?= internal/tokenizer/testdata/tiny-llama.json
# Blocks of every worker's prefix cache: 1700 holds the workload's distinct
# blocks across the fleet; 1300 does not, so every policy evicts
# (docs/BENCHMARKS.md section 26).
KV_BLOCKS ?= 1700
bench-kv:
	$(GO) build -o $(BIN)/ ./cmd/...
	$(BIN)/sybench scenario kv --bin-dir $(BIN) --out-dir $(BENCH_OUT) --tokenizer $(KV_TOKENIZER) --num-blocks $(KV_BLOCKS) \
		--repeats 5 --policies round_robin,cache_aware,kv_aware+--tokenizer-path=$(KV_TOKENIZER),kv_aware+--tokenizer-path=$(KV_TOKENIZER)+--pd-uncached-token-threshold=1024 $(SCENARIO_FLAGS)
	$(BIN)/sybench scenario kv --bin-dir $(BIN) --out-dir $(BENCH_OUT) --tokenizer $(KV_TOKENIZER) --num-blocks $(KV_BLOCKS) --routers 2 \
		--repeats 5 --policies round_robin,cache_aware,kv_aware+--tokenizer-path=$(KV_TOKENIZER) $(SCENARIO_FLAGS)
	$(BIN)/sybench scenario kv --bin-dir $(BIN) --out-dir $(BENCH_OUT) --tokenizer $(KV_TOKENIZER) --num-blocks $(KV_BLOCKS) \
		--repeats 5 --request-rates 50,100,150,200 --policies cache_aware,kv_aware+--tokenizer-path=$(KV_TOKENIZER) $(SCENARIO_FLAGS)

# Head to head (docs/bench/compare.md/.png): switchyard vs vllm-router,
# sglang-router, nginx and vLLM's NIXL toy proxy; ~25 min, --quick ~4 min.
# Needs scripts/install-peers.sh first (run here when its folder is missing).
bench-compare:
	$(GO) build -o $(BIN)/ ./cmd/...
	@[ -x .venv-peers/bin/vllm-router ] || ./scripts/install-peers.sh
	$(BIN)/sybench scenario compare --bin-dir $(BIN) --out-dir $(BENCH_OUT) $(SCENARIO_FLAGS)

# switchyard and vllm-router profiled side by side in PD NIXL at C=256 and
# 1024 (perf stat per request, CPU by category); needs perf.
bench-profile-pd:
	$(GO) build -o $(BIN)/ ./cmd/...
	@[ -x .venv-peers/bin/vllm-router ] || ./scripts/install-peers.sh
	./scripts/profile-pd.sh

bench-warmup:
	./scripts/bench-warmup.sh

fuzz-smoke:
	./scripts/fuzz-smoke.sh 10s

# Chaos scenarios (test/chaos), long form: real router and simulated workers
# under load with crashes, stalls, error bursts, floods and slow clients.
# `go test ./test/chaos/` alone runs the short form; figures in docs/RELIABILITY.md.
chaos:
	CHAOS_LONG=1 $(GO) test -count=1 -timeout 30m -v ./test/chaos/

# docs/observability-dashboard.png: the Grafana dashboard's key panels
# rendered from real scrapes of a router under sybench load in front of a
# vllm-sim fleet (about 90 s).
dashboard-snapshot: build
	$(BIN)/dashboard-snapshot --bin $(BIN) --out docs/observability-dashboard.png

# deploy/grafana/switchyard.json from internal/dashboard.
dashboard-json:
	$(GO) run ./cmd/dashboard-snapshot --write-dashboard deploy/grafana/switchyard.json

# Real vLLM CPU engines in the loop (docs/INTEROP.md): install the Python
# environment and the tiny model, then run test/interop, failing if the
# environment is missing.
interop-deps:
	./scripts/install-interop.sh

interop: interop-deps
	INTEROP_REQUIRED=1 $(GO) test -count=1 -p 1 -timeout 30m -v ./test/interop/

clean:
	rm -rf $(BIN)
