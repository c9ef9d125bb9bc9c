package pd

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/rawjson"
	"github.com/switchyard-llm/switchyard/internal/tracing"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// The first request between a prefill and a decode engine pays their
// one-off KV handshake: with MoRI-IO WRITE, P's forward pass busy-waits up
// to 30 s for it and so stalls every request batched with it (PROTOCOL.md
// §2.9); NIXL and MoRI-IO READ handshake on the decode's first pull. A
// warmer sends one tiny PD request (a 1-token completion, both legs, the
// connector's real kv_transfer_params) through every new instance pair as
// soon as both sides have passed a health probe and are healthy and
// routable (a warm-up sent to an engine still starting would only fail), so that real traffic finds
// the pair warm. While a pair's warm-up runs, the pickers prefer other
// pairs; when there is none, the cold pair serves anyway (never worse than
// without warm-up). A pair that carried a real request is warm already.
//
// Pairs are instance pairs (URLs, not DP ranks): the first contact makes
// the engines handshake with every rank of the peer. An instance that
// leaves the registry is forgotten, so a restarted one is warmed again.

// warmupPrompt is the warm-up request's prompt.
const warmupPrompt = "warm-up"

// warmupParallel bounds concurrent warm-ups.
const warmupParallel = 4

// warmupScan is how often the registry is rescanned for pairs that became
// warmable without a registry event (a worker turning healthy).
const warmupScan = time.Second

type warmer struct {
	e       *Engine
	timeout time.Duration
	ctx     context.Context
	cancel  context.CancelFunc
	kick    chan struct{}
	sem     chan struct{}

	warm sync.Map // [2]string{P URL, D URL} → struct{}: warmed or used

	mu      sync.Mutex
	running map[[2]string]bool // warm-up in flight: the pair is cold
	nCold   atomic.Int64       // len(running), for the lock-free fast path

	// counters (for tests and the log)
	ok, failed atomic.Int64
}

func newWarmer(e *Engine) *warmer {
	ctx, cancel := context.WithCancel(context.Background())
	t := 60 * time.Second // MoRI-IO's handshake wait is 30 s
	if e.o.RequestTimeout > 0 && e.o.RequestTimeout < t {
		t = e.o.RequestTimeout
	}
	return &warmer{e: e, timeout: t, ctx: ctx, cancel: cancel, kick: make(chan struct{}, 1),
		sem: make(chan struct{}, warmupParallel), running: map[[2]string]bool{}}
}

// start runs the scan loop; the engine's bg group owns it and every
// warm-up it starts.
func (w *warmer) start() {
	w.e.bg.Add(1)
	go func() {
		defer w.e.bg.Done()
		t := time.NewTicker(warmupScan)
		defer t.Stop()
		for {
			w.scan()
			select {
			case <-w.ctx.Done():
				return
			case <-w.kick:
			case <-t.C:
			}
		}
	}()
}

func (w *warmer) stop() { w.cancel() }

// changed is the registry subscription: arrivals trigger a scan, and an
// instance that left is forgotten.
func (w *warmer) changed(c worker.Change) {
	for _, r := range c.Removed {
		w.warm.Range(func(k, _ any) bool {
			if key := k.([2]string); key[0] == r.URL || key[1] == r.URL {
				w.warm.Delete(k)
			}
			return true
		})
	}
	if len(c.Added) > 0 {
		select {
		case w.kick <- struct{}{}:
		default:
		}
	}
}

// used records that a real request's KV went through p/d.
func (w *warmer) used(p, d *worker.Worker) {
	key := [2]string{p.URL, d.URL}
	if _, ok := w.warm.Load(key); !ok {
		w.warm.Store(key, struct{}{})
	}
}

