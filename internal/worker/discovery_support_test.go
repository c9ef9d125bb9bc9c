package worker

import (
	"testing"
	"time"
)

func TestUpsertWithInitRunsBeforePublish(t *testing.T) {
	r := NewRegistry(BreakerConfig{})
	var sawRoutable bool
	r.Subscribe(func(c Change) {
		for _, w := range c.Added {
			sawRoutable = sawRoutable || w.Routable()
		}
	})
	hold := func(w *Worker) { w.SetRoutable(false); w.SetNote("held") }
	spec := Spec{URL: "http://a:1", Role: RoleDecode, DPRank: -1, TransferMode: "WRITE"}
	ws, changed := r.UpsertWith("a:1", ExpandDP(spec, 2), time.Now(), hold)
	if !changed || len(ws) != 2 || sawRoutable || ws[0].Routable() || ws[1].Note() != "held" {
		t.Fatalf("init not applied before publish: %v %v routable-seen=%v", ws, changed, sawRoutable)
	}
	// Unchanged specs keep their workers and do not run init again.
	ws[0].SetRoutable(true)
	ws2, changed := r.UpsertWith("a:1", ExpandDP(spec, 2), time.Now(), hold)
	if changed || ws2[0] != ws[0] || !ws2[0].Routable() {
		t.Fatal("unchanged upsert replaced workers or re-ran init")
	}
}
