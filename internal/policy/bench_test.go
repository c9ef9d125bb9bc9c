package policy

import (
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"testing"
)

// Concurrent picks, membership changes and health flips on every policy;
// meaningful under -race.
func TestConcurrentPicks(t *testing.T) {
	ws := mkWorkers(6)
	for _, name := range Names() {
		p := mustNew(t, name, testOptions(1))
		var wg sync.WaitGroup
		for g := range 4 {
			wg.Go(func() {
				for i := range 300 {
					gen := uint64(1 + i%2)
					cands := ws
					if gen == 2 {
						cands = ws[1:]
					}
					req := &Request{Body: []byte(fmt.Sprintf(`{"prompt":"g%d prompt %d"}`, g, i%17))}
					if i%3 == 0 {
						req.Headers = http.Header{"X-Session-Id": {fmt.Sprint(i)}}
					}
					if _, err := p.Pick(req, Candidates{Gen: gen, Workers: cands}); err != nil {
						t.Error(err)
						return
					}
					if i%50 == 0 {
						ws[5].SetHealthy(i%100 != 0)
					}
				}
			})
		}
		wg.Go(func() {
			if ca, ok := p.(*CacheAware); ok {
				for range 20 {
					ca.Evict()
					ca.RemoveWorker(ws[0].Key())
				}
			}
		})
		wg.Wait()
		for _, w := range ws {
			w.SetHealthy(true)
		}
	}
}

// benchBodies returns n distinct chat bodies of about size bytes sharing a
// system prompt (half the size), like a chat fleet.
func benchBodies(n, size int) [][]byte {
	r := rand.New(rand.NewPCG(1, 2))
	system := strings.Repeat("You are a helpful assistant. ", size/58+1)[:size/2]
	out := make([][]byte, n)
	for i := range out {
		out[i] = chatBody(system, "ok", fmt.Sprint(i, " ", randomText(r, size/2)))
	}
	return out
}

// go test -run='^$' -bench=. -benchmem ./internal/policy | benchstat
//
// Each iteration builds a fresh Request, so the per-request body parse that
// hash and cache policies need is included.
func BenchmarkPick(b *testing.B) {
	bodies := benchBodies(64, 1<<10)
	for _, name := range Names() {
		for _, n := range []int{8, 256} {
			b.Run(fmt.Sprintf("%s/workers=%d", name, n), func(b *testing.B) {
				ws := mkWorkers(n)
				p := mustNew(b, name, testOptions(1))
				c := Candidates{Gen: 1, Workers: ws}
				b.ReportAllocs()
				i := 0
				for b.Loop() {
					if _, err := p.Pick(&Request{Body: bodies[i%len(bodies)]}, c); err != nil {
						b.Fatal(err)
					}
					i++
				}
			})
		}
	}
}

// BenchmarkPickSessionHeader is the hash policies with a session header (no
// body parse).
func BenchmarkPickSessionHeader(b *testing.B) {
	hdrs := make([]http.Header, 64)
	for i := range hdrs {
		hdrs[i] = http.Header{"Content-Type": {"application/json"}, "X-Session-Id": {fmt.Sprint("s", i)}}
	}
	for _, name := range hashPolicies {
		for _, n := range []int{8, 256} {
			b.Run(fmt.Sprintf("%s/workers=%d", name, n), func(b *testing.B) {
				p := mustNew(b, name, testOptions(1))
				c := Candidates{Gen: 1, Workers: mkWorkers(n)}
				b.ReportAllocs()
				i := 0
				for b.Loop() {
					if _, err := p.Pick(&Request{Headers: hdrs[i%len(hdrs)]}, c); err != nil {
						b.Fatal(err)
					}
					i++
				}
			})
		}
	}
}

func BenchmarkExtract(b *testing.B) {
	for _, size := range []int{1 << 10, 32 << 10} {
		bodies := benchBodies(16, size)
		b.Run(fmt.Sprintf("RoutingText/%dKiB", size>>10), func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(bodies[0])))
			i := 0
			for b.Loop() {
				r := &Request{Body: bodies[i%len(bodies)]}
				_ = r.RoutingText()
				i++
			}
		})
		b.Run(fmt.Sprintf("RoutingTextValidJSON/%dKiB", size>>10), func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(bodies[0])))
			i := 0
			for b.Loop() {
				r := &Request{Body: bodies[i%len(bodies)], ValidJSON: true}
				_ = r.RoutingText()
				i++
			}
		})
		b.Run(fmt.Sprintf("HashKey/%dKiB", size>>10), func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(bodies[0])))
			i := 0
			for b.Loop() {
				r := &Request{Body: bodies[i%len(bodies)]}
				_ = r.HashKey()
				i++
			}
		})
	}
}

func BenchmarkRingBuild(b *testing.B) {
	for _, n := range []int{8, 256} {
		b.Run(fmt.Sprintf("workers=%d", n), func(b *testing.B) {
			ws := mkWorkers(n)
			b.ReportAllocs()
			for b.Loop() {
				buildRing(ws, DefaultVirtualNodes)
			}
		})
	}
}
