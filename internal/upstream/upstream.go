// Package upstream is the --backend openai dispatcher: every generation
// request goes to one OpenAI-compatible base URL (OpenAI itself or any
// compatible provider) with the router's API key.
//
// Chat and completion bodies are forwarded byte for byte except for the
// top-level vLLM-only fields (VLLMOnlyFields), which a strict OpenAI API
// rejects: they are cut out with a minimal edit (rawjson), every other byte
// kept. Failures before the first byte reaches the client (connect errors,
// timeouts waiting for headers, 408/429/5xx) are retried with backoff up to
// the retry settings, behind the upstream's circuit breaker; once a byte
// was relayed the response is the client's, and a broken stream ends with
// an SSE error event. Upstream errors are relayed with their status and
// body.
package upstream

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/openai"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/rawjson"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// VLLMOnlyFields are removed from chat and completion bodies: the keys
// vllm-router's OpenAI router removes (REFERENCE §8.1) plus the other vLLM
// sampling/extension parameters that OpenAI's API answers 400
// ("Unrecognized request argument") for.
var VLLMOnlyFields = []string{
	// vllm-router's list
	"top_k", "min_p", "min_tokens", "regex", "ebnf", "stop_token_ids", "no_stop_trim", "ignore_eos",
	"continue_final_message", "skip_special_tokens", "lora_path", "session_params", "separate_reasoning",
	"stream_reasoning", "chat_template_kwargs", "return_hidden_states", "repetition_penalty",
	// further vLLM-only parameters
	"use_beam_search", "length_penalty", "include_stop_str_in_output", "spaces_between_special_tokens",
	"truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids", "bad_words", "add_generation_prompt",
	"add_special_tokens", "chat_template", "mm_processor_kwargs", "guided_json", "guided_regex",
	"guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
	"structured_outputs", "priority", "kv_transfer_params", "cache_salt", "return_tokens_as_token_ids",
	"return_token_ids", "documents", "vllm_xargs", "request_id",
}

// strippedRoutes are the routes whose bodies lose VLLMOnlyFields.
var strippedRoutes = map[string]bool{"/v1/chat/completions": true, "/v1/completions": true}

// servedRoutes are the generation routes an OpenAI-compatible API serves.
var servedRoutes = map[string]bool{
	"/v1/chat/completions": true, "/v1/completions": true, "/v1/embeddings": true, "/v1/responses": true,
}

// Options configures a Backend.
type Options struct {
	// Worker is the upstream's registry entry: its URL is the base URL
	// (request paths such as /v1/chat/completions are appended), its
	// breaker guards every call, and its in-flight count is the load.
	Worker *worker.Worker
	// Client's Transport is used directly (redirects are relayed).
	Client *http.Client
	// APIKey is sent as "Authorization: Bearer <key>". When empty and
	// ForwardClientAuth is set, the client's Authorization is forwarded.
	APIKey            string
	ForwardClientAuth bool
	Retry             proxy.RetryConfig
	// RequestTimeout bounds the whole request from Call.Start, retries
	// and the streamed body included (0 = none).
	RequestTimeout time.Duration
	// HeaderTimeout bounds the wait for response headers of one attempt
	// of a streaming request; it is then retried (0 = none).
	HeaderTimeout time.Duration
	// StreamIdleTimeout aborts an SSE response silent for this long.
	StreamIdleTimeout time.Duration
	Metrics           *metrics.Metrics
	Logger            *slog.Logger
	Rand              func() float64 // jitter source; nil → math/rand
}

// Backend implements proxy.Dispatcher for an OpenAI-compatible upstream.
type Backend struct {
	o    Options
	rt   http.RoundTripper
	log  *slog.Logger
	m    *metrics.Metrics
	rand func() float64
}

var _ proxy.Dispatcher = (*Backend)(nil)

// New builds a Backend.
func New(o Options) (*Backend, error) {
	if o.Worker == nil {
		return nil, errors.New("upstream: Worker is required")
	}
	if o.Retry.MaxAttempts < 1 {
		o.Retry.MaxAttempts = 1
	}
	b := &Backend{o: o, log: o.Logger, m: o.Metrics, rand: o.Rand, rt: http.DefaultTransport}
	if o.Client != nil && o.Client.Transport != nil {
		b.rt = o.Client.Transport
	}
	if b.log == nil {
		b.log = slog.New(slog.DiscardHandler)
	}
	if b.rand == nil {
		b.rand = rand.Float64
	}
	return b, nil
}

