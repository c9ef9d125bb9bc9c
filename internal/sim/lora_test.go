package sim

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// postText posts a JSON body and returns the status and the raw answer.
func postText(t *testing.T, url, body string) (int, string) {
	t.Helper()
	resp, err := testClient.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// modelIDs returns /v1/models' entries as "id<parent:root>".
func modelIDs(t *testing.T, in *Instance) []string {
	t.Helper()
	var v struct {
		Data []struct {
			ID     string  `json:"id"`
			Root   string  `json:"root"`
			Parent *string `json:"parent"`
		} `json:"data"`
	}
	if st := getJSON(t, in.url("/v1/models"), &v); st != 200 {
		t.Fatalf("/v1/models: %d", st)
	}
	var out []string
	for _, d := range v.Data {
		p := "-"
		if d.Parent != nil {
			p = *d.Parent
		}
		out = append(out, fmt.Sprintf("%s<%s:%s>", d.ID, p, d.Root))
	}
	return out
}

// TestLoRAAdapters: vLLM 0.32's LoRA surface (entrypoints/openai/models/
// serving.py, serve/lora/api_router.py): --lora-modules adapters are
// served and listed after the model, with it as parent and their path as
// root; with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True adapters load and
// unload at run time, with vLLM's answers; a request names an adapter as
// its model and is answered under that name.
func TestLoRAAdapters(t *testing.T) {
	t.Setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
	ctx := testCtx(t)
	in := startSim(t, "--profile-preset", "zero", "--model", "base", "--enable-lora", "--lora-modules", "sql=/a/sql")
	if got, want := modelIDs(t, in), []string{"base<-:base>", "sql<base:/a/sql>"}; !cmp.Equal(got, want) {
		t.Fatalf("/v1/models %v, want %v", got, want)
	}
	gen := func(model string) (int, string) {
		r := postJSON(t, ctx, in.url("/v1/completions"), map[string]any{"model": model, "prompt": "hi there", "max_tokens": 1}, nil)
		if r.status != 200 {
			e, _ := r.body["error"].(map[string]any)
			m, _ := e["message"].(string)
			return r.status, m
		}
		return r.status, r.body["model"].(string)
	}
	if st, m := gen("sql"); st != 200 || m != "sql" {
		t.Fatalf("the module's adapter: %d %s", st, m)
	}
	for _, step := range []struct {
		path, body string
		status     int
		answer     string // the plain-text answer, or the error's message
	}{
		{"/v1/load_lora_adapter", `{"lora_name":"chat","lora_path":"/a/chat"}`, 200, "Success: LoRA adapter 'chat' added successfully."},
		{"/v1/load_lora_adapter", `{"lora_name":"chat","lora_path":"/a/chat"}`, 400, "The lora adapter 'chat' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True."},
		{"/v1/load_lora_adapter", `{"lora_name":"chat","lora_path":"/a/chat2","load_inplace":true}`, 200, "Success: LoRA adapter 'chat' added successfully."},
		{"/v1/load_lora_adapter", `{"lora_name":"x"}`, 400, "Both 'lora_name' and 'lora_path' must be provided."},
		{"/v1/load_lora_adapter", `{"lora_name":"base","lora_path":"/a/b"}`, 400, "The lora adapter 'base' conflicts with a served base model."},
		{"/v1/unload_lora_adapter", `{"lora_name":"sql"}`, 200, "Success: LoRA adapter 'sql' removed successfully."},
		{"/v1/unload_lora_adapter", `{"lora_name":"sql"}`, 404, "The lora adapter 'sql' cannot be found."},
		{"/v1/unload_lora_adapter", `{}`, 400, "'lora_name' needs to be provided to unload a LoRA adapter."},
	} {
		st, body := postText(t, in.url(step.path), step.body)
		if st == 400 && !strings.Contains(body, `"type":"InvalidUserInput"`) {
			t.Fatalf("%s %s: %s, want vLLM's InvalidUserInput", step.path, step.body, body)
		}
		if st != step.status || (st == 200 && body != step.answer) || (st != 200 && !strings.Contains(body, step.answer)) {
			t.Fatalf("%s %s: %d %s, want %d %q", step.path, step.body, st, body, step.status, step.answer)
		}
	}
	if got, want := modelIDs(t, in), []string{"base<-:base>", "chat<base:/a/chat2>"}; !cmp.Equal(got, want) {
		t.Fatalf("/v1/models after the updates %v, want %v", got, want)
	}
	var list struct {
		Data []map[string]any `json:"data"`
	}
	getJSON(t, in.url("/v1/models"), &list)
	if list.Data[0]["max_model_len"] == nil || list.Data[1]["max_model_len"] != nil {
		t.Fatalf("max_model_len: model %v, adapter %v; want a number and null (vLLM's adapter cards have none)", list.Data[0]["max_model_len"], list.Data[1]["max_model_len"])
	}
	if st, m := gen("chat"); st != 200 || m != "chat" {
		t.Fatalf("the loaded adapter: %d %s", st, m)
	}
	if st, m := gen("sql"); st != 404 || m != "The model `sql` does not exist. Valid aliases: base." {
		t.Fatalf("the unloaded adapter: %d %s", st, m)
	}
	if st, m := gen("base"); st != 200 || m != "base" {
		t.Fatalf("the model: %d %s", st, m)
	}
}

// TestLoRAUpdatesNeedTheirSwitches: without the environment variable the
// two routes do not exist (404); without --enable-lora a load is refused.
func TestLoRAUpdatesNeedTheirSwitches(t *testing.T) {
	off := startSim(t, "--profile-preset", "zero", "--enable-lora")
	if st, _ := postText(t, off.url("/v1/load_lora_adapter"), `{"lora_name":"a","lora_path":"/a"}`); st != http.StatusNotFound {
		t.Fatalf("load without VLLM_ALLOW_RUNTIME_LORA_UPDATING: %d, want 404", st)
	}
	t.Setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
	noLoRA := startSim(t, "--profile-preset", "zero")
	if st, body := postText(t, noLoRA.url("/v1/load_lora_adapter"), `{"lora_name":"a","lora_path":"/a"}`); st != 500 || !strings.Contains(body, "LoRA is not enabled") || !strings.Contains(body, `"InternalServerError"`) {
		t.Fatalf("load without --enable-lora: %d %s", st, body)
	}
	for _, args := range [][]string{
		{"--lora-modules", "a=/a"},               // needs --enable-lora
		{"--enable-lora", "--lora-modules", "a"}, // name=path
		{"--enable-lora", "--lora-modules", "a=/a b=/b", "--lora-modules", `{"name":"a","path":"/c"}`}, // twice
		{"--enable-lora", "--model", "m", "--lora-modules", "m=/m"},                                    // the model's name
	} {
		if _, err := ParseArgs(args, io.Discard); err == nil {
			t.Errorf("ParseArgs(%q) accepted", args)
		}
	}
	c, err := ParseArgs([]string{"--enable-lora", "--lora-modules", "a=/a b=/b", "--lora-modules", `{"name":"c","path":"/c"}`}, io.Discard)
	if err != nil || !cmp.Equal(c.LoRAModules, []LoRAModule{{"a", "/a"}, {"b", "/b"}, {"c", "/c"}}) {
		t.Fatalf("--lora-modules: %v %v", c.LoRAModules, err)
	}
}

// TestLoRAPrefixCacheAndEvents: an adapter's requests share cached blocks
// only with the same adapter's, and their BlockStored events carry vLLM's
// lora_id and lora_name, and the name first in every block's extra keys
// (then a salted sequence's salt): the router's index matches them under
// the adapter's keys and not the base model's.
func TestLoRAPrefixCacheAndEvents(t *testing.T) {
	for _, encoding := range []string{EncodingNamed, EncodingPositional} {
		t.Run(encoding, func(t *testing.T) {
			ctx := testCtx(t)
			in := startSim(t, "--profile-preset", "zero", "--model", "base", "--enable-lora", "--lora-modules", "sql=/a/sql chat=/a/chat",
				"--enable-prompt-tokens-details", "--block-size", "16", "--kv-events-encoding", encoding,
				"--kv-events-config", `{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}`)
			f := follow(t, in)
			warmUp(t, in, f)
			prompt := words(50, "lr") // 3 full blocks can hit
			toks := tokenize(t, in, prompt)
			send := func(model, salt string) float64 {
				body := map[string]any{"model": model, "prompt": prompt, "max_tokens": 1, "ignore_eos": true}
				if salt != "" {
					body["cache_salt"] = salt
				}
				r := postJSON(t, ctx, in.url("/v1/completions"), body, nil)
				if r.status != 200 {
					t.Fatalf("%s: %d %s", model, r.status, r.raw)
				}
				return cachedOf(r.body["usage"].(map[string]any))
			}
			for _, step := range []struct {
				model, salt string
				cached      float64
			}{
				{"base", "", 0}, {"sql", "", 0}, {"sql", "", 48}, {"chat", "", 0}, {"base", "", 48}, {"sql", "t", 0},
			} {
				if got := send(step.model, step.salt); got != step.cached {
					t.Fatalf("%s salt %q: %v cached tokens, want %v", step.model, step.salt, got, step.cached)
				}
			}
			waitFor(t, "the index holds the adapter's blocks", func() bool {
				return f.idx.Match(f.idx.BlockKeys(toks, "sql"))["w"] == 3 && f.idx.Match(f.idx.SaltedBlockKeys(toks, "sql", "t"))["w"] == 3
			})
			if n := f.idx.Match(f.idx.BlockKeys(toks, ""))["w"]; n != 3 {
				t.Fatalf("base model's keys match %d blocks, want its own 3", n)
			}
			if !f.idx.IsLoRA("sql") || !f.idx.IsLoRA("chat") {
				t.Fatal("the index did not learn the adapters from the events")
			}
			var byName = map[string][]storedEvent{}
			for _, ev := range storedEvents(t, in.kvPubs[0], encoding == EncodingNamed) {
				name, _ := ev.loraName.(string)
				byName[name] = append(byName[name], ev)
			}
			sqlEvs := byName["sql"]
			if len(sqlEvs) != 2 || len(byName["chat"]) != 1 {
				t.Fatalf("events by adapter: sql %d, chat %d; want 2 (plain, salted) and 1", len(sqlEvs), len(byName["chat"]))
			}
			if id := fmt.Sprint(sqlEvs[0].loraID); id != "1" || fmt.Sprint(byName["chat"][0].loraID) != "2" {
				t.Fatalf("lora_id sql %v chat %v, want 1 and 2 (the modules' order)", sqlEvs[0].loraID, byName["chat"][0].loraID)
			}
			if diff := cmp.Diff([]any{[]any{"sql"}, []any{"sql"}, []any{"sql"}}, sqlEvs[0].extraKeys); diff != "" {
				t.Errorf("adapter's extra_keys (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff([]any{[]any{"sql", "t"}, []any{"sql"}, []any{"sql"}}, sqlEvs[1].extraKeys); diff != "" {
				t.Errorf("salted adapter's extra_keys (-want +got):\n%s", diff)
			}
			for _, ev := range byName[""] {
				if ev.loraID != nil {
					t.Fatalf("a base model's event has lora_id %v", ev.loraID)
				}
			}
		})
	}
}
