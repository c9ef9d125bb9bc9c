package policy

import (
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

func counterValue(t testing.TB, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

func gaugeValue(t testing.TB, g prometheus.Gauge) float64 {
	t.Helper()
	var m dto.Metric
	if err := g.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetGauge().GetValue()
}

func TestNew(t *testing.T) {
	for _, name := range Names() {
		p := mustNew(t, name, testOptions(1))
		if p.Name() != name {
			t.Errorf("New(%q).Name() = %q", name, p.Name())
		}
	}
	_, err := New("least_loaded", DefaultOptions())
	if !errors.Is(err, ErrUnknownPolicy) {
		t.Fatalf("unknown name: err = %v", err)
	}
	for _, name := range Names() {
		if !strings.Contains(err.Error(), name) {
			t.Errorf("error %q does not list %q", err, name)
		}
	}
	bad := []func(*Options){
		func(o *Options) { o.CacheThreshold = 1.5 },
		func(o *Options) { o.CacheThreshold = math.NaN() },
		func(o *Options) { o.BalanceAbsThreshold = -1 },
		func(o *Options) { o.BalanceRelThreshold = -0.1 },
		func(o *Options) { o.VirtualNodes = 1 << 20 },
	}
	for i, mut := range bad {
		o := DefaultOptions()
		mut(&o)
		if _, err := New(NameCacheAware, o); err == nil {
			t.Errorf("bad options %d accepted", i)
		}
	}
}

func TestNoWorker(t *testing.T) {
	ws := mkWorkers(2)
	ws[0].SetHealthy(false)
	ex := &Request{Exclude: map[string]bool{ws[1].Key(): true}, Body: []byte(`{"prompt":"x"}`)}
	for _, name := range Names() {
		p := mustNew(t, name, testOptions(1))
		if _, err := p.Pick(ex, Candidates{Gen: 1, Workers: ws}); !errors.Is(err, ErrNoWorker) {
			t.Errorf("%s: all unusable: err = %v", name, err)
		}
		if _, err := p.Pick(&Request{}, Candidates{Gen: 1}); !errors.Is(err, ErrNoWorker) {
			t.Errorf("%s: no candidates: err = %v", name, err)
		}
		if _, err := p.Pick(nil, Candidates{Gen: 1, Workers: ws}); err != nil {
			t.Errorf("%s: nil request: %v", name, err)
		}
	}
}

// Every policy must skip unhealthy, unroutable, breaker-open and excluded
// workers, whatever the request.
func TestSkipsUnusable(t *testing.T) {
	ws := mkWorkers(5)
	ws[0].SetHealthy(false)
	ws[1].SetRoutable(false)
	for range 20 {
		ws[2].Breaker().Record(false) // opens after the default 10 failures
	}
	if ws[2].Available() {
		t.Fatal("breaker did not open")
	}
	c := Candidates{Gen: 1, Workers: ws}
	bodies := []string{`{"prompt":"a"}`, `{"user":"u"}`, `{"messages":[{"role":"user","content":"zz"}]}`, ``, `{`}
	for _, name := range Names() {
		p := mustNew(t, name, testOptions(3))
		for i := range 200 {
			req := &Request{Body: []byte(bodies[i%len(bodies)]), Exclude: map[string]bool{ws[3].Key(): true}}
			if got := pickKey(t, p, req, c); got != ws[4].Key() {
				t.Fatalf("%s picked %s, want the only usable %s", name, got, ws[4].Key())
			}
		}
	}
}

func TestRandomUniform(t *testing.T) {
	ws := mkWorkers(4)
	ws[3].SetHealthy(false)
	p := mustNew(t, NameRandom, testOptions(7))
	counts := map[string]int{}
	for range 3000 {
		counts[pickKey(t, p, &Request{}, Candidates{Gen: 1, Workers: ws})]++
	}
	for _, w := range ws[:3] {
		if n := counts[w.Key()]; n < 850 || n > 1150 {
			t.Errorf("%s picked %d/3000 times", w.Key(), n)
		}
	}
}

func TestRoundRobin(t *testing.T) {
	ws := mkWorkers(3)
	c := Candidates{Gen: 1, Workers: ws}
	p := mustNew(t, NameRoundRobin, testOptions(1))
	var got []string
	for range 6 {
		got = append(got, pickKey(t, p, &Request{}, c))
	}
	want := []string{ws[0].Key(), ws[1].Key(), ws[2].Key(), ws[0].Key(), ws[1].Key(), ws[2].Key()}
	if strings.Join(got, ",") != strings.Join(want, ",") {
		t.Fatalf("order %v want %v", got, want)
	}

	// An unusable worker's turn passes to the next usable one, once.
	ws[1].SetHealthy(false)
	p = mustNew(t, NameRoundRobin, testOptions(1))
	counts := map[string]int{}
	for range 100 {
		counts[pickKey(t, p, &Request{}, c)]++
	}
	if counts[ws[0].Key()] != 50 || counts[ws[2].Key()] != 50 {
		t.Fatalf("unfair with one worker down: %v", counts)
	}
}

func TestPowerOfTwoPrefersLessLoaded(t *testing.T) {
	ws := mkWorkers(2)
	c := Candidates{Gen: 1, Workers: ws}
	release := ws[0].Acquire()
	defer release()
	p := mustNew(t, NamePowerOfTwo, testOptions(5))
	for range 50 {
		ch, err := p.Pick(&Request{}, c)
		if err != nil {
			t.Fatal(err)
		}
		if ch.Worker != ws[1] || ch.Reason != "p2c 0<1" {
			t.Fatalf("picked %s (%s), want the idle worker", ch.Worker.Key(), ch.Reason)
		}
	}

	// The worker's own report counts when it is higher than ours.
	ws[1].SetPolledLoad(10)
	for range 50 {
		if got := pickKey(t, p, &Request{}, c); got != ws[0].Key() {
			t.Fatalf("polled load ignored: picked %s", got)
		}
	}
	o := testOptions(5)
	o.LocalLoadOnly = true
	local := mustNew(t, NamePowerOfTwo, o)
	if got := pickKey(t, local, &Request{}, c); got != ws[1].Key() {
		t.Fatalf("LocalLoadOnly: picked %s", got)
	}

	// One usable worker: no second draw needed.
	ws[1].SetHealthy(false)
	ch, err := p.Pick(&Request{}, c)
	if err != nil || ch.Worker != ws[0] || ch.Reason != "p2c single" {
		t.Fatalf("single: %+v %v", ch, err)
	}
}

func TestPowerOfTwoSpreadsEqualLoad(t *testing.T) {
	ws := mkWorkers(8)
	p := mustNew(t, NamePowerOfTwo, testOptions(9))
	counts := map[*worker.Worker]int{}
	for range 800 {
		ch, err := p.Pick(&Request{}, Candidates{Gen: 1, Workers: ws})
		if err != nil {
			t.Fatal(err)
		}
		counts[ch.Worker]++
	}
	for _, w := range ws {
		if counts[w] < 50 {
			t.Errorf("%s picked %d/800", w.Key(), counts[w])
		}
	}
}

func TestDecisionMetrics(t *testing.T) {
	m := metrics.NewForTest()
	ws := mkWorkers(3)
	for _, name := range Names() {
		o := testOptions(2)
		o.Metrics = m
		p := mustNew(t, name, o)
		for range 10 {
			if _, err := p.Pick(&Request{Body: []byte(`{"prompt":"hello"}`)}, Candidates{Gen: 1, Workers: ws}); err != nil {
				t.Fatal(err)
			}
		}
		total := 0.0
		for _, w := range ws {
			total += counterValue(t, m.PolicyDecisions.WithLabelValues(name, w.Key()))
		}
		if total != 10 {
			t.Errorf("%s: %v decisions recorded, want 10", name, total)
		}
	}
	processed := 0.0
	for _, w := range ws {
		processed += counterValue(t, m.Processed.WithLabelValues(w.Key()))
	}
	if want := float64(10 * len(Names())); processed != want {
		t.Errorf("processed %v want %v", processed, want)
	}
	if counterValue(t, m.CacheHits)+counterValue(t, m.CacheMisses) != 10 {
		t.Error("cache_aware hit/miss not counted")
	}
}

// TestDecisionMetricsAfterForgetWorker: a policy resolves a worker's
// decision counters once; once the worker's series are deleted (it left),
// a pick records into new series, not into the deleted ones.
func TestDecisionMetricsAfterForgetWorker(t *testing.T) {
	m := metrics.NewForTest()
	ws := mkWorkers(1)
	o := testOptions(1)
	o.Metrics = m
	p := mustNew(t, NameRoundRobin, o)
	pick := func(n int) {
		t.Helper()
		for range n {
			if _, err := p.Pick(&Request{}, Candidates{Gen: 1, Workers: ws}); err != nil {
				t.Fatal(err)
			}
		}
	}
	series := func() (decisions, processed float64, n int) {
		t.Helper()
		n = testutil.CollectAndCount(m.PolicyDecisions) + testutil.CollectAndCount(m.Processed)
		if n == 0 {
			return 0, 0, 0
		}
		return counterValue(t, m.PolicyDecisions.WithLabelValues(NameRoundRobin, ws[0].Key())),
			counterValue(t, m.Processed.WithLabelValues(ws[0].Key())), n
	}
	pick(3)
	if d, pr, n := series(); d != 3 || pr != 3 || n != 2 {
		t.Fatalf("before: decisions %v processed %v in %d series, want 3, 3, 2", d, pr, n)
	}
	m.ForgetWorker(ws[0].Key())
	if _, _, n := series(); n != 0 {
		t.Fatalf("%d series left after ForgetWorker", n)
	}
	pick(2)
	if d, pr, n := series(); d != 2 || pr != 2 || n != 2 {
		t.Fatalf("after: decisions %v processed %v in %d series, want 2, 2, 2 (counted into deleted series?)", d, pr, n)
	}
}

func TestCloseHelpers(t *testing.T) {
	p := mustNew(t, NameRandom, testOptions(1))
	if err := Close(p); err != nil {
		t.Fatal(err)
	}
	RemoveWorker(p, "x") // no-op for stateless policies
}
