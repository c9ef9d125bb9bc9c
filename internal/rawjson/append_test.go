package rawjson

import (
	"encoding/json"
	"testing"
)

func FuzzAppendString(f *testing.F) {
	for _, s := range []string{"", "tx-1234", "127.0.0.1", `a"b`, `a\b`, "<&>", "\x00\x1f\x7f", "é\u2028\xff"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		want, _ := json.Marshal(s)
		if got := AppendString([]byte("x"), s); string(got) != "x"+string(want) {
			t.Fatalf("AppendString(%q) = %s, want x%s", s, got, want)
		}
	})
}
