package e2e

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestResponsesRetrieveFanOut (--history-backend none): a stored Responses
// API object lives on the worker that generated it; the router finds it (GET) or forwards the
// cancel to it whichever worker that is, and does not pretend a response
// is missing when the worker that may hold it is down.
func TestResponsesRetrieveFanOut(t *testing.T) {
	a := startSim(t, "--role", "unified", "--responses-store")
	b := startSim(t, "--role", "unified", "--responses-store")
	r := startRouter(t, "--worker-urls", a.URL(), b.URL(), "--policy", "round_robin",
		"--history-backend", "none", "--health-check-interval-secs", "3600")
	r.WaitReady(t, 5*time.Second)
	ctx := ctxT(t, 30*time.Second)

	do := func(method, path string) (int, []byte) {
		t.Helper()
		req, err := http.NewRequestWithContext(ctx, method, r.Base+path, nil)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatalf("%s %s: %v", method, path, err)
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return resp.StatusCode, body
	}
	// Two responses, one on each worker (round robin).
	bodies := map[string][]byte{}
	var ids []string
	for range 2 {
		code, _, body := post(t, ctx, r.Base+"/v1/responses", `{"model":"sim-model","input":"hello there","max_output_tokens":5}`)
		if code != 200 {
			t.Fatalf("POST /v1/responses: %d %s", code, body)
		}
		var obj struct{ ID string }
		if err := json.Unmarshal(body, &obj); err != nil || obj.ID == "" {
			t.Fatalf("no id in %s: %v", body, err)
		}
		ids = append(ids, obj.ID)
		bodies[obj.ID] = body
	}
	if ids[0] == ids[1] {
		t.Fatalf("same id twice: %s", ids[0])
	}
	for _, id := range ids {
		if code, body := do("GET", "/v1/responses/"+id); code != 200 || string(body) != string(bodies[id]) {
			t.Fatalf("GET %s: %d %s, want the stored object %s", id, code, body, bodies[id])
		}
		if code, body := do("POST", "/v1/responses/"+id+"/cancel"); code != 400 || !strings.Contains(string(body), "Cannot cancel a synchronous response") {
			t.Fatalf("cancel %s: %d %s", id, code, body)
		}
	}
	if code, body := do("GET", "/v1/responses/resp_nope"); code != 404 || !strings.Contains(string(body), "Response with id 'resp_nope' not found.") {
		t.Fatalf("unknown id: %d %s", code, body)
	}
	if code, _ := do("DELETE", "/v1/responses/"+ids[0]); code != 501 {
		t.Fatalf("DELETE: %d", code)
	}

	// Worker a goes down: a's responses cannot be found, and the answer
	// says so instead of a 404; b's are still served.
	onA := ""
	for _, id := range ids {
		req, _ := http.NewRequestWithContext(ctx, "GET", a.URL()+"/v1/responses/"+id, nil)
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				onA = id
			}
		}
	}
	if onA == "" {
		t.Fatal("neither response is stored on worker a")
	}
	a.Kill()
	onB := ids[0]
	if onB == onA {
		onB = ids[1]
	}
	if code, body := do("GET", "/v1/responses/"+onB); code != 200 || string(body) != string(bodies[onB]) {
		t.Fatalf("GET %s with a down: %d %s", onB, code, body)
	}
	if code, body := do("GET", "/v1/responses/"+onA); code != 502 || !strings.Contains(string(body), a.URL()) {
		t.Fatalf("GET %s with its worker down: %d %s, want 502 naming %s", onA, code, body, a.URL())
	}
}
