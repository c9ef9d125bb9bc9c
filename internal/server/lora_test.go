package server

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/lorafake"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

const sqlLoad = `{"lora_name": "sql", "lora_path": "/adapters/sql"}`

func TestLoRALoadReachesEveryWorker(t *testing.T) {
	for _, mode := range []string{ModeRegular, ModePD} {
		t.Run(mode, func(t *testing.T) {
			e := newEnv(t, func(o *Options) { o.Mode = mode })
			engines := []*lorafake.Engine{lorafake.New(t), lorafake.New(t), lorafake.New(t)}
			roles := []worker.Role{worker.RoleRegular, worker.RoleRegular, worker.RoleRegular}
			if mode == ModePD {
				roles = []worker.Role{worker.RolePrefill, worker.RoleDecode, worker.RoleDecode}
			}
			for i, en := range engines {
				e.add(en.URL, roles[i], -1, 0)
			}
			r := e.do("POST", loraLoadPath, sqlLoad)
			if r.status != 200 || string(r.body) != "Success: LoRA adapter 'sql' added successfully." {
				t.Fatalf("load: %d %s", r.status, r.body)
			}
			for i, en := range engines {
				if !en.Has("sql") {
					t.Errorf("worker %d (%s) lacks the adapter", i, roles[i])
				}
			}
			r = e.do("POST", loraUnloadPath, `{"lora_name": "sql"}`)
			if r.status != 200 || !strings.Contains(string(r.body), "removed successfully") {
				t.Fatalf("unload: %d %s", r.status, r.body)
			}
			for i, en := range engines {
				if en.Has("sql") {
					t.Errorf("worker %d still holds the adapter", i)
				}
			}
		})
	}
}

func TestLoRAAnswers(t *testing.T) {
	cases := []struct {
		name       string
		preload    []bool // workers already holding "sql"
		disabled   []bool // workers without the routes
		path, body string
		status     int
		msg        string // in the error message
		remembered bool   // the router keeps the adapter for workers to come
	}{
		{name: "loaded everywhere already: the engines' 400", preload: []bool{true, true}, path: loraLoadPath, body: sqlLoad,
			status: 400, msg: "has already been loaded"},
		{name: "loaded on one: 400 naming it", preload: []bool{false, true}, path: loraLoadPath, body: sqlLoad,
			status: 400, msg: "LoRA adapter load failed on 1 of 2 workers", remembered: true},
		{name: "missing path: the engines' 400", path: loraLoadPath, body: `{"lora_name": "sql"}`,
			status: 400, msg: "Both 'lora_name' and 'lora_path' must be provided."},
		{name: "unload of an unknown adapter: 404", path: loraUnloadPath, body: `{"lora_name": "nope"}`,
			status: 404, msg: "cannot be found"},
		{name: "run-time updating off: FastAPI's 404", disabled: []bool{true, true}, path: loraLoadPath, body: sqlLoad,
			status: 404, msg: `{"detail":"Not Found"}`},
		{name: "off on one: 404 naming it", disabled: []bool{true, false}, path: loraLoadPath, body: sqlLoad,
			status: 404, msg: "failed on 1 of 2 workers: [URL0: 404 Not Found]", remembered: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, nil)
			msg := tc.msg
			for i := range 2 {
				en := lorafake.New(t)
				en.SetDisabled(tc.disabled != nil && tc.disabled[i])
				if tc.preload != nil && tc.preload[i] {
					en.Preload("sql", "/adapters/old")
				}
				e.add(en.URL, worker.RoleRegular, -1, 0)
				msg = strings.ReplaceAll(msg, fmt.Sprintf("URL%d", i), en.URL)
			}
			r := e.do("POST", tc.path, tc.body)
			if r.status != tc.status || !strings.Contains(string(r.body), msg) {
				t.Fatalf("got %d %s, want %d with %q", r.status, r.body, tc.status, msg)
			}
			if names, _ := e.s.lora.adapters(""); (len(names) > 0) != tc.remembered {
				t.Errorf("remembered %v, want %v", names, tc.remembered)
			}
		})
	}
}