// BaseURL normalises an upstream base URL: trailing slashes and a final
// "/v1" (the OpenAI SDKs' base_url form) are dropped, since request paths
// carry /v1 themselves.
func BaseURL(u string) string {
	u = strings.TrimRight(u, "/")
	return strings.TrimRight(strings.TrimSuffix(u, "/v1"), "/")
}

// Strip removes VLLMOnlyFields from a parsed body, keeping every other byte.
// It returns the body unchanged (same slice) when none is present, and the
// removed keys.
func Strip(obj *rawjson.Object) ([]byte, []string) {
	var edits []rawjson.Edit
	var removed []string
	for _, k := range VLLMOnlyFields {
		if obj.Has(k) {
			edits = append(edits, rawjson.Delete(k))
			removed = append(removed, k)
		}
	}
	if len(edits) == 0 {
		return obj.Source(), nil
	}
	return obj.Apply(edits...), removed
}

// Dispatch serves one generation request.
func (b *Backend) Dispatch(w http.ResponseWriter, r *http.Request, c *proxy.Call) {
	if !servedRoutes[c.Route] {
		b.writeError(w, c, http.StatusNotImplemented, "not_implemented",
			c.Route+" is a vLLM route: an OpenAI-compatible upstream (--backend openai) does not serve it")
		return
	}
	d := &dispatch{Backend: b, w: w, r: r, c: c, body: b.upstreamBody(c), rec: c.Receipt}
	var cancel context.CancelFunc
	d.ctx, cancel = b.deadline(r.Context(), c)
	defer cancel()
	if d.rec == nil {
		d.rec = &proxy.Receipt{}
	}
	d.rec.Mode, d.rec.Policy, d.rec.Worker, d.rec.Reason = "openai", "single_upstream", b.o.Worker.Key(), "--backend openai"
	d.hdr = b.header(r.Header, c.Stream)
	for attempt := 1; ; attempt++ {
		d.rec.Attempts = attempt
		f, answered := d.try(attempt)
		if answered || !d.retry(f, attempt) {
			return
		}
	}
}

// dispatch is one client request on its way to the upstream: what its
// attempts share.
type dispatch struct {
	*Backend
	w    http.ResponseWriter
	r    *http.Request
	c    *proxy.Call
	ctx  context.Context // r's, bounded by RequestTimeout
	rec  *proxy.Receipt
	hdr  http.Header
	body []byte
}

// failure is an attempt that failed before any byte reached the client: a
// transport error, or a retryable status with its drained answer.
type failure struct {
	err    error
	status int
	header http.Header
	body   []byte
}

// upstreamBody is the body to send: the client's, without VLLMOnlyFields
// on the routes that strip them.
func (b *Backend) upstreamBody(c *proxy.Call) []byte {
	if !strippedRoutes[c.Route] {
		return c.Body
	}
	body, removed := Strip(c.Obj)
	if len(removed) > 0 {
		b.log.Debug("removed vLLM-only fields for the OpenAI upstream", "route", c.Route, "fields", removed)
	}
	return body
}

// deadline bounds ctx by RequestTimeout from the request's start.
func (b *Backend) deadline(ctx context.Context, c *proxy.Call) (context.Context, context.CancelFunc) {
	if b.o.RequestTimeout <= 0 {
		return ctx, func() {}
	}
	start := c.Start
	if start.IsZero() {
		start = time.Now()
	}
	return context.WithDeadline(ctx, start.Add(b.o.RequestTimeout))
}

// try makes one attempt behind the upstream's breaker. It reports true
// when the client has its answer (the upstream's, relayed, or the open
// breaker's refusal), else what failed.
func (d *dispatch) try(attempt int) (failure, bool) {
	wk := d.o.Worker
	done, ok := wk.Breaker().Start()
	if !ok {
		d.writeError(d.w, d.c, http.StatusServiceUnavailable, "circuit_open",
			fmt.Sprintf("OpenAI upstream %s: circuit breaker open after repeated failures", wk.URL))
		return failure{}, true
	}
	release := wk.Acquire()
	defer release()
	resp, actx, acancel, err := d.roundTrip(d.ctx, d.c, d.hdr, d.body, attempt)
	defer acancel()
	if err == nil && !retryable(resp.StatusCode) {
		d.relay(actx, d.w, d.c, resp, done)
		return failure{}, true
	}
	if err != nil {
		if d.ctx.Err() != nil {
			err = d.ctx.Err()
		}
		done(errors.Is(err, context.Canceled)) // a client that left says nothing about the upstream
		return failure{err: err}, false
	}
	f := failure{status: resp.StatusCode, header: resp.Header, body: drain(resp)}
	done(f.status < 500)
	return f, false
}

