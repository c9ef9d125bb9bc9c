package policy

import (
	"fmt"

	"github.com/cespare/xxhash/v2"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

// Rendezvous is highest-random-weight hashing: every usable worker scores
// xxhash64(key + "\x00" + worker key) and the highest wins. There is no
// state; when a worker leaves or becomes unusable only its keys move, each
// to its own runner-up, so they spread evenly.
type Rendezvous struct {
	base
	keys *KeyExtractor
}

var (
	_ Policy     = (*Rendezvous)(nil)
	_ PairPolicy = (*Rendezvous)(nil)
)

func newRendezvous(o Options) *Rendezvous {
	return &Rendezvous{base: base{name: NameRendezvousHash, o: o}, keys: NewKeyExtractor(o.HashHeaders)}
}

// Pick implements Policy.
func (p *Rendezvous) Pick(req *Request, c Candidates) (Choice, error) {
	req = orEmpty(req)
	return p.pick(req, c, p.keys.Key(req))
}

// PickPair implements PairPolicy (same key on both sides).
func (p *Rendezvous) PickPair(req *Request, prefill, decode Candidates) (Choice, Choice, error) {
	req = orEmpty(req)
	return pickPairByKey(p.pick, req, prefill, decode, p.keys.Key(req))
}

var zeroSep = []byte{0}

func (p *Rendezvous) pick(req *Request, c Candidates, key string) (Choice, error) {
	ws := c.Workers
	if len(ws) == 0 {
		return Choice{}, ErrNoWorker
	}
	if key == "" {
		i := sample(req, ws, p.o.Rand, -1)
		if i < 0 {
			return Choice{}, ErrNoWorker
		}
		return p.choice(ws[i], "no key, random"), nil
	}
	var prefix xxhash.Digest
	prefix.Reset()
	_, _ = prefix.WriteString(key)
	_, _ = prefix.Write(zeroSep)
	score := func(w *worker.Worker) uint64 {
		d := prefix
		_, _ = d.WriteString(w.Key())
		return d.Sum64()
	}
	better := func(s uint64, w *worker.Worker, bs uint64, b *worker.Worker) bool {
		return b == nil || s > bs || s == bs && w.Key() < b.Key()
	}
	// Usable() costs a breaker lock, so check it only for workers that would
	// beat the best usable one so far; count the better-ranked unusable ones.
	var best, top *worker.Worker
	var bestScore, topScore uint64
	for _, w := range ws {
		s := score(w)
		if better(s, w, topScore, top) {
			top, topScore = w, s
		}
		if better(s, w, bestScore, best) && req.Usable(w) {
			best, bestScore = w, s
		}
	}
	if best == nil {
		return Choice{}, ErrNoWorker
	}
	if best == top {
		return p.choice(best, "hash owner"), nil
	}
	rank := 0
	for _, w := range ws {
		if w != best && better(score(w), w, bestScore, best) {
			rank++
		}
	}
	return p.choice(best, reasonN("hrw fallback +", int64(rank))), nil
}

// pickPairByKey looks up the prefill and the decode with the same session
// key, each among its own candidates, so a session keeps its P and its D.
func pickPairByKey(pick func(*Request, Candidates, string) (Choice, error), req *Request, prefill, decode Candidates, key string) (Choice, Choice, error) {
	pc, err := pick(req, prefill, key)
	if err != nil {
		return Choice{}, Choice{}, fmt.Errorf("prefill: %w", err)
	}
	dc, err := pick(req, decode, key)
	if err != nil {
		return Choice{}, Choice{}, fmt.Errorf("decode: %w", err)
	}
	return pc, dc, nil
}
