package policy

import (
	"fmt"
	"math/rand/v2"
	"net/http"
	"testing"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

var hashPolicies = []string{NameConsistentHash, NameRendezvousHash}

func sessionReq(i int) *Request {
	return &Request{Headers: http.Header{"X-Session-Id": {fmt.Sprint("session-", i)}}}
}

// assign maps nKeys session keys to worker keys.
func assign(t *testing.T, p Policy, ws []*worker.Worker, gen uint64, nKeys int) []string {
	t.Helper()
	out := make([]string, nKeys)
	for i := range out {
		out[i] = pickKey(t, p, sessionReq(i), Candidates{Gen: gen, Workers: ws})
	}
	return out
}

func TestHashLeaverMovesOnlyItsKeys(t *testing.T) {
	const n, keys = 10, 20000
	for _, name := range hashPolicies {
		t.Run(name, func(t *testing.T) {
			ws := mkWorkers(n)
			p := mustNew(t, name, testOptions(1))
			before := assign(t, p, ws, 1, keys)
			leaver := ws[4]
			after := assign(t, p, without(ws, leaver), 2, keys)
			moved := 0
			for i := range before {
				if before[i] == after[i] {
					continue
				}
				moved++
				if before[i] != leaver.Key() {
					t.Fatalf("key %d moved from %s, which did not leave", i, before[i])
				}
			}
			if frac := float64(moved) / keys; frac > 1.0/n+0.03 || frac < 1.0/n-0.05 {
				t.Fatalf("moved %.3f of keys, want about %.3f", frac, 1.0/n)
			}
		})
	}
}

// A merely unusable owner behaves exactly like a removed one: its keys go to
// the next distinct worker on the ring (HRW runner-up), spread over several
// workers, and nothing else moves. No ring is rebuilt for a health change.
func TestHashUnusableOwnerSpreads(t *testing.T) {
	const n, keys = 10, 5000
	for _, name := range hashPolicies {
		t.Run(name, func(t *testing.T) {
			ws := mkWorkers(n)
			p := mustNew(t, name, testOptions(1))
			before := assign(t, p, ws, 1, keys)
			down := ws[2]
			removed := assign(t, mustNew(t, name, testOptions(1)), without(ws, down), 1, keys)

			down.SetHealthy(false)
			heirs := map[string]int{}
			for i := range keys {
				ch, err := p.Pick(sessionReq(i), Candidates{Gen: 1, Workers: ws})
				if err != nil {
					t.Fatal(err)
				}
				got := ch.Worker.Key()
				if got != removed[i] {
					t.Fatalf("key %d went to %s, want next ring node %s", i, got, removed[i])
				}
				if before[i] == down.Key() {
					heirs[got]++
					if ch.Reason == "hash owner" {
						t.Fatalf("fallback reason %q", ch.Reason)
					}
				} else if got != before[i] {
					t.Fatalf("key %d of a healthy owner moved", i)
				}
			}
			if len(heirs) < n/2 {
				t.Fatalf("a down worker's keys went to only %d workers: %v", len(heirs), heirs)
			}
			if ch, ok := p.(*ConsistentHash); ok {
				if b := ch.rings.builds.Load(); b != 1 {
					t.Fatalf("ring built %d times for one membership", b)
				}
			}
		})
	}
}

func TestRingWalkReason(t *testing.T) {
	ws := mkWorkers(4)
	p := mustNew(t, NameConsistentHash, testOptions(1))
	c := Candidates{Gen: 1, Workers: ws}
	req := sessionReq(1)
	ch, _ := p.Pick(req, c)
	if ch.Reason != "hash owner" {
		t.Fatalf("reason %q", ch.Reason)
	}
	owner := ch.Worker
	owner.SetHealthy(false)
	ch2, _ := p.Pick(sessionReq(1), c)
	if ch2.Reason != "ring walk +1" || ch2.Worker == owner {
		t.Fatalf("after owner down: %s %q", ch2.Worker.Key(), ch2.Reason)
	}
	ch2.Worker.SetHealthy(false)
	ch3, _ := p.Pick(sessionReq(1), c)
	if ch3.Reason != "ring walk +2" {
		t.Fatalf("two down: %q", ch3.Reason)
	}
	// Excluding (a retry) walks the same way.
	owner.SetHealthy(true)
	ch2.Worker.SetHealthy(true)
	ex := sessionReq(1)
	ex.Exclude = map[string]bool{owner.Key(): true}
	if ch4, _ := p.Pick(ex, c); ch4.Worker != ch2.Worker {
		t.Fatalf("retry went to %s, want %s", ch4.Worker.Key(), ch2.Worker.Key())
	}
}

func TestRingBuiltOncePerMembership(t *testing.T) {
	pre := mkRole(4, worker.RolePrefill, "10.1.0")
	dec := mkRole(3, worker.RoleDecode, "10.2.0")
	p := mustNew(t, NameConsistentHash, testOptions(1)).(*ConsistentHash)
	builds := func() int64 { return p.rings.builds.Load() }

	for i := range 100 {
		if _, _, err := p.PickPair(sessionReq(i), Candidates{Gen: 5, Workers: pre}, Candidates{Gen: 5, Workers: dec}); err != nil {
			t.Fatal(err)
		}
	}
	if builds() != 2 {
		t.Fatalf("%d builds for prefill+decode at one gen", builds())
	}
	// A new generation with the same membership (another role changed) re-tags.
	for i := range 10 {
		_, _ = p.Pick(sessionReq(i), Candidates{Gen: 6, Workers: pre})
	}
	if builds() != 2 {
		t.Fatalf("rebuilt on a gen bump with the same membership: %d", builds())
	}
	// Health changes never rebuild.
	pre[0].SetHealthy(false)
	for i := range 10 {
		_, _ = p.Pick(sessionReq(i), Candidates{Gen: 6, Workers: pre})
	}
	if builds() != 2 {
		t.Fatalf("rebuilt on a health change: %d", builds())
	}
	// Membership change rebuilds once.
	for i := range 10 {
		_, _ = p.Pick(sessionReq(i), Candidates{Gen: 7, Workers: pre[1:]})
	}
	if builds() != 3 {
		t.Fatalf("%d builds after a membership change, want 3", builds())
	}
}

// Two routers (or one restarted) must agree on every key, whatever order
// their registries list workers in.
func TestHashReplicaAgreement(t *testing.T) {
	for _, name := range hashPolicies {
		t.Run(name, func(t *testing.T) {
			ws := mkWorkers(7)
			shuffled := append([]*worker.Worker(nil), ws...)
			rand.New(rand.NewPCG(3, 4)).Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
			// The second replica has its own Worker objects for the same URLs.
			other := mkWorkers(7)
			a := assign(t, mustNew(t, name, testOptions(1)), ws, 1, 2000)
			b := assign(t, mustNew(t, name, testOptions(99)), shuffled, 42, 2000)
			c := assign(t, mustNew(t, name, testOptions(5)), other, 1, 2000)
			for i := range a {
				if a[i] != b[i] || a[i] != c[i] {
					t.Fatalf("key %d: %s vs %s vs %s", i, a[i], b[i], c[i])
				}
			}
		})
	}
}

// Golden assignments: a change here moves every session of every existing
// deployment on upgrade, so it must be deliberate.
func TestHashGolden(t *testing.T) {
	ws := mkWorkers(5)
	want := map[string][]string{
		NameConsistentHash: goldenConsistent,
		NameRendezvousHash: goldenRendezvous,
	}
	for _, name := range hashPolicies {
		got := assign(t, mustNew(t, name, testOptions(1)), ws, 1, 8)
		for i := range got {
			if got[i] != want[name][i] {
				t.Errorf("%s key %d: %s, golden %s (all: %q)", name, i, got[i], want[name][i], got)
				break
			}
		}
	}
}

var (
	goldenConsistent = []string{"http://10.0.0.2:8000", "http://10.0.0.5:8000", "http://10.0.0.4:8000", "http://10.0.0.4:8000", "http://10.0.0.3:8000", "http://10.0.0.4:8000", "http://10.0.0.4:8000", "http://10.0.0.2:8000"}
	goldenRendezvous = []string{"http://10.0.0.5:8000", "http://10.0.0.4:8000", "http://10.0.0.5:8000", "http://10.0.0.5:8000", "http://10.0.0.1:8000", "http://10.0.0.4:8000", "http://10.0.0.4:8000", "http://10.0.0.3:8000"}
)

func TestHashSpreadsKeys(t *testing.T) {
	for _, name := range hashPolicies {
		ws := mkWorkers(8)
		counts := map[string]int{}
		for _, k := range assign(t, mustNew(t, name, testOptions(1)), ws, 1, 8000) {
			counts[k]++
		}
		for _, w := range ws {
			if n := counts[w.Key()]; n < 600 || n > 1400 {
				t.Errorf("%s: %s got %d/8000 keys", name, w.Key(), n)
			}
		}
	}
}

// Without a session, chat requests must not all hash to one worker (the
// REFERENCE "request:" constant-key weakness).
func TestHashNoSessionSpreads(t *testing.T) {
	for _, name := range hashPolicies {
		ws := mkWorkers(4)
		p := mustNew(t, name, testOptions(1))
		seen := map[string]bool{}
		for i := range 200 {
			body := fmt.Sprintf(`{"messages":[{"role":"user","content":"question %d"}]}`, i)
			seen[pickKey(t, p, &Request{Body: []byte(body)}, Candidates{Gen: 1, Workers: ws})] = true
		}
		empty := map[string]bool{}
		for range 200 {
			empty[pickKey(t, p, &Request{}, Candidates{Gen: 1, Workers: ws})] = true
		}
		if len(seen) != 4 || len(empty) != 4 {
			t.Errorf("%s: chat went to %d workers, empty bodies to %d", name, len(seen), len(empty))
		}
	}
}

func TestPickPairKeepsSession(t *testing.T) {
	pre := mkRole(4, worker.RolePrefill, "10.1.0")
	dec := mkRole(4, worker.RoleDecode, "10.2.0")
	for _, name := range hashPolicies {
		p := mustNew(t, name, testOptions(1)).(PairPolicy)
		pc := Candidates{Gen: 3, Workers: pre}
		dc := Candidates{Gen: 3, Workers: dec}
		pairs := map[string]bool{}
		for s := range 50 {
			p1, d1, err := p.PickPair(sessionReq(s), pc, dc)
			if err != nil {
				t.Fatal(err)
			}
			if p1.Worker.Role != worker.RolePrefill || d1.Worker.Role != worker.RoleDecode {
				t.Fatalf("%s: roles %v %v", name, p1.Worker.Role, d1.Worker.Role)
			}
			for range 3 {
				p2, d2, _ := p.PickPair(sessionReq(s), pc, dc)
				if p2.Worker != p1.Worker || d2.Worker != d1.Worker {
					t.Fatalf("%s: session %d moved", name, s)
				}
			}
			pairs[p1.Worker.Key()+"|"+d1.Worker.Key()] = true
		}
		if len(pairs) < 8 {
			t.Errorf("%s: only %d distinct pairs for 50 sessions", name, len(pairs))
		}
		for _, w := range dec {
			w.SetHealthy(false)
		}
		if _, _, err := p.PickPair(sessionReq(1), pc, dc); err == nil {
			t.Errorf("%s: no decode worker but no error", name)
		}
		for _, w := range dec {
			w.SetHealthy(true)
		}
	}
}
