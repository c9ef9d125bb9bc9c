package sim

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"testing"

	"github.com/google/go-cmp/cmp"
)

type rawResult struct {
	status      int
	contentType string
	allow       string
	raw         []byte
	body        map[string]any
}

// doRaw sends a request and keeps the exact response bytes.
func doRaw(t *testing.T, ctx context.Context, method, url string, body any) rawResult {
	t.Helper()
	resp, err := testClient.Do(newReq(t, ctx, method, url, body, nil))
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	r := rawResult{status: resp.StatusCode, contentType: resp.Header.Get("Content-Type"), allow: resp.Header.Get("Allow"), raw: raw}
	if len(raw) > 0 {
		if err := json.Unmarshal(raw, &r.body); err != nil {
			t.Fatalf("%s %s: status %d, non-JSON body %q", method, url, resp.StatusCode, raw)
		}
	}
	return r
}

// notFoundBody is vLLM's _make_not_found_error for id.
func notFoundBody(id string) map[string]any {
	return map[string]any{"error": map[string]any{
		"message": fmt.Sprintf("Response with id '%s' not found.", id),
		"type":    "invalid_request_error", "param": "response_id", "code": 404.0,
	}}
}

// postResponse creates a response (streaming or not) and returns its id and
// its final response object: the JSON body, or the response of the
// response.completed event.
func postResponse(t *testing.T, ctx context.Context, in *Instance, body map[string]any, xrid string) (string, []byte, map[string]any) {
	t.Helper()
	hdr := map[string]string{}
	if xrid != "" {
		hdr["X-Request-Id"] = xrid
	}
	resp, err := testClient.Do(newReq(t, ctx, http.MethodPost, in.url("/v1/responses"), body, hdr))
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		t.Fatalf("POST /v1/responses: %d %s", resp.StatusCode, b)
	}
	if stream, _ := body["stream"].(bool); stream {
		evs := readResponsesStream(t, resp)
		last := evs[len(evs)-1]
		if last.typ != "response.completed" {
			t.Fatalf("last event %q, want response.completed", last.typ)
		}
		obj := last.data["response"].(map[string]any)
		return obj["id"].(string), nil, obj
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	var obj map[string]any
	if err := json.Unmarshal(raw, &obj); err != nil {
		t.Fatalf("POST /v1/responses: %q: %v", raw, err)
	}
	return obj["id"].(string), raw, obj
}

func TestResponsesStoreRetrieve(t *testing.T) {
	ctx := testCtx(t)
	on := startSim(t, "--responses-store")
	off := startSim(t)
	base := func(extra map[string]any) map[string]any {
		b := map[string]any{"input": "store me please", "instructions": "be brief", "max_output_tokens": 5, "ignore_eos": true}
		for k, v := range extra {
			b[k] = v
		}
		return b
	}
	cases := []struct {
		name   string
		in     *Instance
		extra  map[string]any
		xrid   string
		stored bool
	}{
		{"non-streaming, store absent", on, nil, "ns-absent", true},
		{"non-streaming, store true", on, map[string]any{"store": true}, "ns-true", true},
		{"non-streaming, generated id", on, nil, "", true},
		{"streaming, store absent", on, map[string]any{"stream": true}, "st-absent", true},
		{"streaming, store true", on, map[string]any{"stream": true, "store": true}, "st-true", true},
		{"non-streaming, store false", on, map[string]any{"store": false}, "ns-false", false},
		{"streaming, store false", on, map[string]any{"stream": true, "store": false}, "st-false", false},
		{"store null is vLLM's None (falsy)", on, map[string]any{"store": nil}, "ns-null", false},
		{"store disabled, store absent", off, nil, "off-absent", false},
		{"store disabled, store true", off, map[string]any{"store": true}, "off-true", false},
		{"store disabled, streaming", off, map[string]any{"stream": true}, "off-stream", false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			id, raw, obj := postResponse(t, ctx, c.in, base(c.extra), c.xrid)
			if c.xrid != "" && id != "resp_"+c.xrid {
				t.Fatalf("id %q, want resp_%s", id, c.xrid)
			}
			if obj["status"] != "incomplete" || obj["usage"] == nil {
				t.Fatalf("final object is not a finished response: %v", obj)
			}
			g := doRaw(t, ctx, http.MethodGet, c.in.url("/v1/responses/"+id), nil)
			if !c.stored {
				if g.status != 404 {
					t.Fatalf("GET: %d %s, want 404", g.status, g.raw)
				}
				if d := cmp.Diff(notFoundBody(id), g.body); d != "" {
					t.Errorf("GET 404 body (-want +got):\n%s", d)
				}
				return
			}
			if g.status != 200 || g.contentType != "application/json" {
				t.Fatalf("GET: %d %q %s, want 200 application/json", g.status, g.contentType, g.raw)
			}
			if raw != nil && !bytes.Equal(g.raw, raw) {
				t.Errorf("GET returned\n%s\nwant the POST body\n%s", g.raw, raw)
			}
			if d := cmp.Diff(obj, g.body); d != "" {
				t.Errorf("GET object differs from the final response (-want +got):\n%s", d)
			}
			// A second GET answers the same.
			if g2 := doRaw(t, ctx, http.MethodGet, c.in.url("/v1/responses/"+id), nil); g2.status != 200 || !bytes.Equal(g2.raw, g.raw) {
				t.Errorf("second GET: %d %s", g2.status, g2.raw)
			}
		})
	}
}

