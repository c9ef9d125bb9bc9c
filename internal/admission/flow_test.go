package admission

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

var testBands = []Band{
	{Name: "low", Priority: -10, QueueTimeout: time.Minute},
	{Name: "default", Priority: 0, QueueTimeout: time.Minute},
	{Name: "high", Priority: 10, QueueTimeout: time.Minute},
}

const (
	bLow, bDefault, bHigh = 0, 1, 2
)

// harness runs Acquire calls in goroutines of a synctest bubble and records
// the order in which they are granted.
type harness struct {
	t     *testing.T
	s     *Scheduler
	mu    sync.Mutex
	order []string
	rel   map[string]func()
	errs  map[string]error
	at    map[string]time.Duration // when each call ended, from the start
	t0    time.Time
}

func newHarness(t *testing.T, c SchedulerConfig) *harness {
	t.Helper()
	if c.Bands == nil {
		c.Bands = testBands
	}
	s, err := NewScheduler(c)
	if err != nil {
		t.Fatal(err)
	}
	return &harness{t: t, s: s, rel: map[string]func(){}, errs: map[string]error{}, at: map[string]time.Duration{}, t0: time.Now()}
}

// start calls Acquire as name and waits until it is granted or queued.
func (h *harness) start(ctx context.Context, name string, r FlowRequest) {
	go func() {
		rel, err := h.s.Acquire(ctx, r)
		h.mu.Lock()
		defer h.mu.Unlock()
		h.at[name] = time.Since(h.t0)
		if err != nil {
			h.errs[name] = err
			return
		}
		h.order = append(h.order, name)
		h.rel[name] = rel
	}()
	synctest.Wait()
}

func (h *harness) release(name string) {
	h.mu.Lock()
	rel := h.rel[name]
	h.mu.Unlock()
	if rel == nil {
		h.t.Fatalf("%s holds no slot", name)
	}
	rel()
	synctest.Wait()
}

func (h *harness) granted() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.order)
}

func (h *harness) err(name string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.errs[name]
}

// drain releases granted slots one at a time, oldest first, until n
// requests were granted in all, and returns the grant order.
func (h *harness) drain(n int) []string {
	for i := 0; ; i++ {
		g := h.granted()
		if len(g) >= n || i >= len(g) {
			return g
		}
		h.release(g[i])
	}
}

func TestSchedulerOrder(t *testing.T) {
	type req struct {
		name string
		band int
		flow string
		dl   time.Duration // deadline from now; 0 = none
	}
	for _, tc := range []struct {
		name    string
		byDL    bool
		bands   []Band
		weights map[string]float64
		reqs    []req
		want    []string // grant order after "hold"
	}{
		{
			name: "higher bands first, arrival within a band",
			reqs: []req{{"l1", bLow, "", 0}, {"d1", bDefault, "", 0}, {"h1", bHigh, "", 0}, {"l2", bLow, "", 0}, {"h2", bHigh, "", 0}, {"d2", bDefault, "", 0}},
			want: []string{"h1", "h2", "d1", "d2", "l1", "l2"},
		},
		{
			name: "deadline order within a band; no deadline last",
			byDL: true,
			reqs: []req{{"none", bDefault, "", 0}, {"late", bDefault, "", 50 * time.Second}, {"soon", bDefault, "", 10 * time.Second}, {"hi", bHigh, "", 0}},
			want: []string{"hi", "soon", "late", "none"},
		},
		{
			name:  "a band's own order wins over the global one",
			bands: []Band{{Name: "low", Priority: -10}, {Name: "default", Priority: 0, Order: OrderDeadline}, {Name: "high", Priority: 10}},
			reqs:  []req{{"none", bDefault, "", 0}, {"late", bDefault, "", 50 * time.Second}, {"soon", bDefault, "", 10 * time.Second}},
			want:  []string{"soon", "late", "none"},
		},
		{
			name: "arrival order ignores deadlines",
			reqs: []req{{"none", bDefault, "", 0}, {"late", bDefault, "", 50 * time.Second}, {"soon", bDefault, "", 10 * time.Second}},
			want: []string{"none", "late", "soon"},
		},
		{
			name: "equal flows alternate however many each queued",
			reqs: []req{{"a1", bDefault, "a", 0}, {"a2", bDefault, "a", 0}, {"a3", bDefault, "a", 0}, {"a4", bDefault, "a", 0}, {"b1", bDefault, "b", 0}, {"b2", bDefault, "b", 0}},
			want: []string{"a1", "b1", "a2", "b2", "a3", "a4"},
		},
		{
			name:    "weight 2 gets two turns per turn of weight 1",
			weights: map[string]float64{"a": 2},
			reqs:    []req{{"a1", bDefault, "a", 0}, {"a2", bDefault, "a", 0}, {"a3", bDefault, "a", 0}, {"a4", bDefault, "a", 0}, {"b1", bDefault, "b", 0}, {"b2", bDefault, "b", 0}, {"b3", bDefault, "b", 0}},
			want:    []string{"a1", "a2", "b1", "a3", "a4", "b2", "b3"},
		},
		{
			name: "fairness is per band; bands still win",
			reqs: []req{{"la", bLow, "a", 0}, {"da1", bDefault, "a", 0}, {"da2", bDefault, "a", 0}, {"db1", bDefault, "b", 0}, {"hb", bHigh, "b", 0}},
			want: []string{"hb", "da1", "db1", "da2", "la"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				h := newHarness(t, SchedulerConfig{Bands: tc.bands, MaxConcurrent: 1, QueueSize: 100, OrderByDeadline: tc.byDL, Weights: tc.weights})
				ctx := t.Context()
				h.start(ctx, "hold", FlowRequest{Band: bDefault})
				for _, r := range tc.reqs {
					fr := FlowRequest{Band: r.band, Flow: r.flow}
					if r.dl > 0 {
						fr.Deadline = time.Now().Add(r.dl)
					}
					h.start(ctx, r.name, fr)
				}
				if got := h.s.Queued(); got != len(tc.reqs) {
					t.Fatalf("queued %d, want %d", got, len(tc.reqs))
				}
				got := h.drain(len(tc.reqs) + 1)[1:]
				if !slices.Equal(got, tc.want) {
					t.Fatalf("grant order %v, want %v", got, tc.want)
				}
			})
		})
	}
}

