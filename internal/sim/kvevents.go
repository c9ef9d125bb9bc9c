package sim

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/switchyard-llm/switchyard/internal/sim/engine"
)

// The KV event publisher of one DP engine, vLLM's ZmqEventPublisher
// (vllm/distributed/kv_events.py): a PUB socket sends every step's
// KVEventBatch as (topic, 8-byte big-endian sequence number, msgpack
// payload), and an optional ROUTER answers replay requests: a client sends
// (empty, 8-byte big-endian start) and gets every buffered batch with
// seq >= start as (empty, topic, seq, payload), then (empty, "", seq -1,
// ""). The last buffer_steps batches are kept for replay.

// kvPublisher publishes one engine's events.
type kvPublisher struct {
	rank      int
	topic     []byte
	named     bool
	intHashes bool
	blockSize int
	maxQueue  int
	bufSteps  int
	log       *slog.Logger

	pub    zmq4.Socket
	replay zmq4.Socket // nil without replay_endpoint

	endpoint, replayEndpoint string // as bound (or dialled)

	mu      sync.Mutex
	nextSeq int64
	queue   []queuedBatch
	buf     []sentBatch // the last bufSteps batches, oldest first
	notify  chan struct{}

	published, dropped, replays, sendErrors atomic.Uint64
}

type sentBatch struct {
	seq     int64
	payload []byte
}

type queuedBatch struct {
	seq int64
	b   engine.KVEventBatch
}

// KVEventsStats is one publisher's part of /sim/stats.
type KVEventsStats struct {
	Endpoint       string `json:"endpoint"`
	ReplayEndpoint string `json:"replay_endpoint,omitempty"`
	Published      uint64 `json:"batches_published"`
	Dropped        uint64 `json:"batches_dropped"`
	Replays        uint64 `json:"replay_requests"`
	SendErrors     uint64 `json:"send_errors"`
}

// startKVEvents binds every DP engine's publisher and attaches it to the
// engine. Called before the engines run.
func (in *Instance) startKVEvents() error {
	ev := in.cfg.Cache.Events
	if ev == nil {
		return nil
	}
	if !in.cfg.Engine.PrefixCaching {
		in.log.Warn("KV cache events are on but prefix caching is off: no block is ever stored (vLLM warns the same)")
	}
	for rank, e := range in.engines {
		p, err := in.newKVPublisher(rank, ev)
		if err != nil {
			return err
		}
		in.kvPubs = append(in.kvPubs, p)
		e.SetKVEventSink(p.enqueue)
		in.goBackground(p.publishLoop)
		if p.replay != nil {
			in.goBackground(p.replayLoop)
		}
	}
	return nil
}

// closeKVEvents closes the sockets, ending the publishers' goroutines.
func (in *Instance) closeKVEvents() {
	for _, p := range in.kvPubs {
		_ = p.pub.Close()
		if p.replay != nil {
			_ = p.replay.Close()
		}
	}
}

// KVEventEndpoints returns, per DP rank, the bound PUB and replay
// endpoints ("" without replay), with the --advertise-host address for a
// wildcard host.
func (in *Instance) KVEventEndpoints() (pub, replay []string) {
	for _, p := range in.kvPubs {
		pub = append(pub, p.endpoint)
		replay = append(replay, p.replayEndpoint)
	}
	return pub, replay
}