func TestResponsesStoreErrors(t *testing.T) {
	ctx := testCtx(t)
	on := startSim(t, "--responses-store")
	off := startSim(t)
	id, _, _ := postResponse(t, ctx, on, map[string]any{"input": "x y", "max_output_tokens": 2}, "done")
	offID, _, _ := postResponse(t, ctx, off, map[string]any{"input": "x y", "max_output_tokens": 2}, "done")
	before := statsOf(t, on)

	cancelErr := map[string]any{"error": map[string]any{
		"message": "Cannot cancel a synchronous response.",
		"type":    "invalid_request_error", "param": "response_id", "code": 400.0,
	}}
	routeErr := func(status int, msg string) map[string]any {
		return map[string]any{"error": map[string]any{"message": msg, "type": msg, "param": nil, "code": float64(status)}}
	}
	cases := []struct {
		name   string
		in     *Instance
		method string
		path   string
		status int
		body   map[string]any
		allow  string
	}{
		{"GET unknown id", on, http.MethodGet, "/v1/responses/resp_nope", 404, notFoundBody("resp_nope"), ""},
		{"GET id without resp_ prefix", on, http.MethodGet, "/v1/responses/nope", 404, notFoundBody("nope"), ""},
		{"GET with store off", off, http.MethodGet, "/v1/responses/" + offID, 404, notFoundBody(offID), ""},
		{"cancel stored (finished, not background)", on, http.MethodPost, "/v1/responses/" + id + "/cancel", 400, cancelErr, ""},
		{"cancel unknown id", on, http.MethodPost, "/v1/responses/resp_nope/cancel", 404, notFoundBody("resp_nope"), ""},
		{"cancel with store off", off, http.MethodPost, "/v1/responses/" + offID + "/cancel", 404, notFoundBody(offID), ""},
		{"POST to a response id", on, http.MethodPost, "/v1/responses/" + id, 405, routeErr(405, "Method Not Allowed"), "GET"},
		{"DELETE a response id", on, http.MethodDelete, "/v1/responses/" + id, 405, routeErr(405, "Method Not Allowed"), "GET"},
		{"GET cancel", on, http.MethodGet, "/v1/responses/" + id + "/cancel", 405, routeErr(405, "Method Not Allowed"), "POST"},
		{"empty id", on, http.MethodPost, "/v1/responses//cancel", 404, routeErr(404, "Not Found"), ""},
		{"extra segment", on, http.MethodGet, "/v1/responses/" + id + "/cancel/x", 404, routeErr(404, "Not Found"), ""},
		{"other suffix", on, http.MethodPost, "/v1/responses/" + id + "/input_items", 404, routeErr(404, "Not Found"), ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := doRaw(t, ctx, c.method, c.in.url(c.path), nil)
			if r.status != c.status || r.contentType != "application/json" {
				t.Fatalf("%s %s: %d %q %s, want %d", c.method, c.path, r.status, r.contentType, r.raw, c.status)
			}
			if d := cmp.Diff(c.body, r.body); d != "" {
				t.Errorf("body (-want +got):\n%s", d)
			}
			if r.allow != c.allow {
				t.Errorf("Allow %q, want %q", r.allow, c.allow)
			}
		})
	}
	// The cancel did not change the stored object.
	if g := doRaw(t, ctx, http.MethodGet, on.url("/v1/responses/"+id), nil); g.status != 200 || g.body["status"] != "incomplete" {
		t.Errorf("GET after cancel: %d %s", g.status, g.raw)
	}
	// Like the other non-generation routes: only their errors are counted.
	after := statsOf(t, on)
	if got, want := after.Requests.Status4xx-before.Requests.Status4xx, int64(10); got != want {
		t.Errorf("status_4xx grew by %d, want %d (the 4xx answers of the instance with the store)", got, want)
	}
	if after.Requests.Responses != before.Requests.Responses || after.Requests.Plain != before.Requests.Plain {
		t.Errorf("retrieval counted as generation: %+v -> %+v", before.Requests, after.Requests)
	}

	// A "store" that is not a boolean is a type error like any other.
	for _, v := range []any{"yes", 1, map[string]any{}} {
		r := postJSON(t, ctx, on.url("/v1/responses"), map[string]any{"input": "x", "max_output_tokens": 1, "store": v}, nil)
		e, _ := r.body["error"].(map[string]any)
		if r.status != 400 || e["param"] != "store" || e["type"] != "BadRequestError" {
			t.Errorf("store %v: %d %s, want 400 naming store", v, r.status, r.raw)
		}
	}
}