// TestSchedulerFairShareBacklogged: a flow sending 10× the other's rate
// gets the same number of slots while both are backlogged.
func TestSchedulerFairShareBacklogged(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, SchedulerConfig{MaxConcurrent: 1, QueueSize: 1000})
		ctx := t.Context()
		h.start(ctx, "hold", FlowRequest{Band: bDefault})
		for i := range 100 {
			h.start(ctx, fmt.Sprintf("heavy%d", i), FlowRequest{Band: bDefault, Flow: "heavy"})
			if i%10 == 0 {
				h.start(ctx, fmt.Sprintf("light%d", i), FlowRequest{Band: bDefault, Flow: "light"})
			}
		}
		got := h.drain(21)[1:] // the first 20 grants
		light := 0
		for _, n := range got {
			if n[:5] == "light" {
				light++
			}
		}
		if light != 10 {
			t.Fatalf("light flow got %d of the first 20 slots, want 10: %v", light, got)
		}
	})
}

func TestSchedulerShedding(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, SchedulerConfig{MaxConcurrent: 1, QueueSize: 3})
		ctx := t.Context()
		h.start(ctx, "hold", FlowRequest{Band: bDefault})
		h.start(ctx, "la1", FlowRequest{Band: bLow, Flow: "a"})
		h.start(ctx, "lb1", FlowRequest{Band: bLow, Flow: "b"})
		h.start(ctx, "lb2", FlowRequest{Band: bLow, Flow: "b"})
		// full: a default newcomer sheds the newest request of the
		// largest low flow (b)
		h.start(ctx, "d1", FlowRequest{Band: bDefault})
		if err := h.err("lb2"); !errors.Is(err, ErrShed) || Status(err) != 429 {
			t.Fatalf("lb2: %v (status %d), want ErrShed 429", err, Status(err))
		}
		// flows a and b now hold one each: the tie goes by flow id
		h.start(ctx, "h1", FlowRequest{Band: bHigh})
		if err := h.err("la1"); !errors.Is(err, ErrShed) {
			t.Fatalf("la1: %v, want ErrShed", err)
		}
		h.start(ctx, "h2", FlowRequest{Band: bHigh})
		if err := h.err("lb1"); !errors.Is(err, ErrShed) {
			t.Fatalf("lb1: %v, want ErrShed", err)
		}
		// full of default and high: a low or default newcomer is refused
		for _, n := range []struct {
			name string
			band int
		}{{"l-new", bLow}, {"d-new", bDefault}} {
			h.start(ctx, n.name, FlowRequest{Band: n.band})
			if err := h.err(n.name); !errors.Is(err, ErrQueueFull) || errors.Is(err, ErrShed) {
				t.Fatalf("%s: %v, want ErrQueueFull", n.name, err)
			}
		}
		h.start(ctx, "h3", FlowRequest{Band: bHigh}) // sheds d1
		if err := h.err("d1"); !errors.Is(err, ErrShed) {
			t.Fatalf("d1: %v, want ErrShed", err)
		}
		if got := h.drain(4)[1:]; !slices.Equal(got, []string{"h1", "h2", "h3"}) {
			t.Fatalf("grants %v", got)
		}
	})
}

