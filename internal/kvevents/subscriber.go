package kvevents

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/go-zeromq/zmq4"
)

// Source is one publisher: a worker (one DP rank) and its endpoints.
type Source struct {
	Worker         string // registry key of the worker the events describe
	Endpoint       string // tcp://host:port of its PUB socket
	ReplayEndpoint string // tcp://host:port of its replay ROUTER ("" = none)
	Topic          string // subscription prefix ("" = every topic)
}

// Counters are the subscriber's running totals, by what happened.
type Counters struct {
	Batches, Stored, Removed, Cleared atomic.Uint64 // events applied, by type
	Malformed, Unknown                atomic.Uint64 // batches dropped; events of unknown type
	Gaps, Replayed, ReplayFailed      atomic.Uint64 // sequence gaps; batches recovered; repairs failed
	Duplicates                        atomic.Uint64 // live batches already applied by a replay
	Restarts, Resets, Reconnects      atomic.Uint64 // publisher restarts; entries dropped for lack of a replay; re-dials
}

// Options configures a Subscriber.
type Options struct {
	Index         *Index
	Logger        *slog.Logger
	MaxFrame      int           // bytes of one ZMTP frame at most (64 MiB)
	ReplayTimeout time.Duration // bound of one replay exchange (2 s)
	Redial        time.Duration // between connection attempts (500 ms)
}

// Subscriber keeps one SUB connection per Source and feeds the Index. Set
// reconciles the sources; Close stops every connection.
type Subscriber struct {
	o   Options
	C   Counters
	ctx context.Context

	mu     sync.Mutex
	stop   context.CancelFunc
	subs   map[Source]*subscription
	closed bool
	wg     sync.WaitGroup
}

// NewSubscriber returns a subscriber with no sources.
func NewSubscriber(o Options) (*Subscriber, error) {
	if o.Index == nil {
		return nil, errors.New("kvevents: subscriber needs an index")
	}
	if err := registerBounded(); err != nil && !strings.Contains(err.Error(), "already registered") {
		return nil, fmt.Errorf("kvevents: register transport: %w", err)
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.MaxFrame <= 0 {
		o.MaxFrame = 64 << 20
	}
	if o.ReplayTimeout <= 0 {
		o.ReplayTimeout = 2 * time.Second
	}
	if o.Redial <= 0 {
		o.Redial = 500 * time.Millisecond
	}
	ctx, stop := context.WithCancel(context.WithValue(context.Background(), maxFrameKey{}, o.MaxFrame))
	return &Subscriber{o: o, ctx: ctx, stop: stop, subs: map[Source]*subscription{}}, nil
}

// Set makes the subscriber follow exactly these sources: new ones are
// dialled, gone ones are closed and their worker's entries dropped from
// the index.
func (s *Subscriber) Set(sources []Source) {
	want := make(map[Source]bool, len(sources))
	for _, src := range sources {
		want[src] = true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return
	}
	for src, sub := range s.subs {
		if !want[src] {
			// Wait for the connection to end before dropping the worker's
			// entries, so no batch of it is applied after the removal.
			sub.cancel()
			<-sub.done
			delete(s.subs, src)
			s.o.Index.RemoveWorker(src.Worker)
		}
	}
	for src := range want {
		if s.subs[src] != nil {
			continue
		}
		ctx, cancel := context.WithCancel(s.ctx)
		sub := &subscription{s: s, src: src, cancel: cancel, last: -1, done: make(chan struct{})}
		s.subs[src] = sub
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer close(sub.done)
			sub.run(ctx)
		}()
	}
}

// Sources lists the sources followed now.
func (s *Subscriber) Sources() []Source {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Source, 0, len(s.subs))
	for src := range s.subs {
		out = append(out, src)
	}
	return out
}

// Seen reports whether a batch of worker's events was applied.
func (s *Subscriber) Seen(worker string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for src, sub := range s.subs {
		if src.Worker == worker && sub.seen.Load() {
			return true
		}
	}
	return false
}

// Close stops every subscription and waits for them.
func (s *Subscriber) Close() {
	s.mu.Lock()
	s.closed = true
	s.stop()
	s.mu.Unlock()
	s.wg.Wait()
}

type subscription struct {
	s      *Subscriber
	src    Source
	cancel context.CancelFunc
	done   chan struct{} // closed when run returns

	seen atomic.Bool // a batch was applied

	// Owned by the run goroutine.
	last    int64  // sequence number of the last batch applied (-1: none)
	lastSum uint64 // hash of that batch's payload: tells a restart at reconnect
	fresh   bool   // the next live batch starts a new sequence (no replay to tell)
	bad     uint64 // batches of this worker that did not decode
}

// run dials, reads until the connection fails, and dials again, until ctx
// ends.
func (c *subscription) run(ctx context.Context) {
	log := c.s.o.Logger.With("component", "kvevents", "worker", c.src.Worker, "endpoint", c.src.Endpoint)
	for first := true; ctx.Err() == nil; first = false {
		if !first {
			c.s.C.Reconnects.Add(1)
			t := time.NewTimer(c.s.o.Redial)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
		}
		err := c.session(ctx)
		if ctx.Err() == nil {
			log.Debug("kv event subscription ended, dialling again", "err", err)
		}
	}
}

