package proxy

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

type timeoutErr struct{}

func (timeoutErr) Error() string   { return "i/o timeout" }
func (timeoutErr) Timeout() bool   { return true }
func (timeoutErr) Temporary() bool { return true }

var _ net.Error = timeoutErr{}

func TestStatusFor(t *testing.T) {
	refused := &DialError{Addr: "h:1", Err: &net.OpError{Op: "dial", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}}
	for _, tc := range []struct {
		name string
		err  error
		want int
	}{
		{"nil", nil, 200},
		{"no worker", policy.ErrNoWorker, 503},
		{"wrapped no worker", fmt.Errorf("pick: %w", policy.ErrNoWorker), 503},
		{"client canceled", context.Canceled, 499},
		{"dial canceled by client", &DialError{Addr: "h:1", Err: context.Canceled}, 499},
		{"connection refused", refused, 502},
		{"dial error inside url.Error", &url.Error{Op: "Post", URL: "http://h:1", Err: refused}, 502},
		{"connect timeout", &DialError{Addr: "h:1", Err: timeoutErr{}}, 502},
		{"deadline", context.DeadlineExceeded, 504},
		{"wrapped deadline", &url.Error{Op: "Post", Err: context.DeadlineExceeded}, 504},
		{"idle", ErrIdleTimeout, 504},
		{"header timeout", ErrHeaderTimeout, 504},
		{"net timeout", &url.Error{Op: "Post", Err: timeoutErr{}}, 504},
		{"reset", errors.New("read: connection reset by peer"), 502},
	} {
		if got := StatusFor(tc.err); got != tc.want {
			t.Errorf("%s: StatusFor = %d want %d", tc.name, got, tc.want)
		}
	}
	if m := messageFor(refused); !strings.HasPrefix(m, "upstream connect failed: connect to h:1") {
		t.Errorf("message %q", m)
	}
}

func TestBackoff(t *testing.T) {
	c := RetryConfig{InitialBackoff: 100 * time.Millisecond, MaxBackoff: time.Second, Multiplier: 2}
	var got []time.Duration
	for k := 1; k <= 6; k++ {
		got = append(got, c.backoff(k, rand.Float64))
	}
	want := []time.Duration{100e6, 200e6, 400e6, 800e6, 1e9, 1e9}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("backoff (-want +got):\n%s", diff)
	}
	c.Jitter = 0.5
	if lo := c.backoff(1, func() float64 { return 0 }); lo != 50*time.Millisecond {
		t.Errorf("low jitter %v", lo)
	}
	if hi := c.backoff(1, func() float64 { return 0.999999 }); hi < 149*time.Millisecond || hi > 150*time.Millisecond {
		t.Errorf("high jitter %v", hi)
	}
	c.Jitter = 3 // d·(1-3) < 0 is clamped
	if z := c.backoff(1, func() float64 { return 0 }); z != 0 {
		t.Errorf("negative backoff %v", z)
	}
}

func TestRetryableStatus(t *testing.T) {
	for code := 100; code < 600; code++ {
		want := code == 408 || code == 429 || code == 500 || code == 502 || code == 503 || code == 504
		if retryableStatus(code) != want {
			t.Errorf("%d", code)
		}
	}
}

func TestRetryBudget(t *testing.T) {
	now := time.Unix(1000, 0)
	b := newRetryBudget(RetryConfig{BudgetRatio: 0.5, BudgetMinPerSec: 1}, func() time.Time { return now })
	for range 20 {
		b.request()
	}
	n := 0
	for b.allow() {
		n++
		if n > 100 {
			break
		}
	}
	if n != 20 { // 0.5·20 + 1/s·10 s
		t.Fatalf("allowed %d retries, want 20", n)
	}
	now = now.Add(5 * time.Second) // still in the window
	if b.allow() {
		t.Fatal("budget refilled inside the window")
	}
	now = now.Add(11 * time.Second) // window passed
	if !b.allow() {
		t.Fatal("budget did not recover")
	}
	if newRetryBudget(RetryConfig{}, nil) != nil || !(*retryBudget)(nil).allow() {
		t.Fatal("ratio 0 must disable the budget")
	}
}