func TestResponsesStoreEvictsOldest(t *testing.T) {
	ctx := testCtx(t)
	u := startSim(t, "--responses-store", "--responses-store-max", "2")
	body := map[string]any{"input": "a b", "max_output_tokens": 1}
	stored := func(id string) bool {
		t.Helper()
		r := doRaw(t, ctx, http.MethodGet, u.url("/v1/responses/"+id), nil)
		if r.status != 200 && r.status != 404 {
			t.Fatalf("GET %s: %d %s", id, r.status, r.raw)
		}
		return r.status == 200
	}
	steps := []struct {
		post string // X-Request-Id of the next response
		want map[string]bool
	}{
		{"a", map[string]bool{"a": true}},
		{"b", map[string]bool{"a": true, "b": true}},
		{"c", map[string]bool{"a": false, "b": true, "c": true}},
		// Storing an id again replaces it and makes it the newest.
		{"b", map[string]bool{"b": true, "c": true}},
		{"d", map[string]bool{"b": true, "c": false, "d": true}},
	}
	for i, s := range steps {
		body := body
		if i == 3 {
			body = map[string]any{"input": "a b", "max_output_tokens": 1, "stream": true}
		}
		postResponse(t, ctx, u, body, s.post)
		for id, want := range s.want {
			if got := stored("resp_" + id); got != want {
				t.Errorf("after storing %q: resp_%s stored = %v, want %v", s.post, id, got, want)
			}
		}
		if n := u.respStore.len(); n > 2 {
			t.Errorf("after storing %q: %d responses kept, max 2", s.post, n)
		}
	}
}

// TestResponsesPreviousID: previous_response_id must name a response in
// this instance's store (vLLM's 404 otherwise); a found one is echoed.
func TestResponsesPreviousID(t *testing.T) {
	ctx := testCtx(t)
	on := startSim(t, "--responses-store")
	off := startSim(t)
	id, _, _ := postResponse(t, ctx, on, map[string]any{"input": "first turn", "max_output_tokens": 3}, "")
	for _, tc := range []struct {
		name   string
		in     *Instance
		prev   string
		status int
	}{
		{"stored", on, id, 200},
		{"unknown id", on, "resp_nope", 404},
		{"no store", off, id, 404},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := doRaw(t, ctx, http.MethodPost, tc.in.url("/v1/responses"),
				map[string]any{"input": "second turn", "max_output_tokens": 3, "previous_response_id": tc.prev})
			if r.status != tc.status {
				t.Fatalf("status %d %s, want %d", r.status, r.raw, tc.status)
			}
			if tc.status == 404 {
				if diff := cmp.Diff(notFoundBody(tc.prev), r.body); diff != "" {
					t.Fatalf("404 body (-want +got):\n%s", diff)
				}
				return
			}
			if got := r.body["previous_response_id"]; got != tc.prev {
				t.Fatalf("previous_response_id %v, want %s", got, tc.prev)
			}
		})
	}
	var st Stats
	r := doRaw(t, ctx, http.MethodGet, on.url("/v1/responses/"+id), nil)
	if r.status != 200 {
		t.Fatalf("GET: %d", r.status)
	}
	raw := doRaw(t, ctx, http.MethodGet, on.url("/sim/stats"), nil).raw
	if err := json.Unmarshal(raw, &st); err != nil {
		t.Fatal(err)
	}
	if st.Requests.ResponsesGet != 1 || st.Requests.ResponsesCancel != 0 {
		t.Fatalf("stats retrieve %d cancel %d, want 1 0", st.Requests.ResponsesGet, st.Requests.ResponsesCancel)
	}
}
