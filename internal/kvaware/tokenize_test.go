package kvaware

import (
	"net/http"
	"testing"
	"time"
)

// TestTokenizerStats: a prompt asked once is then served from the cache;
// the stats count both and the time spent asking.
func TestTokenizerStats(t *testing.T) {
	ts := newTokenizeServer(t)
	tok := NewTokenizer(http.DefaultClient, time.Second, 10)
	for range 3 {
		if _, err := tok.Tokens(t.Context(), ts.URL, "/v1/completions", []byte(`{"prompt":"a b c"}`)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := tok.Tokens(t.Context(), ts.URL, "/v1/completions", []byte(`{"prompt":[1,2,3]}`)); err != nil {
		t.Fatal(err) // token ids: neither asked nor cached
	}
	if a, h, ns := tok.S.Asks.Load(), tok.S.CacheHits.Load(), tok.S.AskNanos.Load(); a != 1 || h != 2 || ns == 0 || ts.calls.Load() != 1 {
		t.Errorf("asks %d, cache hits %d, ask time %d ns, server calls %d; want 1, 2, > 0, 1", a, h, ns, ts.calls.Load())
	}
}
