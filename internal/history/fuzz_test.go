package history

import (
	"encoding/json"
	"net/http/httptest"
	"testing"
)

// FuzzLearner: whatever a worker answers, and however it is chunked, the
// learner relays it unchanged, never panics, learns at most one id, and
// learns the same id as from the whole body at once.
func FuzzLearner(f *testing.F) {
	f.Add([]byte(`{"id":"resp_1","object":"response"}`), uint8(3), false)
	f.Add([]byte("event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"r\"}}\n\n"), uint8(5), true)
	f.Add([]byte(`{"a":[1,{"b":"\"}"}],"id":"x\u0041"}`), uint8(1), false)
	f.Fuzz(func(t *testing.T, body []byte, chunk uint8, sse bool) {
		learn := func(step int) (string, int, string) {
			rec := httptest.NewRecorder()
			var id string
			calls := 0
			l := NewLearner(rec, func(s string) { id = s; calls++ })
			if sse {
				l.Header().Set("Content-Type", "text/event-stream")
			}
			l.WriteHeader(200)
			for b := body; len(b) > 0; {
				n := min(step, len(b))
				_, _ = l.Write(b[:n])
				b = b[n:]
			}
			return id, calls, rec.Body.String()
		}
		whole, wc, out := learn(len(body) + 1)
		chunked, cc, outc := learn(int(chunk%16) + 1)
		if out != string(body) || outc != string(body) {
			t.Fatal("relayed bytes differ from the answer")
		}
		if wc > 1 || cc > 1 || whole != chunked {
			t.Fatalf("whole %q (%d calls) vs chunked %q (%d calls)", whole, wc, chunked, cc)
		}
		// A valid object with one "id" string member: that is the id.
		var m map[string]json.RawMessage
		var want string
		if !sse && len(body) < maxSniff && json.Unmarshal(body, &m) == nil && countKey(body) == 1 &&
			json.Unmarshal(m["id"], &want) == nil && want != "" && whole != want {
			t.Fatalf("learned %q from %s, want %q", whole, body, want)
		}
	})
}

// countKey counts top-level "id" keys (approximately: any "id": token).
func countKey(b []byte) int {
	n := 0
	for i := 0; i+5 <= len(b); i++ {
		if string(b[i:i+5]) == `"id":` {
			n++
		}
	}
	return n
}
