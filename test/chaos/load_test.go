package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/sim/oracle"
)

// kind classifies how one request ended.
type kind int

const (
	kindOK      kind = iota // 200, complete and well-formed
	kindHTTPErr             // an explicit non-200 status
	kindSSEErr              // a 200 stream that carried an SSE error event and ended with [DONE]
	kindHung                // no end before the client deadline
	kindLost                // anything else: reset, EOF, truncated stream or body, garbage
	kindWrong               // a complete answer whose text is not the oracle's (a missing, repeated or wrong token)
)

func (k kind) String() string {
	return [...]string{"ok", "http_error", "sse_error", "hung", "lost", "wrong"}[k]
}

// outcome is one finished request.
type outcome struct {
	start, end time.Time
	kind       kind
	status     int
	detail     string
}

// loadConfig describes a closed-loop load: conc goroutines, each sending
// one request at a time until dur has passed since the start.
type loadConfig struct {
	base      string
	conc      int
	dur       time.Duration
	deadline  time.Duration // client deadline per request; past it the request is "hung"
	maxTokens int
	// mix selects the request shape for request i (default: 2/4 streaming
	// completions, 1/4 streaming chat, 1/4 non-streaming completions).
	mix func(i int) shape
}

// shape is one request form.
type shape struct {
	chat, stream bool
	maxTokens    int // 0 = loadConfig.maxTokens
}

func defaultMix(i int) shape {
	switch i % 4 {
	case 2:
		return shape{chat: true, stream: true}
	case 3:
		return shape{}
	}
	return shape{stream: true}
}

func streamOnly(i int) shape {
	if i%3 == 2 {
		return shape{chat: true, stream: true}
	}
	return shape{stream: true}
}

// load is a running load generator.
type load struct {
	cfg    loadConfig
	client *http.Client
	tr     *http.Transport
	start  time.Time
	seq    atomic.Int64
	wg     sync.WaitGroup

	mu  sync.Mutex
	out []outcome
}

func newClientTransport(conc int) *http.Transport {
	return &http.Transport{
		Proxy:               nil,
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
		MaxIdleConns:        0,
		MaxIdleConnsPerHost: conc + 16,
		IdleConnTimeout:     30 * time.Second,
		DisableCompression:  true,
	}
}

// startLoad starts the generator; wait collects the result.
func startLoad(cfg loadConfig) *load {
	if cfg.mix == nil {
		cfg.mix = defaultMix
	}
	if cfg.maxTokens == 0 {
		cfg.maxTokens = 24
	}
	tr := newClientTransport(cfg.conc)
	l := &load{cfg: cfg, tr: tr, client: &http.Client{Transport: tr}, start: time.Now()}
	stopAt := l.start.Add(cfg.dur)
	for range cfg.conc {
		l.wg.Go(func() {
			for time.Now().Before(stopAt) {
				l.one()
			}
		})
	}
	return l
}

// burst sends n requests at once, in addition to the closed loop.
func (l *load) burst(n int) {
	for range n {
		l.wg.Go(l.one)
	}
}

// wait waits for every request and closes the client's idle connections.
func (l *load) wait() *loadResult {
	l.wg.Wait()
	l.tr.CloseIdleConnections()
	l.mu.Lock()
	defer l.mu.Unlock()
	// "served throughout" is judged while new requests were being sent
	end := time.Now()
	if stop := l.start.Add(l.cfg.dur); stop.Before(end) {
		end = stop
	}
	return &loadResult{start: l.start, end: end, out: append([]outcome(nil), l.out...)}
}

const promptWords = "the router keeps serving while workers crash stall and recover under steady load from many clients"

// request is request i of shape s and the answer vllm-sim's oracle gives
// for it: the prompt's tokens followed by the max_tokens generated ones
// (ignore_eos, seed 0), whichever worker or workers served it.
func (l *load) request(i int, s shape) (path, body, want string) {
	mt := s.maxTokens
	if mt == 0 {
		mt = l.cfg.maxTokens
	}
	prompt := fmt.Sprintf("chaos %d %s", i, promptWords)
	want = oracle.Text(oracle.DigestText(prompt), 0, mt)
	if s.chat {
		want = oracle.Text(oracle.DigestText(oracle.ChatPrompt([]oracle.Message{{Role: "user", Content: prompt}})), 0, mt)
	}
	path, body = l.requestBody(prompt, mt, i, s)
	return path, body, want
}