// cold reports whether a warm-up of p/d is in flight.
func (w *warmer) cold(p, d *worker.Worker) bool {
	if w == nil || w.nCold.Load() == 0 {
		return false
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.running[[2]string{p.URL, d.URL}]
}

// scan starts a warm-up for every live, compatible instance pair that is
// neither warm nor warming.
func (w *warmer) scan() {
	snap := w.e.o.Registry.Snapshot()
	live := func(x *worker.Worker) bool {
		return x.Probed() && x.Healthy() && x.Routable() && x.Available() && w.e.conn.Eligible(x) == nil
	}
	seenP := map[string]bool{}
	for _, p := range snap.Prefill {
		if seenP[p.URL] || !live(p) {
			continue
		}
		seenP[p.URL] = true
		seenD := map[string]bool{}
		for _, d := range snap.Decode {
			if seenD[d.URL] || !live(d) || !w.e.conn.Compatible(p, d) {
				continue
			}
			seenD[d.URL] = true
			key := [2]string{p.URL, d.URL}
			if _, ok := w.warm.Load(key); ok {
				continue
			}
			w.mu.Lock()
			busy := w.running[key]
			if !busy {
				w.running[key] = true
				w.nCold.Add(1)
			}
			w.mu.Unlock()
			if busy {
				continue
			}
			w.e.bg.Add(1)
			go func() {
				defer w.e.bg.Done()
				w.run(key, p, d)
			}()
		}
	}
}

func (w *warmer) run(key [2]string, p, d *worker.Worker) {
	defer func() {
		w.mu.Lock()
		delete(w.running, key)
		w.nCold.Add(-1)
		w.mu.Unlock()
	}()
	select {
	case w.sem <- struct{}{}:
	case <-w.ctx.Done():
		return
	}
	defer func() { <-w.sem }()
	start := time.Now()
	err := w.e.warmPair(w.ctx, w.timeout, p, d)
	switch {
	case err == nil:
		w.ok.Add(1)
		if w.e.m != nil {
			w.e.m.PDWarmups.WithLabelValues("ok").Inc()
		}
		w.warm.Store(key, struct{}{})
		w.e.log.Info("pd pair warmed up", "prefill", p.URL, "decode", d.URL,
			"took", time.Since(start).Round(time.Millisecond).String())
	case w.ctx.Err() != nil:
	default:
		// Not retried: the failure counts on the pair and the workers'
		// breakers like any request's (a connect failure is no health
		// verdict: both sides passed a probe, the prober decides), and real
		// traffic (or a re-registration) warms it.
		w.failed.Add(1)
		if w.e.m != nil {
			w.e.m.PDWarmups.WithLabelValues("failed").Inc()
		}
		w.warm.Store(key, struct{}{})
		w.e.log.Warn("pd pair warm-up failed", "prefill", p.URL, "decode", d.URL, "err", err)
	}
}

// warmPair sends one 1-token completion through p and d.
func (e *Engine) warmPair(parent context.Context, timeout time.Duration, p, d *worker.Worker) error {
	ctx, cancel := context.WithTimeout(parent, timeout)
	defer cancel()
	ctx, span := e.tr.StartInternal(ctx, "pd warm-up",
		attribute.String("switchyard.prefill", p.URL), attribute.String("switchyard.decode", d.URL))
	defer tracing.End(span)
	err := e.warmPairIn(ctx, p, d)
	if err != nil {
		tracing.Fail(span, "warmup_failed", err)
	}
	return err
}

func (e *Engine) warmPairIn(ctx context.Context, p, d *worker.Worker) error {
	body := `{"prompt":"` + warmupPrompt + `","max_tokens":1,"temperature":0}`
	model := p.ModelID
	if model == "" {
		model = e.servedModel(ctx, p) // vLLM before 0.8 requires "model"
	}
	if model != "" { // else vLLM serves its default model
		m, err := json.Marshal(model)
		if err != nil {
			return err
		}
		body = `{"model":` + string(m) + `,` + body[1:]
	}
	obj, err := rawjson.Parse([]byte(body))
	if err != nil {
		return err
	}
	st := &reqState{start: e.o.Now(), hdr: http.Header{}, cli: ctx, rc: &proxy.Receipt{Mode: "pd"},
		path: "/v1/completions", route: "pd_warmup", obj: obj, warmup: true}
	st.kind = classify(st.path)
	st.merge = needsMerge(st.kind, obj, false)
	if e.o.APIKey != "" {
		st.auth = "Bearer " + e.o.APIKey
	}
	pr := e.newPair(choice(p, "warm-up"), choice(d, "warm-up"))
	sink := &discardWriter{h: http.Header{}}
	if f := e.attempt(ctx, &trackingWriter{ResponseWriter: sink}, st, &pr.Pair); f != nil {
		return errors.New(f.leg + " " + f.reason + ": " + f.msg)
	}
	if sink.status != 0 && sink.status != http.StatusOK {
		return errors.New("decode answered HTTP " + strconv.Itoa(sink.status))
	}
	return nil
}

// servedModel asks w's /v1/models for its first model id ("" on failure).
func (e *Engine) servedModel(ctx context.Context, w *worker.Worker) string {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, w.URL+"/v1/models", nil)
	if err != nil {
		return ""
	}
	if e.o.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+e.o.APIKey)
	}
	resp, err := e.o.Client.Do(req)
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	var list struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if resp.StatusCode != http.StatusOK || json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&list) != nil || len(list.Data) == 0 {
		return ""
	}
	return list.Data[0].ID
}

// discardWriter is the warm-up's client: it keeps the status only.
type discardWriter struct {
	h      http.Header
	status int
}

func (d *discardWriter) Header() http.Header { return d.h }
func (d *discardWriter) WriteHeader(code int) {
	if d.status == 0 {
		d.status = code
	}
}
func (d *discardWriter) Write(b []byte) (int, error) {
	if d.status == 0 {
		d.status = http.StatusOK
	}
	return len(b), nil
}

func choice(w *worker.Worker, reason string) policy.Choice {
	return policy.Choice{Worker: w, Reason: reason}
}