func TestLoRANoWorkers(t *testing.T) {
	e := newEnv(t, nil)
	r := e.do("POST", loraLoadPath, sqlLoad)
	if r.status != 503 || !strings.Contains(r.errMsg(t), "No workers available") {
		t.Fatalf("got %d %s", r.status, r.body)
	}
}

func TestLoRAUnreachableWorker(t *testing.T) {
	e := newEnv(t, nil)
	ok := lorafake.New(t)
	dead := httptest.NewServer(http.NotFoundHandler())
	deadURL := dead.URL
	dead.Close()
	e.add(ok.URL, worker.RoleRegular, -1, 0)
	e.add(deadURL, worker.RoleRegular, -1, 0)
	r := e.do("POST", loraLoadPath, sqlLoad)
	if r.status != http.StatusBadGateway || !strings.Contains(r.errMsg(t), "failed on 1 of 2 workers: ["+deadURL) {
		t.Fatalf("got %d %s", r.status, r.body)
	}
	if !ok.Has("sql") {
		t.Error("the reachable worker lacks the adapter")
	}
}

// A worker that joins, or an engine that restarts, is given the adapters
// loaded through the router before PrepareLoRA returns; one that holds
// them is not asked again, and an unloaded adapter is not given back.
func TestLoRASyncGivesAdaptersBack(t *testing.T) {
	e := newEnv(t, nil)
	a, b := lorafake.New(t), lorafake.New(t)
	e.add(a.URL, worker.RoleRegular, -1, 0)
	if r := e.do("POST", loraLoadPath, sqlLoad); r.status != 200 {
		t.Fatalf("load: %d %s", r.status, r.body)
	}
	if r := e.do("POST", loraLoadPath, `{"lora_name": "chat", "lora_path": "/adapters/chat"}`); r.status != 200 {
		t.Fatalf("load: %d %s", r.status, r.body)
	}
	var st struct {
		LoRA []loraStatus `json:"lora_adapters"`
	}
	if err := json.Unmarshal(e.do("GET", "/workers", "").body, &st); err != nil ||
		fmt.Sprint(st.LoRA) != "[{sql [m1]} {chat [m1]}]" {
		t.Fatalf("/workers lora_adapters %v (%v)", st.LoRA, err)
	}

	e.add(b.URL, worker.RoleRegular, -1, 0)
	e.s.PrepareLoRA(t.Context(), b.URL) // as the health checker does before a joining worker is routed
	if !b.Has("sql") || !b.Has("chat") {
		t.Fatal("PrepareLoRA returned before the new worker had its adapters")
	}
	if g, n := value(e.m.LoRAAdapters), value(e.m.LoRAGiven.WithLabelValues("loaded")); g != 2 || n != 2 {
		t.Errorf("lora_adapters %v, given loaded %v; want 2 and 2", g, n)
	}

	a.Restart(false)
	loadsB := b.Loads()
	e.s.PrepareLoRA(t.Context(), a.URL) // as the health checker does before it is healthy again
	if !a.Has("sql") || !a.Has("chat") {
		t.Fatal("PrepareLoRA returned before the restarted worker had its adapters")
	}
	e.s.PrepareLoRA(t.Context(), b.URL)
	if n := b.Loads(); n != loadsB {
		t.Errorf("worker holding the adapters got %d more loads", n-loadsB)
	}

	if r := e.do("POST", loraUnloadPath, `{"lora_name": "chat"}`); r.status != 200 {
		t.Fatalf("unload: %d %s", r.status, r.body)
	}
	b.Restart(false)
	e.s.PrepareLoRA(t.Context(), b.URL)
	if !b.Has("sql") {
		t.Fatal("the remaining adapter was not given back")
	}
	if b.Has("chat") {
		t.Error("an unloaded adapter was given back")
	}
}