func (in *Instance) newKVPublisher(rank int, ev *KVEventsConfig) (*kvPublisher, error) {
	p := &kvPublisher{
		rank: rank, topic: []byte(ev.Topic), named: in.cfg.Cache.Encoding == EncodingNamed,
		intHashes: in.cfg.Cache.IntBlockHashes, blockSize: in.cfg.Engine.BlockSize,
		maxQueue: ev.MaxQueueSize, bufSteps: ev.BufferSteps, notify: make(chan struct{}, 1),
		log: in.log.With("component", "kv-events", "dp_rank", rank),
	}
	ep := OffsetEndpointPort(ev.Endpoint, rank)
	opts := []zmq4.Option{zmq4.WithLogger(quietZMQLogger)}
	if !isBindEndpoint(ep) {
		// Only a dialling socket may reconnect: go-zeromq would make a
		// bound one dial its own endpoint when a subscriber leaves.
		opts = append(opts, zmq4.WithDialerMaxRetries(-1), zmq4.WithDialerRetry(500*time.Millisecond),
			zmq4.WithAutomaticReconnect(true))
	}
	p.pub = zmq4.NewPub(in.ctx, opts...)
	if err := p.pub.SetOption(zmq4.OptionHWM, ev.HWM); err != nil {
		_ = p.pub.Close()
		return nil, fmt.Errorf("kv events: PUB hwm: %w", err)
	}
	var err error
	if err = registerCoalescing(); err != nil {
		_ = p.pub.Close()
		return nil, fmt.Errorf("kv events: %w", err)
	}
	if isBindEndpoint(ep) {
		p.endpoint, err = in.listenZMQ(p.pub, ep, coalescingTransport)
	} else {
		// vLLM connects the PUB to an endpoint without a wildcard; like
		// libzmq, the connection is made (and remade) in the background
		// and batches sent meanwhile are lost.
		p.endpoint = ep
		in.goBackground(func(ctx context.Context) {
			if err := p.pub.Dial(coalescingEndpoint(ep)); err != nil && ctx.Err() == nil {
				p.log.Warn("kv events: cannot connect the PUB socket", "endpoint", ep, "err", err)
			}
		})
	}
	if err != nil {
		_ = p.pub.Close()
		return nil, fmt.Errorf("kv events: endpoint %s (dp rank %d): %w", ep, rank, err)
	}
	if ev.ReplayEndpoint != nil {
		rep := OffsetEndpointPort(*ev.ReplayEndpoint, rank)
		p.replay = zmq4.NewRouter(in.ctx, zmq4.WithLogger(quietZMQLogger))
		if p.replayEndpoint, err = in.listenZMQ(p.replay, rep, "tcp"); err != nil {
			_ = p.pub.Close()
			_ = p.replay.Close()
			return nil, fmt.Errorf("kv events: replay_endpoint %s (dp rank %d): %w", rep, rank, err)
		}
	}
	return p, nil
}

// isBindEndpoint is vLLM's _is_bind_endpoint for tcp: a wildcard host.
func isBindEndpoint(ep string) bool { return strings.Contains(ep, "*") || strings.Contains(ep, "::") }

// listenZMQ binds sock on ep; a "*" host binds the --host address. It
// returns the endpoint a subscriber dials. network is the go-zeromq
// transport that binds it (tcp, or coalescingTransport).
func (in *Instance) listenZMQ(sock zmq4.Socket, ep, network string) (string, error) {
	rest := strings.TrimPrefix(ep, "tcp://")
	i := strings.LastIndexByte(rest, ':')
	host, port := rest[:i], rest[i+1:]
	adv := host
	if host == "*" {
		host, adv = in.cfg.Host, in.cfg.AdvertiseHost
	}
	host = strings.Trim(host, "[]")
	if err := sock.Listen(network + "://" + net.JoinHostPort(host, port)); err != nil {
		return "", err
	}
	if a, ok := sock.Addr().(*net.TCPAddr); ok {
		port = strconv.Itoa(a.Port)
	}
	return "tcp://" + net.JoinHostPort(strings.Trim(adv, "[]"), port), nil
}

// enqueue is the engine's event sink: it never blocks the engine. Past
// max_queue_size pending batches the oldest are dropped and counted (vLLM
// blocks its scheduler instead). Sequence numbers are taken here, so a
// dropped batch is a gap a subscriber sees.
func (p *kvPublisher) enqueue(b engine.KVEventBatch) {
	p.mu.Lock()
	if len(p.queue) >= p.maxQueue {
		p.queue = p.queue[1:]
		p.dropped.Add(1)
	}
	p.queue = append(p.queue, queuedBatch{seq: p.nextSeq, b: b})
	p.nextSeq++
	p.mu.Unlock()
	select {
	case p.notify <- struct{}{}:
	default:
	}
}

