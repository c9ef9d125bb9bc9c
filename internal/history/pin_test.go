package history

import (
	"testing"

	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

func workers(t *testing.T, role worker.Role, urls ...string) []*worker.Worker {
	t.Helper()
	var ws []*worker.Worker
	for _, u := range urls {
		ws = append(ws, worker.New(worker.Spec{URL: u, Role: role, DPRank: -1}, worker.BreakerConfig{}))
	}
	return ws
}

func TestPin(t *testing.T) {
	s, _, _ := newStore(t, 10, 0)
	s.Put("resp_b", "http://b")
	s.Put("resp_gone", "http://gone")
	ws := workers(t, worker.RoleRegular, "http://a", "http://b", "http://c")
	cands := policy.Candidates{Gen: 1, Workers: ws}
	cases := []struct {
		name    string
		path    string
		body    string
		exclude string
		down    bool
		want    string // "" = the inner policy's pick (round robin), not checked
		pinned  bool
	}{
		{"owner", "/v1/responses", `{"input":"x","previous_response_id":"resp_b"}`, "", false, "http://b", true},
		{"unknown id", "/v1/responses", `{"previous_response_id":"resp_zz"}`, "", false, "", false},
		{"owner left the fleet", "/v1/responses", `{"previous_response_id":"resp_gone"}`, "", false, "", false},
		{"owner excluded after a failure", "/v1/responses", `{"previous_response_id":"resp_b"}`, "http://b", false, "", false},
		{"owner unhealthy", "/v1/responses", `{"previous_response_id":"resp_b"}`, "", true, "", false},
		{"other route", "/v1/chat/completions", `{"previous_response_id":"resp_b"}`, "", false, "", false},
		{"null", "/v1/responses", `{"previous_response_id":null}`, "", false, "", false},
		{"not a string", "/v1/responses", `{"previous_response_id":7}`, "", false, "", false},
		{"not JSON", "/v1/responses", `{"previous_response_id":`, "", false, "", false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			inner, err := policy.New(policy.NameRoundRobin, policy.DefaultOptions())
			if err != nil {
				t.Fatal(err)
			}
			p := Pin(inner, s)
			if p.Name() != policy.NameRoundRobin {
				t.Fatalf("name %q", p.Name())
			}
			ws[1].SetHealthy(!tc.down)
			defer ws[1].SetHealthy(true)
			req := &policy.Request{Path: tc.path, Body: []byte(tc.body)}
			if tc.exclude != "" {
				req.Exclude = map[string]bool{tc.exclude: true}
			}
			ch, err := p.Pick(req, cands)
			if err != nil {
				t.Fatal(err)
			}
			if got := ch.Reason == "previous_response_id owner"; got != tc.pinned {
				t.Fatalf("pinned %v (%s %q), want %v", got, ch.Worker.URL, ch.Reason, tc.pinned)
			}
			if tc.want != "" && ch.Worker.URL != tc.want {
				t.Fatalf("picked %s, want %s", ch.Worker.URL, tc.want)
			}
			if !req.Usable(ch.Worker) {
				t.Fatalf("picked unusable %s", ch.Worker.URL)
			}
		})
	}
}

func TestPinPair(t *testing.T) {
	s, _, _ := newStore(t, 10, 0)
	s.Put("resp_p", "http://p2")
	inner, err := policy.New(policy.NameConsistentHash, policy.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	defer policy.Close(inner)
	p := Pin(inner, s)
	pp, ok := p.(policy.PairPolicy)
	if !ok {
		t.Fatal("the wrapper of a PairPolicy must be a PairPolicy")
	}
	if _, ok := Pin(&noPair{}, s).(policy.PairPolicy); ok {
		t.Fatal("the wrapper of a plain policy must not be a PairPolicy")
	}
	pre := policy.Candidates{Gen: 1, Workers: workers(t, worker.RolePrefill, "http://p1", "http://p2")}
	dec := policy.Candidates{Gen: 1, Workers: workers(t, worker.RoleDecode, "http://d1")}
	known := &policy.Request{Path: "/v1/responses", Body: []byte(`{"previous_response_id":"resp_p"}`)}
	if _, _, err := pp.PickPair(known, pre, dec); err == nil {
		t.Fatal("a known previous response must leave the choice to Pick")
	}
	if ch, err := p.Pick(known, pre); err != nil || ch.Worker.URL != "http://p2" {
		t.Fatalf("Pick = %v, %v; want http://p2", ch.Worker, err)
	}
	plain := &policy.Request{Path: "/v1/responses", Body: []byte(`{"input":"hi"}`)}
	if a, b, err := pp.PickPair(plain, pre, dec); err != nil || a.Worker == nil || b.Worker == nil {
		t.Fatalf("PickPair without a previous response: %v %v %v", a, b, err)
	}
	if err := policy.Close(p); err != nil {
		t.Fatal(err)
	}
}

type noPair struct{}

func (noPair) Name() string { return "x" }
func (noPair) Pick(*policy.Request, policy.Candidates) (policy.Choice, error) {
	return policy.Choice{}, policy.ErrNoWorker
}