// session is one connection's life: dial, handshake, resync, then every
// message read and applied on this goroutine.
func (c *subscription) session(ctx context.Context) error {
	z, err := dialSub(ctx, c.src.Endpoint, c.src.Topic, c.s.o.MaxFrame, handshakeTimeout)
	if err != nil {
		return err
	}
	defer func() { _ = z.Close() }()
	stop := context.AfterFunc(ctx, func() { _ = z.Close() })
	defer stop()
	c.resync(ctx)
	for {
		frames, err := z.next()
		if err != nil {
			return err
		}
		if len(frames) > 0 && !bytes.HasPrefix(frames[0], []byte(c.src.Topic)) {
			continue // the publisher sent a topic not subscribed to
		}
		c.handle(ctx, frames)
	}
}

// handshakeTimeout bounds a subscription's connect and ZMTP handshake.
const handshakeTimeout = 10 * time.Second

// boundedEndpoint routes a tcp:// endpoint through the frame-limiting
// transport.
func boundedEndpoint(ep string) string {
	if rest, ok := strings.CutPrefix(ep, "tcp://"); ok {
		return boundedTransport + "://" + rest
	}
	return ep
}

// The sequence protocol. Within one connection, batches arrive in order;
// a batch after a gap is preceded by the missing ones from the replay
// endpoint, and a batch already applied (by the replay that follows every
// connect) is skipped. Across connections the publisher may have
// restarted, which only a reconnect can reveal (its TCP connection closed):
// resync asks the replay endpoint for the last batch applied, and a
// different answer means a new publisher whose cache started empty.

// resync runs after every connect, before the first live batch.
func (c *subscription) resync(ctx context.Context) {
	if c.src.ReplayEndpoint == "" {
		if c.last >= 0 { // what happened while disconnected is unknown
			c.s.C.Resets.Add(1)
			c.s.o.Index.Clear(c.src.Worker)
		}
		c.fresh = true
		return
	}
	from := max(c.last, 0)
	got, err := c.fetch(ctx, from)
	if err != nil {
		c.s.C.ReplayFailed.Add(1)
		if c.last >= 0 {
			c.s.C.Resets.Add(1)
			c.s.o.Index.Clear(c.src.Worker)
		}
		c.fresh = true
		return
	}
	if c.last >= 0 {
		if len(got) == 0 || got[0].seq != c.last || xxhash.Sum64(got[0].payload) != c.lastSum {
			c.s.C.Restarts.Add(1)
			c.s.o.Index.Clear(c.src.Worker)
			c.last = -1
			if got, err = c.fetch(ctx, 0); err != nil {
				c.s.C.ReplayFailed.Add(1)
				c.fresh = true
				return
			}
		}
	}
	c.applyReplayed(got, -1)
}

// handle applies one published message (topic, seq, payload).
func (c *subscription) handle(ctx context.Context, frames [][]byte) {
	seq, payload, ok := splitMessage(frames)
	if !ok {
		c.s.C.Malformed.Add(1)
		return
	}
	switch {
	case c.fresh:
		c.fresh = false
	case seq <= c.last:
		c.s.C.Duplicates.Add(1)
		return
	case seq > c.last+1:
		// Missed batches (a high-water-mark drop): fetch them first.
		c.s.C.Gaps.Add(1)
		got, err := c.fetch(ctx, c.last+1)
		if err != nil {
			c.s.C.ReplayFailed.Add(1)
			c.reset()
		} else {
			c.applyReplayed(got, seq)
		}
	}
	c.applyAt(seq, payload)
}

// reset drops the worker's entries after events were lost for good: a
// missed removal would leave a block that is gone. The events that follow
// rebuild them.
func (c *subscription) reset() {
	c.s.C.Resets.Add(1)
	c.s.o.Index.Clear(c.src.Worker)
}

// applyReplayed applies the fetched batches after c.last and before
// `before` (-1: all), in order; a hole in them resets the worker first.
// They reach the index as one step: a replay after a connect can replay a
// long history (blocks stored, evicted, cleared), and a pick made while
// it was half applied would see blocks the worker dropped long ago. What
// an AllBlocksCleared of the replay voids is not applied at all: a history
// longer than the publisher's buffer starts with blocks whose parents it
// no longer holds, which would count as orphans, and applying them would
// only lengthen the step.
func (c *subscription) applyReplayed(got []replayed, before int64) {
	var evs []Event
	applied := false
	for _, b := range got {
		if b.seq <= c.last {
			continue
		}
		if before >= 0 && b.seq >= before {
			break
		}
		if c.last >= 0 && b.seq != c.last+1 {
			// The publisher's buffer no longer has them: what the index
			// holds of the worker, and what came before, is void.
			c.s.C.Resets.Add(1)
			evs = append(evs[:0], AllBlocksCleared{})
		}
		c.s.C.Replayed.Add(1)
		more, ok := c.decode(b.payload)
		if i := lastClear(more); i >= 0 {
			evs, more = evs[:0], more[i:]
		}
		evs = append(evs, more...)
		applied = applied || ok
		c.last, c.lastSum = b.seq, xxhash.Sum64(b.payload)
	}
	if len(evs) > 0 {
		c.s.o.Index.Apply(c.src.Worker, evs)
	}
	if applied {
		c.seen.Store(true)
	}
}