func TestParseUsage(t *testing.T) {
	for _, tc := range []struct {
		in   string
		p, c int64
		ok   bool
	}{
		{`{"usage":{"prompt_tokens":10,"total_tokens":12,"completion_tokens":2}}`, 10, 2, true},
		{`{"usage": { "completion_tokens" : 5, "prompt_tokens_details": {"cached_tokens": 3}, "prompt_tokens":7 }}`, 7, 5, true},
		{"data: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\ndata: {\"usage\":null}\n\ndata: [DONE]\n\n", 1, 1, true},
		{"data: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\ndata: {\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":9}}\n\n", 4, 9, true},
		{`{"usage":null}`, 0, 0, false},
		{`{"usage":{"prompt_tokens":3,"completion_to`, 0, 0, false},
		{`ns":2}}`, 0, 0, false},
		{`{"text":"the \"usage\": word"}`, 0, 0, false},
		{``, 0, 0, false},
	} {
		p, c, ok := parseUsage([]byte(tc.in))
		if p != tc.p || c != tc.c || ok != tc.ok {
			t.Errorf("%q: got %d %d %v", tc.in, p, c, ok)
		}
	}
}

func TestUsageTailKeepsLastBytes(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	var all []byte
	var tail usageTail
	for i := range 3000 {
		n := r.IntN(300)
		if i%500 == 0 {
			n = usageTailSize + r.IntN(100)
		}
		chunk := make([]byte, n)
		for j := range chunk {
			chunk[j] = byte('a' + r.IntN(26))
		}
		all = append(all, chunk...)
		tail.observe(chunk)
		want := all[max(0, len(all)-usageTailSize):]
		if got := tail.bytes(); string(got) != string(want) {
			t.Fatalf("step %d: tail mismatch (len %d vs %d)", i, len(got), len(want))
		}
	}
}

func TestCopyResponseHeaders(t *testing.T) {
	src := http.Header{
		"Content-Type":      {"text/event-stream"},
		"Set-Cookie":        {"a=1", "b=2"},
		"Connection":        {"keep-alive, X-Private"},
		"X-Private":         {"p"},
		"Keep-Alive":        {"timeout=5"},
		"Transfer-Encoding": {"chunked"},
		"Content-Length":    {"12"},
		"Content-Encoding":  {"gzip"},
		"X-Request-Id":      {"upstream"},
	}
	dst := http.Header{"X-Request-Id": {"router"}}
	CopyResponseHeaders(dst, src)
	want := http.Header{
		"Content-Type":     {"text/event-stream"},
		"Set-Cookie":       {"a=1", "b=2"},
		"Content-Encoding": {"gzip"},
		"X-Request-Id":     {"router"},
	}
	if diff := cmp.Diff(want, dst); diff != "" {
		t.Fatalf("(-want +got):\n%s", diff)
	}
	dst["Set-Cookie"][0] = "changed"
	if src["Set-Cookie"][0] != "a=1" {
		t.Fatal("values aliased")
	}
	// The copies share one allocation: an append to one key must not
	// write into another's values.
	for k := range dst {
		dst[k] = append(dst[k], "appended")
	}
	for k, vs := range dst {
		if n := len(vs); vs[n-1] != "appended" || slices.Contains(vs[:n-1], "appended") {
			t.Errorf("%s: %q after one append to every key", k, vs)
		}
	}
	// A key without values is copied too (a nil Content-Type is how a
	// handler turns off sniffing).
	only := http.Header{}
	CopyResponseHeaders(only, http.Header{"Content-Type": nil})
	if vs, ok := only["Content-Type"]; !ok || len(vs) != 0 {
		t.Errorf("a key without values: %q present %v", vs, ok)
	}
	if n := testing.AllocsPerRun(100, func() { CopyResponseHeaders(http.Header{}, src) }); n > 2 {
		t.Errorf("%.0f allocations (the map and one for every value)", n)
	}
}