func TestSchedulerTimeouts(t *testing.T) {
	for _, tc := range []struct {
		name    string
		timeout time.Duration // band queue timeout
		dl      time.Duration // request deadline (0 none, <0 already past)
		wantErr error
		status  int
		wantAt  time.Duration
	}{
		{"band timeout", 2 * time.Second, 0, ErrQueueTimeout, 408, 2 * time.Second},
		{"deadline before band timeout", 2 * time.Second, 500 * time.Millisecond, ErrDeadline, 504, 500 * time.Millisecond},
		{"band timeout before deadline", 2 * time.Second, 5 * time.Second, ErrQueueTimeout, 408, 2 * time.Second},
		{"deadline, no band timeout", 0, 3 * time.Second, ErrDeadline, 504, 3 * time.Second},
		{"deadline already past", time.Minute, -time.Millisecond, ErrDeadline, 504, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				bands := []Band{{Name: "default", QueueTimeout: tc.timeout}}
				h := newHarness(t, SchedulerConfig{Bands: bands, MaxConcurrent: 1, QueueSize: 10})
				h.start(t.Context(), "hold", FlowRequest{})
				r := FlowRequest{}
				if tc.dl != 0 {
					r.Deadline = time.Now().Add(tc.dl)
				}
				h.start(t.Context(), "w", r)
				time.Sleep(time.Hour) // fake time: every timer fires
				synctest.Wait()
				err := h.err("w")
				if !errors.Is(err, tc.wantErr) || Status(err) != tc.status {
					t.Fatalf("err %v (status %d), want %v (%d)", err, Status(err), tc.wantErr, tc.status)
				}
				if at := h.at["w"]; at != tc.wantAt {
					t.Fatalf("ended at %v, want %v", at, tc.wantAt)
				}
				if h.s.Queued() != 0 || h.s.InUse() != 1 {
					t.Fatalf("queued %d in use %d after the timeout", h.s.Queued(), h.s.InUse())
				}
			})
		})
	}
}

func TestSchedulerCancelLeavesAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, SchedulerConfig{MaxConcurrent: 1, QueueSize: 10})
		h.start(t.Context(), "hold", FlowRequest{Band: bDefault})
		ctx, cancel := context.WithCancel(t.Context())
		h.start(ctx, "gone", FlowRequest{Band: bHigh, Flow: "x"})
		h.start(t.Context(), "next", FlowRequest{Band: bLow})
		if h.s.Queued() != 2 {
			t.Fatalf("queued %d", h.s.Queued())
		}
		cancel()
		synctest.Wait()
		if err := h.err("gone"); !errors.Is(err, context.Canceled) || Status(err) != 499 {
			t.Fatalf("gone: %v", err)
		}
		if h.at["gone"] != 0 || h.s.Queued() != 1 {
			t.Fatalf("cancelled waiter left at %v, queued %d", h.at["gone"], h.s.Queued())
		}
		h.release("hold")
		if got := h.granted(); !slices.Equal(got, []string{"hold", "next"}) {
			t.Fatalf("grants %v: the cancelled request must not take a slot", got)
		}
	})
}

func TestSchedulerGate(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var mu sync.Mutex
		open := true
		gate := func(int, bool) bool { mu.Lock(); defer mu.Unlock(); return open }
		setGate := func(v bool) { mu.Lock(); open = v; mu.Unlock() }
		h := newHarness(t, SchedulerConfig{MaxConcurrent: 1, QueueSize: 10, Gate: gate})
		h.start(t.Context(), "a", FlowRequest{Band: bDefault})
		setGate(false)
		h.start(t.Context(), "b", FlowRequest{Band: bLow})
		h.start(t.Context(), "c", FlowRequest{Band: bHigh})
		h.release("a") // a free slot does not open a closed gate
		if got := h.granted(); !slices.Equal(got, []string{"a"}) || h.s.Queued() != 2 {
			t.Fatalf("granted %v queued %d while saturated", got, h.s.Queued())
		}
		setGate(true)
		h.s.Kick()
		synctest.Wait()
		if got := h.granted(); !slices.Equal(got, []string{"a", "c"}) {
			t.Fatalf("granted %v after the gate opened", got)
		}
		h.release("c")
		if got := h.granted(); !slices.Equal(got, []string{"a", "c", "b"}) {
			t.Fatalf("granted %v", got)
		}
	})
}