// lastClear is the index of the last AllBlocksCleared in evs (-1: none).
func lastClear(evs []Event) int {
	for i := len(evs) - 1; i >= 0; i-- {
		if _, ok := evs[i].(AllBlocksCleared); ok {
			return i
		}
	}
	return -1
}

func (c *subscription) applyAt(seq int64, payload []byte) {
	evs, ok := c.decode(payload)
	if len(evs) > 0 {
		c.s.o.Index.Apply(c.src.Worker, evs)
	}
	c.last, c.lastSum = seq, xxhash.Sum64(payload)
	if ok {
		c.seen.Store(true)
	}
}

func splitMessage(frames [][]byte) (seq int64, payload []byte, ok bool) {
	if len(frames) != 3 || len(frames[1]) != 8 {
		return 0, nil, false
	}
	seq = int64(binary.BigEndian.Uint64(frames[1]))
	return seq, frames[2], seq >= 0
}

// decode returns a batch's events, counted, and false for a malformed
// batch.
func (c *subscription) decode(payload []byte) ([]Event, bool) {
	b, skipped, err := DecodeBatch(payload)
	c.s.C.Unknown.Add(uint64(skipped))
	if err != nil {
		c.s.C.Malformed.Add(1)
		// An engine whose batches do not decode is one the index falls out
		// of step with: said at warn level, the first time and every
		// 1,000th after (a format the router does not know repeats).
		c.bad++
		level := slog.LevelDebug
		if c.bad%1000 == 1 {
			level = slog.LevelWarn
		}
		c.s.o.Logger.Log(context.Background(), level, "kv event batch dropped: it does not decode",
			"worker", c.src.Worker, "endpoint", c.src.Endpoint, "dropped", c.bad, "err", err)
		return nil, false
	}
	c.s.C.Batches.Add(1)
	for _, e := range b.Events {
		switch e.(type) {
		case BlockStored:
			c.s.C.Stored.Add(1)
		case BlockRemoved:
			c.s.C.Removed.Add(1)
		case AllBlocksCleared:
			c.s.C.Cleared.Add(1)
		}
	}
	return b.Events, true
}

type replayed struct {
	seq     int64
	payload []byte
}

// maxReplayed bounds one replay answer (vLLM buffers 10,000 steps by
// default).
const maxReplayed = 100_000

// fetch asks the publisher's replay ROUTER for its buffered batches from
// `from` on (vLLM's protocol: an 8-byte big-endian start; answers (topic,
// seq, payload), ended by seq -1).
func (c *subscription) fetch(ctx context.Context, from int64) ([]replayed, error) {
	if c.src.ReplayEndpoint == "" {
		return nil, errors.New("no replay endpoint")
	}
	rctx, cancel := context.WithTimeout(ctx, c.s.o.ReplayTimeout)
	defer cancel()
	d := zmq4.NewDealer(rctx, zmq4.WithDialerMaxRetries(1), zmq4.WithTimeout(c.s.o.ReplayTimeout),
		zmq4.WithLogger(slog.NewLogLogger(c.s.o.Logger.Handler(), slog.LevelDebug)))
	defer func() { _ = d.Close() }()
	if err := d.Dial(boundedEndpoint(c.src.ReplayEndpoint)); err != nil {
		return nil, fmt.Errorf("dial replay: %w", err)
	}
	var start [8]byte
	binary.BigEndian.PutUint64(start[:], uint64(from))
	if err := d.Send(zmq4.NewMsgFrom([]byte{}, start[:])); err != nil {
		return nil, fmt.Errorf("send replay request: %w", err)
	}
	var out []replayed
	for len(out) < maxReplayed {
		msg, err := d.Recv()
		if err != nil {
			return nil, fmt.Errorf("replay: %w", err)
		}
		frames := msg.Frames
		if len(frames) > 0 && len(frames[0]) == 0 {
			frames = frames[1:] // the REQ envelope's empty delimiter
		}
		if len(frames) == 3 && len(frames[1]) == 8 && int64(binary.BigEndian.Uint64(frames[1])) == -1 {
			return out, nil
		}
		seq, payload, ok := splitMessage(frames)
		if !ok {
			return nil, errors.New("replay: malformed answer")
		}
		out = append(out, replayed{seq, payload})
	}
	return nil, fmt.Errorf("replay: more than %d batches", maxReplayed)
}