func (l *load) requestBody(prompt string, mt, i int, s shape) (path, body string) {
	stream := ""
	if s.stream {
		stream = `,"stream":true`
		if i%2 == 0 {
			stream += `,"stream_options":{"include_usage":true}`
		}
	}
	if s.chat {
		return "/v1/chat/completions", fmt.Sprintf(`{"model":"sim-model","messages":[{"role":"user","content":%q}],"max_tokens":%d,"ignore_eos":true%s}`, prompt, mt, stream)
	}
	return "/v1/completions", fmt.Sprintf(`{"model":"sim-model","prompt":%q,"max_tokens":%d,"ignore_eos":true%s}`, prompt, mt, stream)
}

// one sends one request and records how it ended.
func (l *load) one() {
	i := int(l.seq.Add(1))
	s := l.cfg.mix(i)
	path, body, want := l.request(i, s)
	o := outcome{start: time.Now()}
	ctx, cancel := context.WithTimeout(context.Background(), l.cfg.deadline)
	defer cancel()
	o.kind, o.status, o.detail = l.do(ctx, path, body, s.stream, want)
	o.end = time.Now()
	l.mu.Lock()
	l.out = append(l.out, o)
	l.mu.Unlock()
	if o.kind != kindOK {
		// a client backs off a little after an error, so a router that
		// fails fast is not hammered by a tight loop of instant retries
		time.Sleep(errPause)
	}
}

const errPause = 50 * time.Millisecond

// post sends a JSON body (with header name/value pairs hdr) and reads the
// whole answer. A failure before or during the response, or a non-200
// answer, is classified here (ok false); a 200 body is the caller's to
// classify.
func post(ctx context.Context, c *http.Client, url, body string, hdr ...string) (b []byte, k kind, status int, detail string, ok bool) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		return nil, kindLost, 0, err.Error(), false
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil, transportKind(ctx, err), 0, "before the response: " + err.Error(), false
	}
	defer resp.Body.Close()
	b, err = io.ReadAll(io.LimitReader(resp.Body, 8<<20))
	if err != nil {
		return b, transportKind(ctx, err), resp.StatusCode, fmt.Sprintf("status %d, body cut after %d bytes: %v", resp.StatusCode, len(b), err), false
	}
	if resp.StatusCode != http.StatusOK {
		if !json.Valid(b) || !bytes.Contains(b, []byte(`"error"`)) {
			return b, kindLost, resp.StatusCode, fmt.Sprintf("status %d without a JSON error body: %q", resp.StatusCode, clip(b)), false
		}
		return b, kindHTTPErr, resp.StatusCode, firstLine(b), false
	}
	return b, kindOK, resp.StatusCode, "", true
}

