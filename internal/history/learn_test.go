package history

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func TestLeadingID(t *testing.T) {
	cases := []struct {
		in   string
		id   string
		done bool
	}{
		{`{"id":"resp_1","object":"response"}`, "resp_1", true},
		{` { "id" : "resp_\u0031" }`, "resp_1", true},
		{`{"object":"response","nested":{"id":"x","a":[1,{"b":"}"}]},"n":-1.5e3,"t":true,"s":"a\"b","id":"resp_2"}`, "resp_2", true},
		{`{"id":"resp_`, "", false},
		{`{"object":"resp`, "", false},
		{`{"n":12`, "", false},
		{`{"nested":{"id":"x"`, "", false},
		{``, "", false},
		{`{"object":"response"}`, "", true},
		{`{"id":42}`, "", true},
		{`[{"id":"x"}]`, "", true},
		{`{}`, "", true},
		{`{"a":1 , "id":"z"}`, "z", true},
	}
	for _, tc := range cases {
		id, done := leadingID([]byte(tc.in))
		if id != tc.id || done != tc.done {
			t.Errorf("leadingID(%q) = %q, %v; want %q, %v", tc.in, id, done, tc.id, tc.done)
		}
	}
}

func TestCreatedEventID(t *testing.T) {
	cases := []struct {
		in   string
		id   string
		done bool
	}{
		{"event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_9\",\"status\":\"in_progress\"}}\n\n", "resp_9", true},
		{"event: response.created\r\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_9\"}}\r\n\n", "resp_9", true},
		{": keep-alive\n\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"r\"}}\n\n", "r", true},
		{"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_9\"", "", false},
		{"data: {\"type\":\"response.in_progress\"}\n\n", "", true},
		{"data: not json\n\n", "", true},
	}
	for _, tc := range cases {
		id, done := createdEventID([]byte(tc.in))
		if id != tc.id || done != tc.done {
			t.Errorf("createdEventID(%q) = %q, %v; want %q, %v", tc.in, id, done, tc.id, tc.done)
		}
	}
}

// checkingWriter fails the test if a byte of the answer is written before
// the id is known (the learner must call onID first).
type checkingWriter struct {
	*httptest.ResponseRecorder
	t      *testing.T
	learnt *string
	idAt   int // offset of the id's closing quote in the full body
}

func (w *checkingWriter) Write(p []byte) (int, error) {
	if w.Body.Len()+len(p) > w.idAt && *w.learnt == "" && w.idAt >= 0 {
		w.t.Errorf("bytes up to %d written before the id was learned", w.Body.Len()+len(p))
	}
	return w.ResponseRecorder.Write(p)
}

func TestLearner(t *testing.T) {
	jsonBody := `{"id":"resp_abc","object":"response","output":[{"id":"msg_1"}]}`
	sseBody := "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_sse\"}}\n\n" +
		"event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_sse\"}}\n\n"
	cases := []struct {
		name   string
		ct     string
		status int
		body   string
		chunk  int
		want   string
	}{
		{"json whole", "application/json", 200, jsonBody, 1 << 20, "resp_abc"},
		{"json byte by byte", "application/json", 200, jsonBody, 1, "resp_abc"},
		{"sse", "text/event-stream; charset=utf-8", 200, sseBody, 7, "resp_sse"},
		{"error status", "application/json", 404, `{"id":"resp_x","error":{}}`, 100, ""},
		{"no id", "application/json", 200, `{"object":"response"}`, 3, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var got string
			calls := 0
			idAt := -1
			switch {
			case tc.want == "":
			case strings.HasPrefix(tc.ct, "text/event-stream"): // an SSE client sees an event at its blank line
				idAt = strings.Index(tc.body, "\n\n") + 1
			default:
				idAt = strings.Index(tc.body, tc.want) + len(tc.want)
			}
			cw := &checkingWriter{ResponseRecorder: httptest.NewRecorder(), t: t, learnt: &got, idAt: idAt}
			l := NewLearner(cw, func(id string) { got = id; calls++ })
			l.Header().Set("Content-Type", tc.ct)
			l.WriteHeader(tc.status)
			for b := []byte(tc.body); len(b) > 0; {
				n := min(tc.chunk, len(b))
				if _, err := l.Write(b[:n]); err != nil {
					t.Fatal(err)
				}
				l.Flush()
				b = b[n:]
			}
			if got != tc.want || (tc.want != "" && calls != 1) {
				t.Fatalf("learned %q (%d calls), want %q", got, calls, tc.want)
			}
			if cw.Body.String() != tc.body || cw.Code != tc.status {
				t.Fatalf("relayed %d %q, want %d %q", cw.Code, cw.Body.String(), tc.status, tc.body)
			}
			if http.NewResponseController(l).Flush() != nil || !cw.Flushed {
				t.Fatal("flush does not reach the real writer")
			}
		})
	}
}

func TestLearnerGivesUp(t *testing.T) {
	rec := httptest.NewRecorder()
	called := false
	l := NewLearner(rec, func(string) { called = true })
	big := `{"pad":"` + strings.Repeat("x", maxSniff) + `","id":"late"}`
	_, _ = l.Write([]byte(big))
	if called || l.buf != nil || l.active {
		t.Fatalf("called %v, buf %d, active %v: an id past the sniff window must be ignored and the buffer released", called, len(l.buf), l.active)
	}
	if rec.Body.Len() != len(big) {
		t.Fatalf("relayed %d bytes of %d", rec.Body.Len(), len(big))
	}
}
