package admission

import (
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/rawjson"
)

// FuzzClassify: any objective, fairness and deadline header and any body
// yields a valid band or an ErrBadFlowRequest, never a panic.
func FuzzClassify(f *testing.F) {
	f.Add("high", "tenant", "100", `{"priority":-3,"user":"u"}`)
	f.Add("-7", "", "1e3", `{"priority":1e300}`)
	f.Add("x", "t", "NaN", `{"priority":"high"}`)
	f.Add("", "", "-0", `{"priority":-9223372036854775808}`)
	bands, err := ParseBands([]string{"high=10", "default=0", "low=-10"}, time.Minute)
	if err != nil {
		f.Fatal(err)
	}
	for _, key := range []string{FairnessHeader, FairnessUser, FairnessAPIKey} {
		if _, err := newClassifier(FlowConfig{Bands: bands, FairnessKey: key}); err != nil {
			f.Fatal(err)
		}
	}
	f.Fuzz(func(t *testing.T, objective, flow, deadline, body string) {
		for _, key := range []string{FairnessHeader, FairnessUser, FairnessAPIKey} {
			cl, _ := newClassifier(FlowConfig{Bands: bands, FairnessKey: key})
			h := http.Header{}
			h.Set(DefaultObjectiveHeader, objective)
			h.Set(DefaultFairnessHeader, flow)
			h.Set(DefaultDeadlineHeader, deadline)
			h.Set("Authorization", "Bearer "+flow)
			obj, _ := rawjson.Parse([]byte(body))
			r, err := cl.classify(h, obj, time.Unix(0, 0))
			if err != nil {
				if !errors.Is(err, ErrBadFlowRequest) {
					t.Fatalf("error not wrapping ErrBadFlowRequest: %v", err)
				}
				continue
			}
			if r.Band < 0 || r.Band >= len(bands) || r.Flow == "" || len(r.Flow) > 256 {
				t.Fatalf("bad request %+v", r)
			}
		}
	})
}
