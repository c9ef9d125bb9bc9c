package pd

import "sync"

// bypassLoad counts, per decode worker, the uncached prompt tokens of the
// bypassed requests it is computing: reserved when a request is sent to the
// decode alone and given back at the first byte of its answer (the prompt
// computed) or when the attempt ends. A bypassed request waits behind the
// prompts the decode is already computing for other bypassed requests, so
// those count against --pd-uncached-token-threshold with its own.
type bypassLoad struct {
	mu sync.Mutex
	m  map[string]int // decode key -> tokens; no entry at 0
}

// reserve adds tokens to key's load when the sum stays below limit. It
// returns the load found and, when reserved, a release that is safe to call
// more than once.
func (b *bypassLoad) reserve(key string, tokens, limit int) (pending int, release func(), ok bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	pending = b.m[key]
	if pending+tokens >= limit {
		return pending, nil, false
	}
	if b.m == nil {
		b.m = make(map[string]int)
	}
	b.m[key] = pending + tokens
	var once sync.Once
	return pending, func() { once.Do(func() { b.release(key, tokens) }) }, true
}

func (b *bypassLoad) release(key string, tokens int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if n := b.m[key] - tokens; n > 0 {
		b.m[key] = n
	} else {
		delete(b.m, key)
	}
}

// pending is key's load now.
func (b *bypassLoad) pending(key string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.m[key]
}
