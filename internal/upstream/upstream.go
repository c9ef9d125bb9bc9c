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
	body := c.Body
	if strippedRoutes[c.Route] {
		var removed []string
		body, removed = Strip(c.Obj)
		if len(removed) > 0 {
			b.log.Debug("removed vLLM-only fields for the OpenAI upstream", "route", c.Route, "fields", removed)
		}
	}
	ctx := r.Context()
	if b.o.RequestTimeout > 0 {
		start := c.Start
		if start.IsZero() {
			start = time.Now()
		}
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, start.Add(b.o.RequestTimeout))
		defer cancel()
	}
	rec := c.Receipt
	if rec == nil {
		rec = &proxy.Receipt{}
	}
	wk := b.o.Worker
	rec.Mode, rec.Policy, rec.Worker, rec.Reason = "openai", "single_upstream", wk.Key(), "--backend openai"
	hdr := b.header(r.Header, c.Stream)

	for attempt := 1; ; attempt++ {
		rec.Attempts = attempt
		done, ok := wk.Breaker().Start()
		if !ok {
			b.writeError(w, c, http.StatusServiceUnavailable, "circuit_open",
				fmt.Sprintf("OpenAI upstream %s: circuit breaker open after repeated failures", wk.URL))
			return
		}
		release := wk.Acquire()
		resp, actx, acancel, err := b.roundTrip(ctx, c, hdr, body, attempt)
		if err == nil && !retryable(resp.StatusCode) {
			b.relay(actx, w, c, resp, done)
			acancel()
			release()
			return
		}
		// A failure before any byte reached the client.
		var status int
		var errBody []byte
		var errHeader http.Header
		if err != nil {
			if ctx.Err() != nil {
				err = ctx.Err()
			}
			done(errors.Is(err, context.Canceled)) // a client that left says nothing about the upstream
		} else {
			status, errHeader = resp.StatusCode, resp.Header
			errBody = drain(resp)
			done(status < 500)
		}
		acancel()
		release()
		if errors.Is(err, context.Canceled) && r.Context().Err() != nil {
			b.count(c, "client_canceled")
			return
		}
		delay, again := b.retryDelay(ctx, attempt)
		if err != nil && !(proxy.IsDialError(err) || errors.Is(err, proxy.ErrHeaderTimeout) || isTimeout(err)) || ctx.Err() != nil {
			again = false
		}
		if !again {
			if err != nil {
				st := proxy.StatusFor(err)
				if st == proxy.StatusClientClosed {
					st = http.StatusGatewayTimeout
				}
				b.writeError(w, c, st, "upstream_error", fmt.Sprintf("OpenAI upstream %s failed after %d attempt(s): %v", wk.URL, attempt, err))
				return
			}
			b.relayFailure(w, c, status, errHeader, errBody)
			return
		}
		rec.Failovers = append(rec.Failovers, fmt.Sprintf("%s attempt %d: %s", wk.Key(), attempt, failureText(err, status)))
		if b.m != nil {
			b.m.Retries.WithLabelValues(c.Route).Inc()
			b.m.RetryBackoff.WithLabelValues(strconv.Itoa(attempt + 1)).Observe(delay.Seconds())
		}
		t := time.NewTimer(delay)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			if r.Context().Err() != nil {
				b.count(c, "client_canceled")
				return
			}
			b.writeError(w, c, http.StatusGatewayTimeout, "timeout", fmt.Sprintf("OpenAI upstream %s: request deadline passed while retrying (%s)", wk.URL, failureText(err, status)))
			return
		}
	}
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
