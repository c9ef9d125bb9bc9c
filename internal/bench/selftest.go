package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// zeroServer is an in-process OpenAI-compatible streaming server with no
// model latency: it answers every completion with max_tokens one-word token
// events (one flush per event, as vLLM does), a usage chunk and [DONE]. It
// measures the benchmark client's own overhead.
type zeroServer struct {
	itl  time.Duration // pause between token events (0: none)
	srv  *http.Server
	ln   net.Listener
	URL  string
	done chan struct{}
}

const selfTestModel = "sybench-zero-latency"

func startZeroServer() (*zeroServer, error) { return startPacedServer(0) }

// startPacedServer is startZeroServer with a pause of itl between token
// events, to load the client with many slow concurrent streams.
func startPacedServer(itl time.Duration) (*zeroServer, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"object":"list","data":[{"id":"`+selfTestModel+`","object":"model","owned_by":"vllm","root":"`+selfTestModel+`","parent":null}]}`)
	})
	mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) { zeroStream(w, r, false, itl) })
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) { zeroStream(w, r, true, itl) })
	z := &zeroServer{
		itl:  itl,
		srv:  &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second},
		ln:   ln,
		URL:  "http://" + ln.Addr().String(),
		done: make(chan struct{}),
	}
	go func() {
		defer close(z.done)
		_ = z.srv.Serve(ln)
	}()
	return z, nil
}

func (z *zeroServer) Close() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := z.srv.Shutdown(ctx); err != nil {
		_ = z.srv.Close()
	}
	<-z.done
}

var zeroBufs = sync.Pool{New: func() any { b := make([]byte, 0, 64<<10); return &b }}

// zeroStream reads the request body, finds max_tokens (or
// max_completion_tokens) and the prompt's word count without decoding the
// whole body, and streams the answer.
func zeroStream(w http.ResponseWriter, r *http.Request, chat bool, itl time.Duration) {
	bp := zeroBufs.Get().(*[]byte)
	defer zeroBufs.Put(bp)
	buf := bytes.NewBuffer((*bp)[:0])
	if _, err := buf.ReadFrom(io.LimitReader(r.Body, 64<<20)); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	*bp = buf.Bytes()[:0]
	body := buf.Bytes()
	if !json.Valid(body) {
		http.Error(w, `{"error":{"message":"invalid JSON"}}`, http.StatusBadRequest)
		return
	}
	maxTokens, promptTokens := 16, 0
	var kb [32]byte
	it := objIter{b: body}
	for {
		key, vs, ok := it.next(kb[:0])
		if !ok {
			break
		}
		switch string(key) {
		case "max_tokens", "max_completion_tokens":
			if n, ok := parseIntValue(body, vs); ok && n > 0 {
				maxTokens = n
			}
		case "prompt", "messages":
			promptTokens = countWords(body[vs:skipValue(body, vs)])
		}
	}
	id := r.Header.Get("X-Request-Id")
	object, idPrefix := "text_completion", "cmpl-"
	if chat {
		object, idPrefix = "chat.completion.chunk", "chatcmpl-"
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	head := `data: {"id":"` + idPrefix + id + `","object":"` + object + `","created":0,"model":"` + selfTestModel + `","choices":[`
	ev := make([]byte, 0, 256)
	var pause *time.Timer
	if itl > 0 {
		pause = time.NewTimer(itl)
		defer pause.Stop()
	}
	for i := 0; i < maxTokens; i++ {
		if pause != nil && i > 0 {
			pause.Reset(itl)
			select {
			case <-pause.C:
			case <-r.Context().Done():
				return
			}
		}
		finish := "null"
		if i == maxTokens-1 {
			finish = `"length"`
		}
		ev = append(ev[:0], head...)
		if chat {
			ev = append(ev, `{"index":0,"delta":{"content":" tok"},"logprobs":null,"finish_reason":`...)
		} else {
			ev = append(ev, `{"index":0,"text":" tok","logprobs":null,"finish_reason":`...)
		}
		ev = append(ev, finish...)
		ev = append(ev, ",\"stop_reason\":null}]}\n\n"...)
		if _, err := w.Write(ev); err != nil {
			return
		}
		if err := rc.Flush(); err != nil {
			return
		}
	}
	ev = append(ev[:0], head...)
	ev = append(ev, `],"usage":{"prompt_tokens":`...)
	ev = strconv.AppendInt(ev, int64(promptTokens), 10)
	ev = append(ev, `,"completion_tokens":`...)
	ev = strconv.AppendInt(ev, int64(maxTokens), 10)
	ev = append(ev, `,"total_tokens":`...)
	ev = strconv.AppendInt(ev, int64(promptTokens+maxTokens), 10)
	ev = append(ev, "}}\n\ndata: [DONE]\n\n"...)
	_, _ = w.Write(ev)
}

// countWords counts whitespace-separated words inside the JSON value raw
// (a prompt string, or the messages array whose text we count wholesale).
func countWords(raw []byte) int {
	n, in := 0, false
	for _, c := range raw {
		word := c != ' ' && c != '"' && c != '\t' && c != '\n'
		if word && !in {
			n++
		}
		in = word
	}
	return n
}

// RunSelfTest benchmarks against an in-process zero-latency streaming
// server (ignoring cfg.BaseURL and cfg.Model) and returns the result: its
// request and token-event throughput is an upper bound on what this client
// can drive on this machine, measured with the server sharing the CPU.
//
// itl > 0 makes the server pause that long between token events, so many
// slow streams stay open at once (a load closer to a real decode phase);
// the measured ITL then shows the client's timing error under load.
func RunSelfTest(ctx context.Context, cfg Config, itl time.Duration) (*Result, error) {
	z, err := startPacedServer(itl)
	if err != nil {
		return nil, err
	}
	defer z.Close()
	cfg.BaseURL = z.URL
	cfg.Model = selfTestModel
	return Run(ctx, cfg)
}

func selfTest(ctx context.Context, cfg Config, itl time.Duration, stdout io.Writer) error {
	fmt.Fprintf(stdout, "Self-test: in-process SSE server, inter-token pause %v (client and server share this process's CPUs).\n", itl)
	res, err := RunSelfTest(ctx, cfg, itl)
	if res == nil {
		return err
	}
	if werr := res.WriteReport(stdout); werr != nil {
		return errors.Join(err, werr)
	}
	events := 0
	for i := range res.Outputs {
		events += res.Outputs[i].TokenEvents
	}
	conc := fmt.Sprint(res.Config.MaxConcurrency)
	if res.Config.MaxConcurrency == 0 {
		conc = "unlimited (" + strconv.Itoa(res.Config.NumPrompts) + ")"
	}
	d := res.Duration.Seconds()
	fmt.Fprintf(stdout, "Self-overhead: %.0f req/s, %.0f token events/s, concurrency %s, peak %d streams in flight, %d failed\n",
		float64(res.Metrics.Completed)/d, float64(events)/d, conc, res.Metrics.MaxConcurrentRequests, res.Metrics.Failed)
	if itl > 0 {
		fmt.Fprintf(stdout, "Measured ITL vs server pause %v: mean %.2f ms, P50 %.2f ms, P99 %.2f ms\n",
			itl, res.Metrics.ITL.Mean, res.Metrics.ITL.At(50), res.Metrics.ITL.At(99))
	}
	return err
}
