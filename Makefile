# Switchyard build and test entry points. `make run` and `make test` are the
# README's two commands.
GO ?= go
BIN := bin
export CGO_ENABLED ?= 1

.PHONY: all build run test test-short lint vet fmt bench bench-smoke fuzz-smoke e2e bench-pd bench-overhead chaos deps clean

all: build

build:
	$(GO) build -o $(BIN)/ ./cmd/...

deps:
	./scripts/install-deps.sh

# Router + a simulated 1P1D MoRI-IO WRITE fleet discovered over ZMQ.
run: build
	./scripts/run-demo.sh

# The whole test suite: lint, unit + e2e tests under -race, fuzz and bench smoke.
test: deps lint
	$(GO) test -race -count=1 -timeout 20m ./...
	$(MAKE) fuzz-smoke bench-smoke

test-short:
	$(GO) test -count=1 -short ./...

lint: vet
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	@./scripts/grep-bans.sh

vet:
	$(GO) vet ./...

fmt:
	gofmt -w $$(git ls-files '*.go')

bench:
	$(GO) test -run='^$$' -bench=. -benchmem ./...

bench-smoke:
	$(GO) test -run='^$$' -bench=. -benchtime=1x ./... > /dev/null

fuzz-smoke:
	./scripts/fuzz-smoke.sh 10s

clean:
	rm -rf $(BIN)