// publishLoop encodes and sends queued batches in order until ctx ends.
func (p *kvPublisher) publishLoop(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-p.notify:
		}
		p.mu.Lock()
		q := p.queue
		p.queue = nil
		p.mu.Unlock()
		for _, qb := range q {
			seq, payload := qb.seq, p.encode(qb.b)
			var sb [8]byte
			binary.BigEndian.PutUint64(sb[:], uint64(seq))
			p.mu.Lock()
			p.buf = append(p.buf, sentBatch{seq: seq, payload: payload})
			if len(p.buf) > p.bufSteps {
				p.buf = p.buf[len(p.buf)-p.bufSteps:]
			}
			p.mu.Unlock()
			if err := p.pub.SendMulti(zmq4.NewMsgFrom(p.topic, sb[:], payload)); err != nil {
				if ctx.Err() != nil {
					return
				}
				p.sendErrors.Add(1)
				p.log.Debug("kv event batch not sent", "seq", seq, "err", err)
			}
			p.published.Add(1)
		}
	}
}

var endSeq = []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// replayLoop answers replay requests (vLLM's _service_replay) until the
// socket is closed.
func (p *kvPublisher) replayLoop(ctx context.Context) {
	for {
		msg, err := p.replay.Recv()
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		f := msg.Frames
		if len(f) != 3 {
			p.log.Warn("invalid replay request", "frames", len(f))
			continue
		}
		p.replays.Add(1)
		client := f[0]
		start := int64(binary.BigEndian.Uint64(padSeq(f[2])))
		p.mu.Lock()
		snap := append([]sentBatch(nil), p.buf...)
		p.mu.Unlock()
		for _, b := range snap {
			if b.seq < start {
				continue
			}
			var sb [8]byte
			binary.BigEndian.PutUint64(sb[:], uint64(b.seq))
			if err := p.replay.SendMulti(zmq4.NewMsgFrom(client, nil, p.topic, sb[:], b.payload)); err != nil {
				break
			}
		}
		_ = p.replay.SendMulti(zmq4.NewMsgFrom(client, nil, nil, endSeq, nil))
	}
}

// padSeq left-pads a start sequence to 8 bytes (int.from_bytes accepts any
// length); a longer one keeps its last 8 bytes.
func padSeq(b []byte) []byte {
	if len(b) >= 8 {
		return b[len(b)-8:]
	}
	out := make([]byte, 8)
	copy(out[8-len(b):], b)
	return out
}

func (p *kvPublisher) stats() *KVEventsStats {
	return &KVEventsStats{Endpoint: p.endpoint, ReplayEndpoint: p.replayEndpoint, Published: p.published.Load(),
		Dropped: p.dropped.Load(), Replays: p.replays.Load(), SendErrors: p.sendErrors.Load()}
}

// encode renders a KVEventBatch as msgspec does: the batch is always the
// positional array [ts, events, data_parallel_rank]; each event is a map
// with "type" (named, KVCacheEvent tag=True) or the array [tag, fields...]
// (positional, the older array_like=True events).
func (p *kvPublisher) encode(b engine.KVEventBatch) []byte {
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	_ = enc.EncodeArrayLen(3)
	_ = enc.EncodeFloat64(float64(b.TS.UnixNano()) / 1e9)
	_ = enc.EncodeArrayLen(len(b.Events))
	for _, ev := range b.Events {
		p.encodeEvent(enc, ev)
	}
	_ = enc.EncodeInt(int64(p.rank))
	return buf.Bytes()
}

