package bench

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// orderedJSON builds a JSON object whose keys keep insertion order, so the
// saved result reads like vLLM's.
type orderedJSON struct {
	b   bytes.Buffer
	n   int
	err error
}

func (o *orderedJSON) add(key string, v any) {
	if o.err != nil {
		return
	}
	if o.n == 0 {
		o.b.WriteByte('{')
	} else {
		o.b.WriteString(", ")
	}
	o.n++
	k, _ := json.Marshal(key)
	o.b.Write(k)
	o.b.WriteString(": ")
	val, err := json.Marshal(v)
	if err != nil {
		o.err = fmt.Errorf("result key %q: %w", key, err)
		return
	}
	o.b.Write(val)
}

func (o *orderedJSON) bytes() ([]byte, error) {
	if o.err != nil {
		return nil, o.err
	}
	if o.n == 0 {
		return []byte("{}"), nil
	}
	o.b.WriteByte('}')
	return o.b.Bytes(), nil
}

// jsonFloat replaces non-finite values (not representable in JSON) by 0.
func jsonFloat(f float64) float64 {
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return 0
	}
	return f
}

// MarshalJSONResult renders the result with vllm bench serve's key names
// (--save-result). With detailed set the per-request arrays are included
// (input_lens, output_lens, ttfts, itls, latencies, start_times,
// queue_times, generated_texts, errors); times are in seconds, as in vLLM.
// Latency statistics are always included for ttft, tpot, itl and e2el (vLLM
// only writes the selected ones), plus the queue metrics when selected.
func (r *Result) MarshalJSONResult(detailed bool) ([]byte, error) {
	c := &r.Config
	m := &r.Metrics
	var o orderedJSON
	o.add("date", r.Date.Format("20060102-150405"))
	o.add("endpoint_type", c.Backend)
	o.add("backend", c.Backend)
	o.add("label", c.Label)
	o.add("model_id", r.ModelID)
	o.add("tokenizer_id", nil)
	o.add("num_prompts", c.NumPrompts)
	if math.IsInf(c.RequestRate, 1) {
		o.add("request_rate", "inf")
	} else {
		o.add("request_rate", c.RequestRate)
	}
	if math.IsInf(c.Burstiness, 1) {
		o.add("burstiness", "inf")
	} else {
		o.add("burstiness", c.Burstiness)
	}
	if c.MaxConcurrency > 0 {
		o.add("max_concurrency", c.MaxConcurrency)
	} else {
		o.add("max_concurrency", nil)
	}
	o.add("duration", r.Duration.Seconds())
	o.add("completed", m.Completed)
	o.add("failed", m.Failed)
	o.add("total_input_tokens", m.TotalInput)
	o.add("total_output_tokens", m.TotalOutput)
	o.add("request_throughput", m.RequestThroughput)
	if len(c.Goodput) > 0 {
		o.add("request_goodput", m.RequestGoodput)
	} else {
		o.add("request_goodput", nil)
	}
	o.add("output_throughput", m.OutputThroughput)
	o.add("total_token_throughput", m.TotalTokenThroughput)
	if detailed {
		n := len(r.Outputs)
		inLens := make([]int, n)
		ttfts := make([]float64, n)
		itls := make([][]float64, n)
		lat := make([]float64, n)
		starts := make([]float64, n)
		queues := make([]float64, n)
		texts := make([]string, n)
		errs := make([]string, n)
		for i := range r.Outputs {
			x := &r.Outputs[i]
			inLens[i] = x.PromptLen
			ttfts[i] = x.TTFT.Seconds()
			itls[i] = make([]float64, len(x.ITL))
			for k, d := range x.ITL {
				itls[i][k] = d.Seconds()
			}
			lat[i] = x.Latency.Seconds()
			starts[i] = x.Start.Seconds()
			queues[i] = x.QueueTime.Seconds()
			texts[i] = x.GeneratedText
			errs[i] = x.Error
		}
		o.add("input_lens", inLens)
		o.add("output_lens", m.OutputLens)
		o.add("ttfts", ttfts)
		o.add("itls", itls)
		o.add("latencies", lat)
		o.add("start_times", starts)
		o.add("queue_times", queues)
		o.add("generated_texts", texts)
		o.add("errors", errs)
	}
	o.add("max_output_tokens_per_s", m.MaxOutputTokensPerS)
	o.add("max_concurrent_requests", m.MaxConcurrentRequests)
	o.add("rtfx", 0.0)
	for _, spec := range metricSpecs {
		switch spec.key {
		case MetricQueue, MetricE2ELInclQueue:
			if !slices.Contains(c.PercentileMetrics, spec.key) || !r.metricApplies(spec.key) {
				continue
			}
		}
		st := spec.stats(m)
		o.add("mean_"+spec.key+"_ms", jsonFloat(st.Mean))
		o.add("median_"+spec.key+"_ms", jsonFloat(st.Median))
		o.add("std_"+spec.key+"_ms", jsonFloat(st.Std))
		for _, p := range st.Percentiles {
			o.add("p"+percentWord(p.P)+"_"+spec.key+"_ms", jsonFloat(p.Value))
		}
	}
	return o.bytes()
}

// WriteJSON writes MarshalJSONResult(detailed) to w.
func (r *Result) WriteJSON(w io.Writer, detailed bool) error {
	b, err := r.MarshalJSONResult(detailed)
	if err != nil {
		return err
	}
	_, err = w.Write(b)
	return err
}

// DefaultResultFilename is vLLM's
// "{label}-{request_rate}qps[-concurrency{C}]-{base_model_id}-{date}.json".
func (r *Result) DefaultResultFilename() string {
	c := &r.Config
	conc := ""
	if c.MaxConcurrency > 0 {
		conc = fmt.Sprintf("-concurrency%d", c.MaxConcurrency)
	}
	base := r.ModelID
	if i := strings.LastIndexByte(base, '/'); i >= 0 {
		base = base[i+1:]
	}
	date := r.Date
	if date.IsZero() {
		date = time.Now()
	}
	return fmt.Sprintf("%s-%sqps%s-%s-%s.json", c.Label, pyFloat(c.RequestRate), conc, base, date.Format("20060102-150405"))
}

// SaveResult writes the JSON result to dir/filename (vLLM's default name
// when filename is empty; the current directory when dir is empty) and
// returns the path written.
func (r *Result) SaveResult(dir, filename string, detailed bool) (string, error) {
	if filename == "" {
		filename = r.DefaultResultFilename()
	}
	path := filename
	if dir != "" {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return "", err
		}
		path = filepath.Join(dir, filename)
	}
	b, err := r.MarshalJSONResult(detailed)
	if err != nil {
		return "", err
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		return "", err
	}
	return path, nil
}

// Percentile returns the p-th percentile (0..100, numpy linear) in ms of a
// metric ("ttft", "tpot", "itl", "e2el", "client_queue_time",
// "e2el_including_client_queue") over the successful requests, whether or
// not p was among the configured percentiles.
func (r *Result) Percentile(metric string, p float64) float64 {
	for _, spec := range metricSpecs {
		if spec.key == metric {
			return spec.stats(&r.Metrics).At(p)
		}
	}
	return math.NaN()
}