func (l *load) do(ctx context.Context, path, body string, stream bool, want string) (kind, int, string) {
	b, k, st, detail, ok := post(ctx, l.client, l.cfg.base+path, body)
	if !ok {
		return k, st, detail
	}
	if stream {
		k, st, detail := classifySSE(b)
		if k == kindOK {
			if got := sseText(b); got != want {
				return kindWrong, 200, fmt.Sprintf("stream text %q, the oracle's %q", got, want)
			}
		}
		return k, st, detail
	}
	var r struct {
		Choices []struct {
			Text    string `json:"text"`
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(b, &r); err != nil || len(r.Choices) == 0 {
		return kindLost, 200, fmt.Sprintf("200 with a bad body: %q", clip(b))
	}
	if got := r.Choices[0].Text + r.Choices[0].Message.Content; got != want {
		return kindWrong, 200, fmt.Sprintf("text %q, the oracle's %q", got, want)
	}
	return kindOK, 200, ""
}

// sseText is the generated text of a well-formed stream (classifySSE ok).
func sseText(b []byte) string {
	var text strings.Builder
	for _, ev := range strings.Split(strings.TrimSuffix(string(b), "\n\n"), "\n\n") {
		data := strings.TrimPrefix(ev, "data: ")
		var c struct {
			Choices []struct {
				Text  string `json:"text"`
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
		}
		if json.Unmarshal([]byte(data), &c) == nil {
			for _, ch := range c.Choices {
				text.WriteString(ch.Text + ch.Delta.Content)
			}
		}
	}
	return text.String()
}

func transportKind(ctx context.Context, err error) kind {
	if errors.Is(err, context.DeadlineExceeded) || ctx.Err() != nil {
		return kindHung
	}
	return kindLost
}

// classifySSE checks a 200 event stream: well-framed "data: " events, at
// least one choice, no error event, and "data: [DONE]" last. A stream with
// an error event is an explicit error; anything else is lost.
func classifySSE(b []byte) (kind, int, string) {
	s := string(b)
	if !strings.HasSuffix(s, "data: [DONE]\n\n") {
		return kindLost, 200, "stream not terminated by [DONE]: " + fmt.Sprintf("%q", clipTail(b))
	}
	events := strings.Split(strings.TrimSuffix(s, "\n\n"), "\n\n")
	choices, errEv := 0, ""
	for _, ev := range events {
		data, ok := strings.CutPrefix(ev, "data: ")
		if !ok {
			return kindLost, 200, fmt.Sprintf("bad SSE event %q", ev)
		}
		if data == "[DONE]" {
			continue
		}
		var c struct {
			Error   json.RawMessage   `json:"error"`
			Choices []json.RawMessage `json:"choices"`
		}
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			return kindLost, 200, fmt.Sprintf("bad SSE data %q: %v", data, err)
		}
		if len(c.Error) > 0 && string(c.Error) != "null" {
			errEv = data
		}
		choices += len(c.Choices)
	}
	if errEv != "" {
		return kindSSEErr, 200, errEv
	}
	if choices == 0 {
		return kindLost, 200, "stream without a single choice"
	}
	return kindOK, 200, ""
}

func clip(b []byte) []byte {
	if len(b) > 200 {
		return b[:200]
	}
	return b
}

func clipTail(b []byte) []byte {
	if len(b) > 200 {
		return b[len(b)-200:]
	}
	return b
}

func firstLine(b []byte) string {
	s := string(clip(b))
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s = s[:i]
	}
	return s
}

// loadResult is a finished run.
type loadResult struct {
	start, end time.Time
	out        []outcome
}

// counts are the totals of a set of outcomes.
type counts struct {
	sent, ok, httpErr, sseErr, hung, lost, wrong int
	status                                       map[int]int
}

func (c counts) errors() int { return c.httpErr + c.sseErr }

func (c counts) String() string {
	var st []string
	keys := make([]int, 0, len(c.status))
	for k := range c.status {
		keys = append(keys, k)
	}
	sort.Ints(keys)
	for _, k := range keys {
		st = append(st, fmt.Sprintf("%d:%d", k, c.status[k]))
	}
	return fmt.Sprintf("sent=%d ok=%d http_errors=%d sse_errors=%d hung=%d lost=%d wrong=%d statuses[%s]",
		c.sent, c.ok, c.httpErr, c.sseErr, c.hung, c.lost, c.wrong, strings.Join(st, " "))
}

// count totals the outcomes whose start lies in [from, to) (zero = open).
func (r *loadResult) count(from, to time.Time) counts {
	c := counts{status: map[int]int{}}
	for _, o := range r.out {
		if (!from.IsZero() && o.start.Before(from)) || (!to.IsZero() && !o.start.Before(to)) {
			continue
		}
		c.sent++
		switch o.kind {
		case kindOK:
			c.ok++
		case kindHTTPErr:
			c.httpErr++
		case kindSSEErr:
			c.sseErr++
		case kindHung:
			c.hung++
		case kindLost:
			c.lost++
		case kindWrong:
			c.wrong++
		}
		if o.status != 0 {
			c.status[o.status]++
		}
	}
	return c
}

func (r *loadResult) all() counts { return r.count(time.Time{}, time.Time{}) }

// endedBefore totals the outcomes that ended before t.
func (r *loadResult) endedBefore(t time.Time) *loadResult {
	sub := &loadResult{start: r.start, end: t}
	for _, o := range r.out {
		if o.end.Before(t) {
			sub.out = append(sub.out, o)
		}
	}
	return sub
}

// samples returns up to n details of outcomes of kind k.
func (r *loadResult) samples(k kind, n int) []string {
	seen := map[string]int{}
	var out []string
	for _, o := range r.out {
		if o.kind != k {
			continue
		}
		d := o.detail
		if len(d) > 240 {
			d = d[:240]
		}
		if seen[d]++; seen[d] == 1 && len(out) < n {
			out = append(out, fmt.Sprintf("+%.2fs %s", o.start.Sub(r.start).Seconds(), d))
		}
	}
	return out
}

// maxLatency is the longest request of the run.
func (r *loadResult) maxLatency() time.Duration {
	var m time.Duration
	for _, o := range r.out {
		m = max(m, o.end.Sub(o.start))
	}
	return m
}

// checkEnded asserts the invariant every scenario shares: no request hung
// and none was lost (every one succeeded or got an explicit error).
func (r *loadResult) checkEnded(t *testing.T) counts {
	t.Helper()
	c := r.all()
	t.Logf("load: %s, max latency %v", c, r.maxLatency().Round(time.Millisecond))
	if c.sent == 0 {
		t.Fatalf("no request was sent")
	}
	if c.hung != 0 {
		t.Errorf("%d request(s) hung past the client deadline: %v", c.hung, r.samples(kindHung, 5))
	}
	if c.lost != 0 {
		t.Errorf("%d request(s) lost (reset, truncated, or malformed): %v", c.lost, r.samples(kindLost, 5))
	}
	if c.wrong != 0 {
		t.Errorf("%d answer(s) differ from the oracle's (a token missing, repeated or wrong): %v", c.wrong, r.samples(kindWrong, 5))
	}
	if c.errors() > 0 {
		t.Logf("explicit errors, e.g.: %v %v", r.samples(kindHTTPErr, 3), r.samples(kindSSEErr, 3))
	}
	return c
}

// checkServedThroughout asserts that every one-second slot of the run saw
// at least one successful completion (the router never stopped serving).
func (r *loadResult) checkServedThroughout(t *testing.T) { r.checkServedEvery(t, time.Second) }

// checkServedEvery asserts that every slot of the run saw at least one
// successful completion.
func (r *loadResult) checkServedEvery(t *testing.T, slot time.Duration) {
	t.Helper()
	slots := int(r.end.Sub(r.start) / slot)
	if slots < 2 {
		return
	}
	okPer := make([]int, slots+1)
	for _, o := range r.out {
		if o.kind == kindOK {
			if i := int(o.end.Sub(r.start) / slot); i >= 0 && i <= slots {
				okPer[i]++
			}
		}
	}
	// Counted from the first slot with a completion (on a loaded machine
	// the first requests of 256 can take more than a slot: that is the
	// start, not a stop); the last slot is partial.
	first := 1
	for first < slots && okPer[first-1] == 0 && okPer[first] == 0 {
		first++
	}
	for i := first; i < slots; i++ {
		if okPer[i] == 0 {
			t.Errorf("no successful completion in slot %d (%v each) of the run (successes per slot: %v)", i, slot, okPer)
			return
		}
	}
}

// checkSuccessRate asserts that at least min of the requests started in
// [from, to) succeeded.
func (r *loadResult) checkSuccessRate(t *testing.T, what string, from, to time.Time, min float64) counts {
	t.Helper()
	c := r.count(from, to)
	if c.sent == 0 {
		t.Errorf("%s: no request started in the window", what)
		return c
	}
	rate := float64(c.ok) / float64(c.sent)
	t.Logf("%s: %.2f%% ok (%s)", what, 100*rate, c)
	if rate < min {
		t.Errorf("%s: success rate %.2f%% below %.2f%% (%s); errors e.g. %v %v", what, 100*rate, 100*min, c,
			r.samples(kindHTTPErr, 3), r.samples(kindSSEErr, 3))
	}
	return c
}