func (p *kvPublisher) encodeEvent(enc *msgpack.Encoder, ev engine.KVEvent) {
	type field struct {
		name string
		put  func()
	}
	var tag string
	var fields []field
	hashes := func() { p.encodeHashes(enc, ev.Hashes) }
	medium := func() { _ = enc.EncodeString("GPU") }
	switch ev.Kind {
	case engine.BlockStored:
		tag = "BlockStored"
		fields = []field{
			{"block_hashes", hashes},
			{"parent_block_hash", func() {
				if ev.Parent == nil {
					_ = enc.EncodeNil()
				} else {
					p.encodeHash(enc, *ev.Parent)
				}
			}},
			{"token_ids", func() {
				_ = enc.EncodeArrayLen(len(ev.Tokens))
				for _, t := range ev.Tokens {
					_ = enc.EncodeUint(uint64(t))
				}
			}},
			{"block_size", func() { _ = enc.EncodeInt(int64(p.blockSize)) }},
			{"lora_id", func() {
				if ev.LoRA == "" {
					_ = enc.EncodeNil()
				} else {
					_ = enc.EncodeInt(int64(ev.LoRAID))
				}
			}},
			{"medium", medium},
			{"lora_name", func() {
				if ev.LoRA == "" {
					_ = enc.EncodeNil()
				} else {
					_ = enc.EncodeString(ev.LoRA)
				}
			}},
		}
		// vLLM 0.32 publishes these on every stored block: extra_keys of
		// one entry per block (to_event_extra_keys of a list of Nones is
		// that list), group_idx 0 and kv_cache_spec_kind "full_attention"
		// for a model with one KV cache group of full attention.
		fields = append(fields, field{"extra_keys", func() { encodeExtraKeys(enc, ev) }},
			field{"group_idx", func() { _ = enc.EncodeInt(0) }},
			field{"kv_cache_spec_kind", func() { _ = enc.EncodeString("full_attention") }})
	case engine.BlockRemoved:
		tag = "BlockRemoved"
		// vLLM 0.32 names the group of every removal (group_idx 0 here).
		fields = []field{{"block_hashes", hashes}, {"medium", medium}, {"group_idx", func() { _ = enc.EncodeInt(0) }}}
	default:
		tag = "AllBlocksCleared"
	}
	if !p.named {
		_ = enc.EncodeArrayLen(1 + len(fields))
		_ = enc.EncodeString(tag)
		for _, f := range fields {
			f.put()
		}
		return
	}
	_ = enc.EncodeMapLen(1 + len(fields))
	_ = enc.EncodeString("type")
	_ = enc.EncodeString(tag)
	for _, f := range fields {
		_ = enc.EncodeString(f.name)
		f.put()
	}
}

// encodeExtraKeys writes a BlockStored's extra_keys as vLLM's
// to_event_extra_keys does: one entry per block, null for a block without
// extra keys, else the tuple of its untagged keys in vLLM's order (the
// LoRA adapter's name on every block of its requests, then the salt on a
// salted sequence's first block: (lora, salt), (lora,) or (salt,)).
func encodeExtraKeys(enc *msgpack.Encoder, ev engine.KVEvent) {
	_ = enc.EncodeArrayLen(len(ev.Hashes))
	for i := range ev.Hashes {
		salt := i == 0 && ev.Salt != ""
		n := 0
		if ev.LoRA != "" {
			n++
		}
		if salt {
			n++
		}
		if n == 0 {
			_ = enc.EncodeNil()
			continue
		}
		_ = enc.EncodeArrayLen(n)
		if ev.LoRA != "" {
			_ = enc.EncodeString(ev.LoRA)
		}
		if salt {
			_ = enc.EncodeString(ev.Salt)
		}
	}
}

func (p *kvPublisher) encodeHashes(enc *msgpack.Encoder, hs []engine.BlockHash) {
	_ = enc.EncodeArrayLen(len(hs))
	for _, h := range hs {
		p.encodeHash(enc, h)
	}
}

// encodeHash writes a block hash as vLLM's maybe_convert_block_hash does:
// the sha256 bytes, or with int hashes the low 64 bits of their big-endian
// value.
func (p *kvPublisher) encodeHash(enc *msgpack.Encoder, h engine.BlockHash) {
	if p.intHashes {
		_ = enc.EncodeUint(binary.BigEndian.Uint64(h[24:]))
		return
	}
	_ = enc.EncodeBytes(h[:])
}

// kvEventStats is DP rank's publisher counters (nil without events).
func (in *Instance) kvEventStats(rank int) *KVEventsStats {
	if rank >= len(in.kvPubs) {
		return nil
	}
	return in.kvPubs[rank].stats()
}
