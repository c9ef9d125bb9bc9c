package pd

import "testing"

func TestBypassLoad(t *testing.T) {
	var b bypassLoad
	type step struct {
		key           string
		tokens, limit int
		wantPending   int
		wantOK        bool
	}
	steps := []step{
		{"d1", 5, 8, 0, true},  // nothing pending
		{"d1", 3, 8, 5, false}, // 5+3 reaches the limit
		{"d1", 2, 8, 5, true},  // 5+2 stays below
		{"d2", 7, 8, 0, true},  // another decode has its own load
		{"d2", 8, 8, 7, false}, // alone at the limit: refused
	}
	var releases []func()
	for i, s := range steps {
		pending, release, ok := b.reserve(s.key, s.tokens, s.limit)
		if pending != s.wantPending || ok != s.wantOK || (release != nil) != ok {
			t.Fatalf("step %d %+v: pending %d ok %v release %v", i, s, pending, ok, release != nil)
		}
		if ok {
			releases = append(releases, release)
		}
	}
	if got := b.pending("d1"); got != 7 {
		t.Fatalf("d1 pending %d, want 7", got)
	}
	releases[0]()
	releases[0]() // a second call gives nothing back twice
	if got := b.pending("d1"); got != 2 {
		t.Fatalf("d1 pending after one release (twice) %d, want 2", got)
	}
	for _, r := range releases {
		r()
	}
	if len(b.m) != 0 {
		t.Fatalf("entries left after every release: %v", b.m)
	}
}
