package server

import (
	"testing"

	"github.com/switchyard-llm/switchyard/internal/admission"
)

// TestFlowEnginePriority: with --flow-engine-priority a request's band
// reaches the engine as vLLM's "priority" (minus the band's priority),
// appended to an otherwise untouched body; a body with its own priority
// and a default-band request are forwarded byte for byte.
func TestFlowEnginePriority(t *testing.T) {
	fe := newFlowEnv(t, 3, func(fc *admission.FlowConfig) { fc.EnginePriority = true })
	for _, tc := range []struct {
		name, body, band, want string
	}{
		{"high", `{"prompt":"x",  "max_tokens":2}`, "high", `{"prompt":"x",  "max_tokens":2,"priority":-10}`},
		{"low", `{"prompt":"x"}`, "low", `{"prompt":"x","priority":10}`},
		{"own", `{"prompt":"x","priority":3}`, "high", `{"prompt":"x","priority":3}`},
		{"default", `{"prompt":"x"}`, "", `{"prompt":"x"}`},
	} {
		var hdr []string
		if tc.band != "" {
			hdr = []string{admission.DefaultObjectiveHeader, tc.band}
		}
		ch := fe.send(tc.name, tc.body, hdr...)
		waitUntil(t, tc.name+" dispatched", func() bool {
			fe.mu.Lock()
			defer fe.mu.Unlock()
			_, ok := fe.bodies[tc.name]
			return ok
		})
		fe.next <- struct{}{}
		if r := recv(t, ch); r.status != 200 {
			t.Fatalf("%s: %d %s", tc.name, r.status, r.body)
		}
		fe.mu.Lock()
		got := string(fe.bodies[tc.name])
		fe.mu.Unlock()
		if got != tc.want {
			t.Errorf("%s: forwarded %s, want %s", tc.name, got, tc.want)
		}
	}
}
