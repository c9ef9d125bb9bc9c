package proxy

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/switchyard-llm/switchyard/internal/migrate"
)

// sseWorker streams events, flushing each; end says how the stream ends:
// "done" ([DONE]), "error" (an engine error event, then [DONE]), "cut"
// (the connection closes mid-stream), "idle" (silence until the client
// goes away).
func sseWorker(f *fakeWorker, events []string, end string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		f.mu.Lock()
		f.bodies = append(f.bodies, b)
		f.mu.Unlock()
		w.Header().Set("Content-Type", "text/event-stream")
		rc := http.NewResponseController(w)
		for _, ev := range events {
			fmt.Fprintf(w, "data: %s\n\n", ev)
			_ = rc.Flush()
		}
		switch end {
		case "done":
			fmt.Fprint(w, "data: [DONE]\n\n")
		case "error":
			fmt.Fprint(w, "data: {\"error\":{\"message\":\"engine died\",\"type\":\"InternalServerError\",\"code\":500}}\n\ndata: [DONE]\n\n")
		case "cut":
			_ = rc.Flush()
			panic(http.ErrAbortHandler)
		case "idle":
			_ = rc.Flush()
			<-r.Context().Done()
		}
	}
}

func cmplEv(id, text string) string {
	return fmt.Sprintf(`{"id":%q,"object":"text_completion","created":7,"model":"m","choices":[{"index":0,"text":%q,"finish_reason":null}]}`, id, text)
}

func chatEv(id, delta string) string {
	return fmt.Sprintf(`{"id":%q,"object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index":0,"delta":%s,"finish_reason":null}]}`, id, delta)
}