// LoRAChanged hears of a load some worker took (with the workers' model)
// and of an unload; a load no worker took says nothing.
func TestLoRAChangedTold(t *testing.T) {
	type call struct {
		name   string
		models []string
	}
	var mu sync.Mutex
	var calls []call
	e := newEnv(t, func(o *Options) {
		o.LoRAChanged = func(name string, models []string) {
			mu.Lock()
			defer mu.Unlock()
			calls = append(calls, call{name, models})
		}
	})
	off := lorafake.New(t)
	off.SetDisabled(true)
	e.add(lorafake.New(t).URL, worker.RoleRegular, -1, 0)
	e.add(off.URL, worker.RoleRegular, -1, 0)
	e.do("POST", loraLoadPath, sqlLoad)
	e.do("POST", loraLoadPath, `{"lora_name": "x"}`) // refused everywhere
	e.do("POST", loraUnloadPath, `{"lora_name": "sql"}`)
	mu.Lock()
	defer mu.Unlock()
	want := []call{{"sql", []string{"m1"}}, {"sql", nil}}
	if fmt.Sprint(calls) != fmt.Sprint(want) {
		t.Fatalf("calls %v, want %v", calls, want)
	}
}

// Every reconcile interval each worker is checked: an engine restarted
// between two health probes gets its adapters back unasked.
func TestLoRAReconciledPeriodically(t *testing.T) {
	e := newEnv(t, nil)
	a := lorafake.New(t)
	e.add(a.URL, worker.RoleRegular, -1, 0)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); e.s.RunLoRASync(ctx, 20*time.Millisecond) }()
	defer func() { cancel(); <-done }()
	if r := e.do("POST", loraLoadPath, sqlLoad); r.status != 200 {
		t.Fatalf("load: %d %s", r.status, r.body)
	}
	a.Restart(false)
	waitFor(t, "the adapter given back", func() bool { return a.Has("sql") })
}

// With LoRAByModel (--enable-igw) a worker is given only the adapters
// workers of its own model took: another base model cannot take them.
func TestLoRAByModelKeepsAdaptersToTheirModel(t *testing.T) {
	e := newEnv(t, func(o *Options) { o.LoRAByModel = true })
	a, other := lorafake.New(t), lorafake.New(t)
	other.SetDisabled(true)                 // refuses: it serves another base model
	e.add(a.URL, worker.RoleRegular, -1, 0) // model m1
	if _, err := e.reg.Add(worker.Spec{URL: other.URL, Role: worker.RoleRegular, DPRank: -1, ModelID: "m2"}); err != nil {
		t.Fatal(err)
	}
	if r := e.do("POST", loraLoadPath, sqlLoad); r.status != 404 {
		t.Fatalf("load: %d %s", r.status, r.body)
	}
	a.Restart(false)
	e.s.PrepareLoRA(t.Context(), a.URL)
	if !a.Has("sql") {
		t.Fatal("m1's worker not given back the adapter m1 took")
	}
	before := other.Requests()
	e.s.PrepareLoRA(t.Context(), other.URL)
	if n := other.Requests() - before; n != 0 {
		t.Fatalf("m2's worker was asked %d times for an adapter only m1 took", n)
	}
}

// Workers that all succeed, with different 2xx statuses, are a success.
func TestLoRAWriteAllSucceeded(t *testing.T) {
	e := newEnv(t, nil)
	rec := httptest.NewRecorder()
	req := httptest.NewRequest("POST", loraLoadPath, nil)
	e.s.writeLoRA(rec, req, loraLoadPath, []loraAnswer{
		{url: "http://a", status: 200, body: []byte("Success: a")},
		{url: "http://b", status: 201, body: []byte("Success: b")},
	})
	if rec.Code != 200 || rec.Body.String() != "Success: a" {
		t.Fatalf("%d %s", rec.Code, rec.Body)
	}
}