// retry follows failed attempt number attempt: true after the backoff
// when another attempt may go, else false with the client answered (or
// gone).
func (d *dispatch) retry(f failure, attempt int) bool {
	if errors.Is(f.err, context.Canceled) && d.r.Context().Err() != nil {
		d.count(d.c, "client_canceled")
		return false
	}
	delay, again := d.retryDelay(d.ctx, attempt)
	if f.err != nil && !(proxy.IsDialError(f.err) || errors.Is(f.err, proxy.ErrHeaderTimeout) || isTimeout(f.err)) || d.ctx.Err() != nil {
		again = false
	}
	if !again {
		d.giveUp(f, attempt)
		return false
	}
	wk := d.o.Worker
	d.rec.Failovers = append(d.rec.Failovers, fmt.Sprintf("%s attempt %d: %s", wk.Key(), attempt, failureText(f.err, f.status)))
	if d.m != nil {
		d.m.Retries.WithLabelValues(d.c.Route).Inc()
		d.m.RetryBackoff.WithLabelValues(strconv.Itoa(attempt + 1)).Observe(delay.Seconds())
	}
	return d.backoff(f, delay)
}

// giveUp answers the client with the last failure: a transport error as
// the router's error, an upstream status as the upstream gave it.
func (d *dispatch) giveUp(f failure, attempt int) {
	if f.err == nil {
		d.relayFailure(d.w, d.c, f.status, f.header, f.body)
		return
	}
	st := proxy.StatusFor(f.err)
	if st == proxy.StatusClientClosed {
		st = http.StatusGatewayTimeout
	}
	d.writeError(d.w, d.c, st, "upstream_error",
		fmt.Sprintf("OpenAI upstream %s failed after %d attempt(s): %v", d.o.Worker.URL, attempt, f.err))
}

// backoff waits delay before the next attempt: false when the client left
// or the request's deadline passed first (the client is then answered).
func (d *dispatch) backoff(f failure, delay time.Duration) bool {
	t := time.NewTimer(delay)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-d.ctx.Done():
	}
	if d.r.Context().Err() != nil {
		d.count(d.c, "client_canceled")
		return false
	}
	d.writeError(d.w, d.c, http.StatusGatewayTimeout, "timeout",
		fmt.Sprintf("OpenAI upstream %s: request deadline passed while retrying (%s)", d.o.Worker.URL, failureText(f.err, f.status)))
	return false
}

func failureText(err error, status int) string {
	if err != nil {
		return err.Error()
	}
	return "status " + strconv.Itoa(status)
}

func isTimeout(err error) bool {
	var te interface{ Timeout() bool }
	return errors.As(err, &te) && te.Timeout()
}

// retryable is vllm-router's list of retryable statuses.
func retryable(code int) bool {
	switch code {
	case http.StatusRequestTimeout, http.StatusTooManyRequests, http.StatusInternalServerError,
		http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return true
	}
	return false
}

// retryDelay says whether attempt+1 may follow and after how long.
func (b *Backend) retryDelay(ctx context.Context, attempt int) (time.Duration, bool) {
	rc := b.o.Retry
	if attempt >= rc.MaxAttempts {
		if b.m != nil && rc.MaxAttempts > 1 {
			b.m.RetriesExhausted.WithLabelValues("openai").Inc()
		}
		return 0, false
	}
	d := float64(rc.InitialBackoff) * math.Pow(max(rc.Multiplier, 1), float64(attempt-1))
	if rc.MaxBackoff > 0 && d > float64(rc.MaxBackoff) {
		d = float64(rc.MaxBackoff)
	}
	if rc.Jitter > 0 {
		d += d * rc.Jitter * (2*b.rand() - 1)
	}
	delay := time.Duration(max(d, 0))
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) <= delay {
		return 0, false
	}
	return delay, true
}

// header builds the upstream request headers: JSON content, the key, and
// the client's OpenAI-* headers (organisation, project, beta features).
// Nothing else of the client's is sent to a third party.
func (b *Backend) header(in http.Header, stream bool) http.Header {
	h := http.Header{"Content-Type": {"application/json"}, "Accept": {"application/json"}}
	if stream {
		h["Accept"] = []string{"text/event-stream"}
	}
	for k, v := range in {
		if strings.HasPrefix(k, "Openai-") || k == "Idempotency-Key" {
			h[k] = v
		}
	}
	switch {
	case b.o.APIKey != "":
		h["Authorization"] = []string{"Bearer " + b.o.APIKey}
	case b.o.ForwardClientAuth:
		if v, ok := in["Authorization"]; ok {
			h["Authorization"] = v
		}
	}
	return h
}

