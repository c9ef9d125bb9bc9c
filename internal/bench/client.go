package bench

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

// RequestOutput is the measurement of one request, as vLLM's
// RequestFuncOutput.
type RequestOutput struct {
	// Index is the dataset position (the x-request-id suffix).
	Index int
	// RequestID is the x-request-id header sent ("" for warm-ups).
	RequestID string
	Success   bool
	// Error is the failure reason ("" on success).
	Error string
	// PromptLen is the sampled prompt length, replaced by the server's
	// usage.prompt_tokens when reported.
	PromptLen int
	// OutputTokens is usage.completion_tokens (0 when not reported).
	OutputTokens int
	// TTFT is the time from send to the first token event.
	TTFT time.Duration
	// ITL holds the gaps between consecutive token events.
	ITL []time.Duration
	// Latency is the time from send to the last token event (E2EL).
	Latency time.Duration
	// Start is the send time relative to the start of the measured run.
	Start time.Duration
	// QueueTime is the time spent waiting for a concurrency slot.
	QueueTime time.Duration
	// GeneratedText is the concatenated text deltas (unless discarded).
	GeneratedText string
	// TokenEvents counts events with non-empty choices.
	TokenEvents int
}

// neverReceived is vLLM's exact failure message for a 200 response without
// any token event.
const neverReceived = "Never received a valid chunk to calculate TTFT.This response will be marked as failed!"

var (
	errMaxDuration    = errors.New("benchmark stopped: --max-duration reached")
	errRequestTimeout = errors.New("request timed out (--timeout)")
)

// newTransport returns the shared transport for a run: keep-alive pooling
// sized for the run's peak concurrency, no compression (SSE is
// incompressible noise for the measurement), no overall client timeout
// (requests carry their own contexts).
func newTransport(c *Config, inflight int) *http.Transport {
	d := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}
	t := &http.Transport{
		Proxy:                 http.ProxyFromEnvironment,
		DialContext:           d.DialContext,
		MaxIdleConns:          0, // unlimited
		MaxIdleConnsPerHost:   max(inflight, 16),
		IdleConnTimeout:       90 * time.Second,
		TLSHandshakeTimeout:   10 * time.Second,
		ExpectContinueTimeout: time.Second,
		DisableCompression:    true,
		ForceAttemptHTTP2:     false,
		ReadBufferSize:        16 << 10,
		WriteBufferSize:       16 << 10,
	}
	if c.Insecure {
		t.TLSClientConfig = &tls.Config{InsecureSkipVerify: true} //nolint:gosec // --insecure
	}
	return t
}

// requester sends requests and measures them.
type requester struct {
	cfg        *Config
	client     *http.Client
	urls       []string // sample i goes to urls[i mod len]
	pb         *payloadBuilder
	header     http.Header
	benchStart time.Time
	runCtx     context.Context
	bufs       sync.Pool
	keepText   bool
}

func (r *requester) getBuf() []byte {
	if b, ok := r.bufs.Get().(*[]byte); ok {
		return *b
	}
	return make([]byte, sseMinBuf)
}

func (r *requester) putBuf(b []byte) {
	if cap(b) > 64<<10 { // do not keep buffers grown by huge events
		return
	}
	r.bufs.Put(&b)
}

// do sends one request and fills out. It never returns an error: failures
// are recorded in out, as vLLM does.
func (r *requester) do(ctx context.Context, s Sample, requestID string, out *RequestOutput) {
	out.Index = s.Index
	out.RequestID = requestID
	out.PromptLen = s.PromptLen
	body := r.pb.build(s)

	if r.cfg.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeoutCause(ctx, r.cfg.Timeout, errRequestTimeout)
		defer cancel()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.urls[s.Index%len(r.urls)], bytes.NewReader(body))
	if err != nil {
		out.Error = err.Error()
		return
	}
	req.Header = r.header.Clone()
	if requestID != "" {
		req.Header["X-Request-Id"] = []string{requestID}
	}

	st := time.Now()
	out.Start = st.Sub(r.benchStart)
	resp, err := r.client.Do(req)
	if err != nil {
		out.Error = r.describe(ctx, err)
		return
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		out.Error = reason(resp)
		_, _ = io.CopyN(io.Discard, resp.Body, 64<<10) // allow connection reuse
		return
	}
	r.readStream(ctx, resp.Body, s, st, out)
}

