package policy

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

// TestMain fails the package if a test leaves a goroutine (cache_aware's
// eviction loop) running.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// mkWorkers returns n workers in registry (key) order.
func mkWorkers(n int) []*worker.Worker {
	return mkRole(n, worker.RoleRegular, "10.0.0")
}

func mkRole(n int, role worker.Role, net string) []*worker.Worker {
	ws := make([]*worker.Worker, n)
	for i := range ws {
		ws[i] = worker.New(worker.Spec{URL: fmt.Sprintf("http://%s.%d:8000", net, i+1), DPRank: -1, Role: role}, worker.BreakerConfig{})
	}
	slices.SortFunc(ws, func(a, b *worker.Worker) int { return strings.Compare(a.Key(), b.Key()) })
	return ws
}

func without(ws []*worker.Worker, drop *worker.Worker) []*worker.Worker {
	out := make([]*worker.Worker, 0, len(ws))
	for _, w := range ws {
		if w != drop {
			out = append(out, w)
		}
	}
	return out
}

func testOptions(seed uint64) Options {
	o := DefaultOptions()
	o.Rand = SeededRand(seed)
	o.EvictionInterval = -1
	return o
}

func mustNew(t testing.TB, name string, o Options) Policy {
	t.Helper()
	p, err := New(name, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = Close(p) })
	return p
}

func pickKey(t testing.TB, p Policy, req *Request, c Candidates) string {
	t.Helper()
	ch, err := p.Pick(req, c)
	if err != nil {
		t.Fatal(err)
	}
	return ch.Worker.Key()
}
