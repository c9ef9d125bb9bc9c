package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// simResponsesStats is the part of /sim/stats counting Responses API
// retrievals and cancels.
type simResponsesStats struct {
	Requests struct {
		Responses int64 `json:"responses"`
		Retrieve  int64 `json:"responses_retrieve"`
		Cancel    int64 `json:"responses_cancel"`
	} `json:"requests"`
}

func responsesStats(t *testing.T, s *sim) simResponsesStats {
	t.Helper()
	var st simResponsesStats
	if code := getJSON(t, s.URL()+"/sim/stats", &st); code != 200 {
		t.Fatalf("%s /sim/stats: %d", s.URL(), code)
	}
	return st
}

// createStreamed creates a response with stream=true and returns the id of
// its response.created event.
func createStreamed(t *testing.T, base string) string {
	t.Helper()
	ctx := ctxT(t, 20*time.Second)
	req, err := http.NewRequestWithContext(ctx, "POST", base+"/v1/responses",
		strings.NewReader(`{"model":"sim-model","input":"stream this","max_output_tokens":4,"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("streamed create: %d %s", resp.StatusCode, b)
	}
	id := ""
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || id != "" {
			continue
		}
		var ev struct {
			Type     string              `json:"type"`
			Response struct{ ID string } `json:"response"`
		}
		if json.Unmarshal([]byte(data), &ev) == nil && ev.Type == "response.created" {
			id = ev.Response.ID
		}
	}
	if err := sc.Err(); err != nil || id == "" {
		t.Fatalf("no response.created id in the stream: %v", err)
	}
	return id
}

// TestResponsesHistoryOwnerOnly: with --history-backend memory (the
// default) the router remembers which worker produced each response it
// relayed; retrieval, cancel and previous_response_id go to that worker and
// no other (the other storing worker is never asked).
func TestResponsesHistoryOwnerOnly(t *testing.T) {
	a := startSim(t, "--role", "unified", "--responses-store")
	b := startSim(t, "--role", "unified", "--responses-store")
	r := startRouter(t, "--worker-urls", a.URL(), b.URL(), "--policy", "round_robin",
		"--history-backend", "memory", "--health-check-interval-secs", "3600")
	r.WaitReady(t, 10*time.Second)
	ctx := ctxT(t, 60*time.Second)

	// Four responses, two JSON and two streamed, spread by round robin.
	var ids []string
	for i := range 4 {
		if i%2 == 1 {
			ids = append(ids, createStreamed(t, r.Base))
			continue
		}
		code, _, body := post(t, ctx, r.Base+"/v1/responses", `{"model":"sim-model","input":"hello there","max_output_tokens":4}`)
		var obj struct{ ID string }
		if code != 200 || json.Unmarshal(body, &obj) != nil || obj.ID == "" {
			t.Fatalf("create: %d %s", code, body)
		}
		ids = append(ids, obj.ID)
	}
	owner := map[string]*sim{}
	for _, id := range ids {
		for _, s := range []*sim{a, b} {
			if code := getJSON(t, s.URL()+"/v1/responses/"+id, &map[string]any{}); code == 200 {
				owner[id] = s
			}
		}
		if owner[id] == nil {
			t.Fatalf("%s stored on no worker", id)
		}
	}
	before := map[*sim]simResponsesStats{a: responsesStats(t, a), b: responsesStats(t, b)}

	const gets = 3
	wantGet := map[*sim]int64{}
	for _, id := range ids {
		for range gets {
			var obj struct{ ID string }
			if code := getJSON(t, r.Base+"/v1/responses/"+id, &obj); code != 200 || obj.ID != id {
				t.Fatalf("GET %s through the router: %d %q", id, code, obj.ID)
			}
			wantGet[owner[id]]++
		}
		code, _, body := post(t, ctx, r.Base+"/v1/responses/"+id+"/cancel", "")
		if code != 400 || !strings.Contains(string(body), "Cannot cancel a synchronous response") {
			t.Fatalf("cancel %s: %d %s", id, code, body)
		}
	}
	// Continuing a conversation: every turn goes to the owner of the
	// previous response (round robin alone would send half to the other
	// worker, which answers 404).
	prev := ids[0]
	for turn := range 4 {
		code, _, body := post(t, ctx, r.Base+"/v1/responses",
			fmt.Sprintf(`{"model":"sim-model","input":"turn %d","max_output_tokens":3,"previous_response_id":%q}`, turn, prev))
		var obj struct {
			ID   string `json:"id"`
			Prev string `json:"previous_response_id"`
		}
		if code != 200 || json.Unmarshal(body, &obj) != nil || obj.Prev != prev {
			t.Fatalf("turn %d after %s: %d %s", turn, prev, code, body)
		}
		prev = obj.ID
	}

	for _, s := range []*sim{a, b} {
		st := responsesStats(t, s)
		got := st.Requests.Retrieve - before[s].Requests.Retrieve
		if got != wantGet[s] {
			t.Errorf("%s answered %d retrievals, want %d (its own responses only)", s.URL(), got, wantGet[s])
		}
		var own int64
		for _, id := range ids {
			if owner[id] == s {
				own++
			}
		}
		if got := st.Requests.Cancel - before[s].Requests.Cancel; got != own {
			t.Errorf("%s answered %d cancels, want %d", s.URL(), got, own)
		}
	}
	wantTurns := responsesStats(t, owner[ids[0]]).Requests.Responses
	if wantTurns < 4 {
		t.Errorf("the owner of %s served %d responses, want its own plus the 4 turns", ids[0], wantTurns)
	}
	_, raw := scrape(t, r.Metrics)
	m := string(raw)
	for _, want := range []string{
		fmt.Sprintf(`vllm_router_history_lookups_total{op="retrieve",result="hit"} %d`, gets*len(ids)),
		fmt.Sprintf(`vllm_router_history_lookups_total{op="cancel",result="hit"} %d`, len(ids)),
	} {
		if !strings.Contains(m, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
}