// TestMigrateStream drives the regular-mode migration against fake
// workers: each way a stream can fail after its first byte, what the
// continuation request carries, and the client's stitched stream.
func TestMigrateStream(t *testing.T) {
	tests := []struct {
		name       string
		path, body string
		first      []string
		end        string
		second     []string
		wantText   string
		wantBody   []string // substrings of the continuation request
		wantCause  string
		wantResult string
		idle       time.Duration
		max        int
	}{
		{name: "engine error event", path: "/v1/completions", body: `{"prompt":"p","max_tokens":5,"stream":true}`,
			first: []string{cmplEv("cmpl-1", " a"), cmplEv("cmpl-1", " b")}, end: "error",
			second:   []string{cmplEv("cmpl-2", " c"), `{"id":"cmpl-2","created":9,"model":"m","choices":[{"index":0,"text":" d","finish_reason":"length"}]}`},
			wantText: " a b c d", wantBody: []string{`"prompt":"p a b"`, `"max_tokens":3`}, wantCause: migrate.CauseEngineError, wantResult: migrate.ResultContinued},
		{name: "connection cut", path: "/v1/chat/completions", body: `{"messages":[{"role":"user","content":"q"}],"max_completion_tokens":4,"stream":true}`,
			first: []string{chatEv("chatcmpl-1", `{"role":"assistant","content":""}`), chatEv("chatcmpl-1", `{"content":" a"}`)}, end: "cut",
			second:   []string{chatEv("chatcmpl-2", `{"role":"assistant","content":""}`), chatEv("chatcmpl-2", `{"content":" b"}`)},
			wantText: " a b", wantBody: []string{`"continue_final_message":true`, `"add_generation_prompt":false`, `"max_completion_tokens":3`, `{"role":"assistant","content":" a"}`},
			wantCause: migrate.CauseBroken, wantResult: migrate.ResultContinued},
		{name: "idle timeout", path: "/v1/completions", body: `{"prompt":"p","stream":true}`, idle: 300 * time.Millisecond,
			first: []string{cmplEv("cmpl-1", " a")}, end: "idle", second: []string{cmplEv("cmpl-2", " b")},
			wantText: " a b", wantBody: []string{`"max_tokens":15`}, wantCause: migrate.CauseIdle, wantResult: migrate.ResultContinued},
		{name: "finished before the cut", path: "/v1/completions", body: `{"prompt":"p","max_tokens":9,"stream":true,"stream_options":{"include_usage":true}}`,
			first: []string{cmplEv("cmpl-1", " a"), `{"id":"cmpl-1","created":7,"model":"m","choices":[{"index":0,"text":"","finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}`}, end: "cut",
			wantText: " a", wantCause: migrate.CauseBroken, wantResult: migrate.ResultComplete},
		{name: "refused", path: "/v1/completions", body: `{"prompt":"p","stream":true,"n":2}`,
			first: []string{cmplEv("cmpl-1", " a")}, end: "cut", wantCause: migrate.CauseBroken, wantResult: "refused_n"},
		{name: "exhausted", path: "/v1/completions", body: `{"prompt":"p","stream":true}`, max: 1,
			first: []string{cmplEv("cmpl-1", " a")}, end: "cut", second: []string{cmplEv("cmpl-2", " b")},
			wantCause: migrate.CauseBroken, wantResult: migrate.ResultFailed},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			a, b := newFakeWorker(t, nil), newFakeWorker(t, nil)
			a.set(sseWorker(a, tc.first, tc.end))
			secondEnd := "done"
			if tc.name == "exhausted" {
				secondEnd = "cut"
			}
			b.set(sseWorker(b, tc.second, secondEnd))
			mm := migrate.NewMetrics(prometheus.NewRegistry())
			o := RegularOptions{Policy: orderPolicy{order: []string{a.srv.URL, b.srv.URL}}, MaxMigrations: 2, MigrationMetrics: mm, StreamIdleTimeout: tc.idle}
			if tc.max > 0 {
				o.MaxMigrations = tc.max
			}
			f := newFixture(t, []string{a.srv.URL, b.srv.URL}, o)
			status, _, body := f.post(testCtx(t), tc.path, tc.body)
			if status != 200 {
				t.Fatalf("status %d %s", status, body)
			}
			if !strings.HasSuffix(body, "data: [DONE]\n\n") {
				t.Fatalf("stream not ended with [DONE]: %q", body)
			}
			if got := counterValue(t, mm.Total.WithLabelValues(tc.path, tc.wantCause, tc.wantResult)); got != 1 {
				t.Errorf("migrations{%s,%s} = %v, want 1 (stream %q)", tc.wantCause, tc.wantResult, got, body)
			}
			if tc.wantText == "" { // not continued: the error event of before
				if !strings.Contains(body, `"error"`) {
					t.Errorf("no error event: %q", body)
				}
				return
			}
			tr := migrate.NewTracker()
			var sp migrate.Splitter
			roles := 0
			sp.Feed([]byte(body), func(ev []byte) {
				tr.Event(ev)
				if strings.Contains(string(ev), `"role"`) {
					roles++
				}
				if s := string(ev); !strings.Contains(s, "[DONE]") && (!strings.Contains(s, `"created":7`) || strings.Contains(s, "-2\"")) {
					t.Errorf("event not in the original's envelope: %q", s)
				}
			})
			if tr.Text() != tc.wantText || tr.ErrorEvent() {
				t.Errorf("client text %q (error event %v), want %q", tr.Text(), tr.ErrorEvent(), tc.wantText)
			}
			if strings.Contains(tc.path, "chat") && roles != 1 {
				t.Errorf("%d role deltas", roles)
			}
			b.mu.Lock()
			var cont []byte
			if len(b.bodies) > 0 {
				cont = b.bodies[len(b.bodies)-1]
			}
			b.mu.Unlock()
			if tc.wantResult == migrate.ResultComplete && cont != nil {
				t.Errorf("a finished answer was continued: %s", cont)
			}
			for _, w := range tc.wantBody {
				if !strings.Contains(string(cont), w) {
					t.Errorf("continuation body %s lacks %s", cont, w)
				}
			}
		})
	}
}
