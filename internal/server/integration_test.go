package server

import (
	"bufio"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

type firstUsable struct{}

func (firstUsable) Name() string { return "first" }

func (firstUsable) Pick(req *policy.Request, c policy.Candidates) (policy.Choice, error) {
	for _, w := range c.Workers {
		if req.Usable(w) {
			return policy.Choice{Worker: w, Reason: "first usable"}, nil
		}
	}
	return policy.Choice{}, policy.ErrNoWorker
}

// With the real regular dispatcher: an SSE chunk crosses the whole chain
// (server wrapper + proxy.Relay) before the worker produces the next one,
// and the receipt and request id are on the response.
func TestIntegrationRegularProxy(t *testing.T) {
	next := make(chan struct{})
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/v1/chat/completions":
			w.Header().Set("Content-Type", "text/event-stream")
			w.Header().Set("X-Request-Id", "upstream")
			_, _ = io.WriteString(w, "data: {\"n\":1}\n\n")
			http.NewResponseController(w).Flush()
			select {
			case <-next:
			case <-time.After(5 * time.Second):
			}
			_, _ = io.WriteString(w, "data: {\"n\":2}\n\ndata: [DONE]\n\n")
		default:
			b, _ := io.ReadAll(r.Body)
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"path":"`+r.URL.Path+`","query":"`+r.URL.RawQuery+`","len":`+strconv.Itoa(len(b))+`}`)
		}
	}))
	defer up.Close()

	reg := worker.NewRegistry(worker.BreakerConfig{})
	if _, err := reg.Add(worker.Spec{URL: up.URL, DPRank: -1}); err != nil {
		t.Fatal(err)
	}
	client := &http.Client{Transport: proxy.NewH1Transport(proxy.TransportOptions{})}
	defer client.CloseIdleConnections()
	rp := proxy.NewRegular(proxy.RegularOptions{Registry: reg, Policy: firstUsable{}, Client: client})
	e := newEnv(t, func(o *Options) {
		o.Registry = reg
		o.Generate = rp
		o.Passthrough = http.HandlerFunc(rp.ServePassthrough)
		o.RouteReceipt = true
		o.MaxPayloadSize = 1 << 10
	})

	req, _ := http.NewRequestWithContext(t.Context(), "POST", e.srv.URL+"/v1/chat/completions",
		strings.NewReader(`{"stream":true,"messages":[]}`))
	req.Header.Set("X-Request-Id", "client-7")
	res, err := e.srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	if res.StatusCode != 200 || res.Header.Get("X-Request-Id") != "client-7" ||
		!strings.Contains(res.Header.Get("X-Switchyard-Route"), "worker="+up.URL) {
		t.Fatalf("status %d headers %v", res.StatusCode, res.Header)
	}
	br := bufio.NewReader(res.Body)
	if line, err := br.ReadString('\n'); err != nil || line != "data: {\"n\":1}\n" {
		t.Fatalf("first chunk %q %v", line, err)
	}
	close(next) // the worker produces chunk 2 only now
	rest, _ := io.ReadAll(br)
	if !strings.Contains(string(rest), `{"n":2}`) {
		t.Fatalf("rest %q", rest)
	}

	r := e.do("POST", "/tokenize?add_special=1", `{"prompt":"hi"}`)
	if r.status != 200 || r.json(t)["path"] != "/tokenize" || r.json(t)["query"] != "add_special=1" || r.json(t)["len"] != 15.0 {
		t.Fatalf("tokenize: %d %s", r.status, r.body)
	}
	r = e.do("POST", "/v1/other", `{"x":"`+strings.Repeat("y", 2000)+`"}`)
	if r.status != 413 {
		t.Fatalf("oversized catch-all through the real proxy: %d %s", r.status, r.body)
	}
}