func TestSchedulerClose(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, SchedulerConfig{MaxConcurrent: 1, QueueSize: 10})
		h.start(t.Context(), "hold", FlowRequest{Band: bDefault})
		h.start(t.Context(), "q", FlowRequest{Band: bHigh})
		h.s.Close()
		synctest.Wait()
		if err := h.err("q"); !errors.Is(err, ErrClosed) {
			t.Fatalf("queued: %v", err)
		}
		h.start(t.Context(), "late", FlowRequest{Band: bHigh})
		if err := h.err("late"); !errors.Is(err, ErrClosed) {
			t.Fatalf("after Close: %v", err)
		}
		h.release("hold")
		if h.s.InUse() != 0 {
			t.Fatalf("in use %d", h.s.InUse())
		}
	})
}

func TestSchedulerReleaseIdempotent(t *testing.T) {
	s, err := NewScheduler(SchedulerConfig{Bands: testBands, MaxConcurrent: 1})
	if err != nil {
		t.Fatal(err)
	}
	rel, err := s.Acquire(t.Context(), FlowRequest{Band: bHigh})
	if err != nil {
		t.Fatal(err)
	}
	rel()
	rel()
	if s.InUse() != 0 {
		t.Fatalf("in use %d after a double release", s.InUse())
	}
	if _, err := s.Acquire(t.Context(), FlowRequest{Band: 7}); err == nil {
		t.Fatal("band out of range accepted")
	}
}

// TestSchedulerHeadroom: lower bands leave Headroom slots free, so a high
// request is dispatched at once while lows wait.
func TestSchedulerHeadroom(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, SchedulerConfig{MaxConcurrent: 3, QueueSize: 10, Headroom: 1})
		ctx := t.Context()
		h.start(ctx, "l1", FlowRequest{Band: bLow})
		h.start(ctx, "d1", FlowRequest{Band: bDefault})
		h.start(ctx, "l2", FlowRequest{Band: bLow}) // 2 in use + 1 headroom: waits
		if got := h.granted(); !slices.Equal(got, []string{"l1", "d1"}) {
			t.Fatalf("granted %v", got)
		}
		h.start(ctx, "h1", FlowRequest{Band: bHigh}) // takes the reserved slot
		if got := h.granted(); !slices.Equal(got, []string{"l1", "d1", "h1"}) {
			t.Fatalf("granted %v: the high request must not wait", got)
		}
		h.release("h1") // back to 2 in use: the low still waits
		if got := h.granted(); len(got) != 3 {
			t.Fatalf("granted %v: headroom given to a low band", got)
		}
		h.release("l1")
		if got := h.granted(); !slices.Equal(got, []string{"l1", "d1", "h1", "l2"}) {
			t.Fatalf("granted %v", got)
		}
	})
}

// TestSchedulerFairShedding: with no lower band to shed, a newcomer of a
// flow holding less of the queue evicts the largest flow's newest request.
func TestSchedulerFairShedding(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, SchedulerConfig{MaxConcurrent: 1, QueueSize: 3})
		ctx := t.Context()
		h.start(ctx, "hold", FlowRequest{Band: bDefault})
		for i := range 3 {
			h.start(ctx, fmt.Sprintf("heavy%d", i), FlowRequest{Band: bDefault, Flow: "heavy"})
		}
		h.start(ctx, "light0", FlowRequest{Band: bDefault, Flow: "light"})
		if err := h.err("heavy2"); !errors.Is(err, ErrShedFair) || Status(err) != 429 {
			t.Fatalf("heavy2: %v, want ErrShedFair", err)
		}
		// light would hold 2 of 3 against heavy's 2: refused instead
		h.start(ctx, "light1", FlowRequest{Band: bDefault, Flow: "light"})
		if err := h.err("light1"); !errors.Is(err, ErrQueueFull) || errors.Is(err, ErrShedFair) {
			t.Fatalf("light1: %v, want ErrQueueFull", err)
		}
		// a heavy newcomer never sheds its own flow
		h.start(ctx, "heavy3", FlowRequest{Band: bDefault, Flow: "heavy"})
		if err := h.err("heavy3"); !errors.Is(err, ErrQueueFull) || errors.Is(err, ErrShedFair) {
			t.Fatalf("heavy3: %v", err)
		}
		if got := h.drain(4)[1:]; !slices.Equal(got, []string{"heavy0", "light0", "heavy1"}) {
			t.Fatalf("grants %v", got)
		}
	})
}