func (b *Backend) roundTrip(ctx context.Context, c *proxy.Call, hdr http.Header, body []byte, attempt int) (*http.Response, context.Context, context.CancelFunc, error) {
	actx, cancel := context.WithCancelCause(ctx)
	stop := func() { cancel(context.Canceled) }
	var timer *time.Timer
	if b.o.HeaderTimeout > 0 && c.Stream {
		timer = time.AfterFunc(b.o.HeaderTimeout, func() { cancel(proxy.ErrHeaderTimeout) })
	}
	req, err := http.NewRequestWithContext(actx, http.MethodPost, b.o.Worker.URL+c.Path, bytes.NewReader(body))
	if err != nil {
		return nil, actx, stop, err
	}
	if attempt > 1 {
		hdr = hdr.Clone()
	}
	req.Header = hdr
	resp, err := b.rt.RoundTrip(req)
	if timer != nil && !timer.Stop() {
		if resp != nil {
			resp.Body.Close()
		}
		return nil, actx, stop, proxy.ErrHeaderTimeout
	}
	return resp, actx, stop, err
}

// maxErrBody bounds a failed attempt's body kept for the client.
const maxErrBody = 64 << 10

// drain reads (bounded, 2 s at most) and closes a failed attempt's body.
func drain(resp *http.Response) []byte {
	t := time.AfterFunc(2*time.Second, func() { resp.Body.Close() })
	defer t.Stop()
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxErrBody+1))
	if err != nil || len(b) > maxErrBody {
		return openai.MarshalError(resp.StatusCode, fmt.Sprintf("OpenAI upstream returned status %d", resp.StatusCode))
	}
	return b
}

// relayFailure returns the last failed attempt's answer as the upstream
// gave it.
func (b *Backend) relayFailure(w http.ResponseWriter, c *proxy.Call, status int, h http.Header, body []byte) {
	proxy.CopyResponseHeaders(w.Header(), h)
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	b.count(c, "upstream_status")
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// relay writes the upstream's answer to the client.
func (b *Backend) relay(ctx context.Context, w http.ResponseWriter, c *proxy.Call, resp *http.Response, done func(bool)) {
	defer resp.Body.Close()
	proxy.CopyResponseHeaders(w.Header(), resp.Header)
	sse := strings.HasPrefix(strings.ToLower(resp.Header.Get("Content-Type")), "text/event-stream")
	streaming := sse || (c.Stream && resp.ContentLength < 0)
	if !streaming && resp.ContentLength >= 0 {
		w.Header().Set("Content-Length", strconv.FormatInt(resp.ContentLength, 10))
	}
	w.WriteHeader(resp.StatusCode)
	if streaming {
		_ = http.NewResponseController(w).Flush()
	}
	var ro proxy.RelayOptions
	if sse {
		ro.IdleTimeout = b.o.StreamIdleTimeout
	}
	ro.Stream = streaming
	var finish func(bool)
	if b.m != nil && resp.StatusCode < 300 {
		ro.Observe, finish = proxy.NewUsageObserver(b.m)
		if streaming {
			ttft, start := b.m.TTFT.WithLabelValues(c.Route, "openai"), c.Start
			ro.OnFirstByte = func() { ttft.Observe(time.Since(start).Seconds()) }
		}
	}
	res := proxy.Relay(ctx, w, resp.Body, ro)
	if finish != nil {
		finish(res.UpstreamErr == nil)
	}
	switch {
	case res.UpstreamErr == nil:
		done(resp.StatusCode < 500)
	case !res.DownstreamOK:
		done(true)
		b.count(c, "client_canceled")
	default:
		done(false)
		b.count(c, "stream_broken")
		b.log.Warn("OpenAI upstream response broke mid-way", "route", c.Route, "upstream", b.o.Worker.URL, "bytes", res.Bytes, "err", res.UpstreamErr)
		if sse {
			_ = proxy.WriteSSEError(w, res, http.StatusBadGateway, "upstream stream broken: "+res.UpstreamErr.Error())
			return
		}
		if rc := http.NewResponseController(w); streaming || resp.ContentLength < 0 {
			if conn, _, err := rc.Hijack(); err == nil {
				_ = conn.Close()
			}
		}
	}
}

func (b *Backend) count(c *proxy.Call, errType string) {
	if b.m != nil {
		b.m.RequestErrors.WithLabelValues(c.Route, errType).Inc()
	}
}

func (b *Backend) writeError(w http.ResponseWriter, c *proxy.Call, status int, errType, msg string) {
	b.count(c, errType)
	if status >= 500 {
		b.log.Warn("OpenAI upstream request failed", "route", c.Route, "status", status, "err", msg)
	}
	openai.WriteError(w, status, msg)
}
