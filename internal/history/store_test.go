package history

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func newStore(t *testing.T, max int, ttl time.Duration) (*Store, *clock, *prometheus.Registry) {
	t.Helper()
	c := &clock{t: time.Unix(1000, 0)}
	reg := prometheus.NewRegistry()
	s, err := New(Options{MaxEntries: max, TTL: ttl, Registerer: reg, Now: c.now})
	if err != nil {
		t.Fatal(err)
	}
	return s, c, reg
}

func TestStore(t *testing.T) {
	type step struct {
		do   string // put | get | advance | forget
		id   string
		url  string
		d    time.Duration
		want string // get: expected owner ("" = unknown)
	}
	cases := []struct {
		name  string
		max   int
		steps []step
		len   int
	}{
		{"put and get", 10, []step{{do: "put", id: "a", url: "http://w1"}, {do: "get", id: "a", want: "http://w1"}, {do: "get", id: "b"}}, 1},
		{"capacity evicts the oldest", 2, []step{
			{do: "put", id: "a", url: "u1"}, {do: "put", id: "b", url: "u2"}, {do: "put", id: "c", url: "u3"},
			{do: "get", id: "a"}, {do: "get", id: "b", want: "u2"}, {do: "get", id: "c", want: "u3"}}, 2},
		{"learning again refreshes", 2, []step{
			{do: "put", id: "a", url: "u1"}, {do: "put", id: "b", url: "u2"}, {do: "put", id: "a", url: "u9"}, {do: "put", id: "c", url: "u3"},
			{do: "get", id: "a", want: "u9"}, {do: "get", id: "b"}}, 2},
		{"ttl", 10, []step{
			{do: "put", id: "a", url: "u1"}, {do: "advance", d: 30 * time.Second}, {do: "put", id: "b", url: "u2"},
			{do: "advance", d: 30 * time.Second}, {do: "get", id: "a"}, {do: "get", id: "b", want: "u2"},
			{do: "advance", d: 30 * time.Second}, {do: "get", id: "b"}}, 0},
		{"forget worker", 10, []step{
			{do: "put", id: "a", url: "u1"}, {do: "put", id: "b", url: "u2"}, {do: "put", id: "c", url: "u1"},
			{do: "forget", url: "u1"}, {do: "get", id: "a"}, {do: "get", id: "c"}, {do: "get", id: "b", want: "u2"}}, 1},
		{"empty id or url ignored", 10, []step{{do: "put", id: "", url: "u1"}, {do: "put", id: "a", url: ""}, {do: "get", id: "a"}}, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s, c, _ := newStore(t, tc.max, time.Minute)
			for i, st := range tc.steps {
				switch st.do {
				case "put":
					s.Put(st.id, st.url)
				case "advance":
					c.add(st.d)
				case "forget":
					s.ForgetWorker(st.url)
				case "get":
					got, ok := s.Peek(st.id)
					if ok != (st.want != "") || got != st.want {
						t.Fatalf("step %d: Peek(%q) = %q, %v; want %q", i, st.id, got, ok, st.want)
					}
				}
			}
			if n := s.Len(); n != tc.len {
				t.Fatalf("Len %d, want %d", n, tc.len)
			}
		})
	}
}

func TestStoreMetrics(t *testing.T) {
	s, c, reg := newStore(t, 2, time.Minute)
	for i := range 3 {
		s.Put(fmt.Sprintf("resp_%d", i), "u")
	}
	s.Owner(OpRetrieve, "resp_2")
	s.Owner(OpRetrieve, "resp_0")
	s.Owner(OpCancel, "resp_1")
	c.add(2 * time.Minute)
	s.Owner(OpPrevious, "resp_1")
	for _, m := range []struct {
		c    prometheus.Collector
		want float64
	}{
		{s.lookups.WithLabelValues(OpRetrieve, "hit"), 1},
		{s.lookups.WithLabelValues(OpRetrieve, "miss"), 1},
		{s.lookups.WithLabelValues(OpCancel, "hit"), 1},
		{s.lookups.WithLabelValues(OpPrevious, "miss"), 1},
		{s.learned, 3},
		{s.evicted.WithLabelValues("capacity"), 1},
		{s.evicted.WithLabelValues("expired"), 2},
		{s.entries, 0},
	} {
		if got := testutil.ToFloat64(m.c); got != m.want {
			t.Errorf("%v = %v, want %v", m.c, got, m.want)
		}
	}
	if n, err := testutil.GatherAndCount(reg, "vllm_router_history_lookups_total"); err != nil || n != 4 {
		t.Fatalf("lookups series %d, %v", n, err)
	}
	if _, err := New(Options{Registerer: reg}); err == nil {
		t.Fatal("registering twice: no error")
	}
}

func TestStoreConcurrent(t *testing.T) {
	s, _, _ := newStore(t, 50, time.Minute)
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 500 {
				id := fmt.Sprintf("r%d-%d", g, i)
				s.Put(id, "u")
				s.Owner(OpRetrieve, id)
				if i%100 == 0 {
					s.ForgetWorker("v")
				}
			}
		})
	}
	wg.Wait()
	if n := s.Len(); n != 50 {
		t.Fatalf("Len %d, want 50", n)
	}
}
