package policy

import "sync/atomic"

// RoundRobin cycles over the usable workers in candidate (registry key)
// order. The cursor is the position after the last pick; a pick takes the
// first usable worker at or after it and moves the cursor past it with a
// compare-and-swap, so an unusable worker's turn goes to the next worker
// once, not to its successor forever, and concurrent picks never return the
// same turn twice.
type RoundRobin struct {
	base
	next atomic.Uint64
}

var _ Policy = (*RoundRobin)(nil)

func newRoundRobin(o Options) *RoundRobin { return &RoundRobin{base: base{name: NameRoundRobin, o: o}} }

// Pick implements Policy.
func (p *RoundRobin) Pick(req *Request, c Candidates) (Choice, error) {
	req = orEmpty(req)
	ws := c.Workers
	n := uint64(len(ws))
	if n == 0 {
		return Choice{}, ErrNoWorker
	}
	for {
		old := p.next.Load()
		start := old % n
		j := uint64(0)
		found := false
		for k := range n {
			j = (start + k) % n
			if req.Usable(ws[j]) {
				found = true
				break
			}
		}
		if !found {
			return Choice{}, ErrNoWorker
		}
		if p.next.CompareAndSwap(old, j+1) {
			return p.choice(ws[j], "round robin"), nil
		}
	}
}