// reason is the HTTP reason phrase (aiohttp's response.reason).
func reason(resp *http.Response) string {
	code := strconv.Itoa(resp.StatusCode)
	if r, ok := strings.CutPrefix(resp.Status, code+" "); ok && r != "" {
		return r
	}
	if t := http.StatusText(resp.StatusCode); t != "" {
		return t
	}
	return "HTTP " + code
}

// describe turns a transport or body error into a failure reason, naming
// the benchmark's own deadlines.
func (r *requester) describe(ctx context.Context, err error) string {
	if r.runCtx.Err() != nil {
		cause := context.Cause(r.runCtx)
		if errors.Is(cause, errMaxDuration) {
			return errMaxDuration.Error()
		}
		return "benchmark cancelled: " + cause.Error()
	}
	if ctx.Err() != nil && errors.Is(context.Cause(ctx), errRequestTimeout) {
		return fmt.Sprintf("request timed out after %v (--timeout)", r.cfg.Timeout)
	}
	return err.Error()
}

func (r *requester) readStream(ctx context.Context, body io.Reader, s Sample, st time.Time, out *RequestOutput) {
	buf := r.getBuf()
	var p sseParser
	p.reset(buf)
	p.max, p.eager = r.cfg.MaxEventBytes, true
	defer func() { r.putBuf(p.buf) }()

	var text []byte
	var textp *[]byte
	if r.keepText {
		textp = &text
	}
	out.ITL = make([]time.Duration, 0, max(s.OutputLen-1, 0))
	last := st
	handle := func(data []byte) error {
		data = bytes.TrimSpace(data)
		if bytes.Equal(data, doneMarker) {
			return nil
		}
		now := time.Now()
		ci, err := scanChunk(data, textp)
		if err != nil {
			return fmt.Errorf("malformed SSE event %q: %v", truncate(string(data), 120), err)
		}
		if ci.errorMsg != "" {
			return fmt.Errorf("error event in stream: %s", ci.errorMsg)
		}
		switch {
		case ci.token:
			if out.TokenEvents == 0 {
				out.TTFT = now.Sub(st)
			} else {
				out.ITL = append(out.ITL, now.Sub(last))
			}
			out.TokenEvents++
			last = now
		case ci.usage:
			out.OutputTokens = ci.completion
			if ci.promptSet {
				out.PromptLen = ci.prompt
			}
		}
		return nil
	}
	fail := func(err error) {
		out.Success = false
		out.Error = r.describe(ctx, err)
		out.GeneratedText = string(text)
	}
	for {
		_, rerr := p.readFrom(body)
		for {
			data, ok, perr := p.next()
			if perr != nil {
				fail(perr)
				return
			}
			if !ok {
				break
			}
			if err := handle(data); err != nil {
				fail(err)
				return
			}
		}
		if rerr == io.EOF {
			if data, ok := p.finish(); ok {
				if err := handle(data); err != nil {
					fail(err)
					return
				}
			}
			break
		}
		if rerr != nil {
			fail(rerr)
			return
		}
	}
	out.GeneratedText = string(text)
	out.Latency = last.Sub(st)
	if out.TokenEvents > 0 {
		out.Success = true
	} else {
		out.Error = neverReceived
	}
}

// discoverModel implements vLLM's get_first_model_from_server: it returns
// data[0].id and data[0].root (root falls back to id).
func discoverModel(ctx context.Context, client *http.Client, baseURL string, h http.Header) (id, root string, err error) {
	u := baseURL + "/v1/models"
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return "", "", err
	}
	req.Header = h.Clone()
	req.Header.Del("Content-Type")
	resp, err := client.Do(req)
	if err != nil {
		return "", "", fmt.Errorf("failed to fetch models from server at %s: %w", u, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return "", "", fmt.Errorf("failed to fetch models from server at %s: %s", u, resp.Status)
	}
	var v struct {
		Data []struct {
			ID   string `json:"id"`
			Root string `json:"root"`
		} `json:"data"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 16<<20)).Decode(&v); err != nil {
		return "", "", fmt.Errorf("failed to fetch models from server at %s: %w", u, err)
	}
	if len(v.Data) == 0 || v.Data[0].ID == "" {
		return "", "", fmt.Errorf("no models found on the server at %s", baseURL)
	}
	root = v.Data[0].Root
	if root == "" {
		root = v.Data[0].ID
	}
	return v.Data[0].ID, root, nil
}