func TestBreakerMetricsHook(t *testing.T) {
	BreakerMetricsHook(nil, "w")(worker.BreakerClosed, worker.BreakerOpen) // nil-safe
	m := metrics.NewForTest()
	h := BreakerMetricsHook(m, "http://w:1")
	h(worker.BreakerClosed, worker.BreakerOpen)
	if v := counterValue(t, m.CBState.WithLabelValues("http://w:1")); v != 1 {
		t.Errorf("cb_state %v", v)
	}
	if v := counterValue(t, m.CBTransitions.WithLabelValues("http://w:1", "closed", "open")); v != 1 {
		t.Errorf("transitions %v", v)
	}
}

// parseUsageFromEnd is parseUsage's search as it was: occurrences of the
// key taken from the end with bytes.LastIndex. The forward search must
// find the same object.
func parseUsageFromEnd(b []byte) (prompt, completion int64, ok bool) {
	end := len(b)
	for {
		i := bytes.LastIndex(b[:end], usageKey)
		if i < 0 {
			return 0, 0, false
		}
		end = i
		j := skipSpace(b, i+len(usageKey))
		if j >= len(b) || b[j] != ':' {
			continue
		}
		j = skipSpace(b, j+1)
		if j >= len(b) || b[j] != '{' {
			continue
		}
		return usageObject(b[j:])
	}
}

// TestParseUsageAgreesWithSearchFromEnd compares parseUsage with the search
// from the end on random sequences of the pieces a usage scan meets
// (overlapping keys, nulls, objects cut off, keys inside strings).
func TestParseUsageAgreesWithSearchFromEnd(t *testing.T) {
	pieces := []string{`"usage"`, `"usage":`, `"usage": null`, `"usage":{`, ` `, `:`, `{`, `}`, `"`, `\"`, `usage"`,
		`"prompt_tokens":7`, `,"completion_tokens": 3`, `"completion_tokens":12}`, `data: `, "\n\n", `x`, `"total_tokens":9}`}
	r := rand.New(rand.NewPCG(3, 4))
	var b []byte
	for i := range 20000 {
		b = b[:0]
		n := r.IntN(14)
		if i%4 == 0 { // longer than usageNear: the window and the whole
			n = 100 + r.IntN(300)
		}
		for range n {
			b = append(b, pieces[r.IntN(len(pieces))]...)
		}
		p, c, ok := parseUsage(b)
		wp, wc, wok := parseUsageFromEnd(b)
		if p != wp || c != wc || ok != wok {
			t.Fatalf("case %d %q: got %d %d %v, the search from the end %d %d %v", i, b, p, c, ok, wp, wc, wok)
		}
	}
}

// BenchmarkParseUsage reads a full usage tail: an event stream without a
// usage object (the common case) and one ending with it.
//
//	go test -run '^$' -bench ParseUsage ./internal/proxy
func BenchmarkParseUsage(b *testing.B) {
	event := "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\" tok\",\"finish_reason\":null}]}\n\n"
	noUsage := []byte(strings.Repeat(event, usageTailSize/len(event)+1)[:usageTailSize])
	withUsage := append(append([]byte{}, noUsage[:usageTailSize-200]...),
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":100,\"total_tokens\":110}}\n\ndata: [DONE]\n\n"...)
	for _, bc := range []struct {
		name string
		in   []byte
	}{{"none", noUsage}, {"last", withUsage}} {
		for _, f := range []struct {
			name  string
			parse func([]byte) (int64, int64, bool)
		}{{"forward", parseUsage}, {"from-end", parseUsageFromEnd}} {
			b.Run(bc.name+"/"+f.name, func(b *testing.B) {
				b.SetBytes(int64(len(bc.in)))
				for b.Loop() {
					f.parse(bc.in)
				}
			})
		}
	}
}
