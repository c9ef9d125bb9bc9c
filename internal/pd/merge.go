package pd

import (
	"bytes"
	"encoding/json"
	"strconv"
	"unicode/utf8"

	"github.com/switchyard-llm/switchyard/internal/rawjson"
)

// mergeLogprobs folds the prefill's prompt logprobs into a non-streaming
// decode response (REFERENCE §4.7 with text offsets counted in characters,
// as vLLM does, not UTF-8 bytes). Only touched members are re-encoded; on
// any shape surprise the decode body is returned unchanged.
func mergeLogprobs(kind routeKind, prefill, decode []byte) ([]byte, bool) {
	po, err := rawjson.Parse(prefill)
	if err != nil {
		return decode, false
	}
	do, err := rawjson.Parse(decode)
	if err != nil {
		return decode, false
	}
	switch kind {
	case routeChat:
		if v := po.Get("prompt_logprobs"); isPresent(v) {
			return do.Apply(rawjson.Set("prompt_logprobs", v)), true
		}
		return decode, false
	case routeCompletions:
	default:
		return decode, false
	}
	pcs, ok1 := splitArray(po.Get("choices"))
	dcs, ok2 := splitArray(do.Get("choices"))
	if !ok1 || !ok2 {
		return decode, false
	}
	changed := false
	for i := 0; i < len(pcs) && i < len(dcs); i++ {
		if nc, ok := mergeChoice(pcs[i], dcs[i]); ok {
			dcs[i] = nc
			changed = true
		}
	}
	if !changed {
		return decode, false
	}
	return do.Apply(rawjson.Set("choices", joinArray(dcs))), true
}

func mergeChoice(pRaw, dRaw []byte) ([]byte, bool) {
	pc, err := rawjson.Parse(pRaw)
	if err != nil {
		return nil, false
	}
	dc, err := rawjson.Parse(dRaw)
	if err != nil {
		return nil, false
	}
	var edits []rawjson.Edit
	n := 0
	if v := pc.Get("prompt_logprobs"); isPresent(v) {
		edits = append(edits, rawjson.Set("prompt_logprobs", v))
		if a, ok := splitArray(v); ok {
			n = len(a)
		}
	}
	if n > 0 {
		if e, ok := mergeLogprobObj(pc.Get("logprobs"), dc.Get("logprobs"), n); ok {
			edits = append(edits, e)
		}
	}
	if len(edits) == 0 {
		return nil, false
	}
	return dc.Apply(edits...), true
}

// mergeLogprobObj builds decode.logprobs = prefill prompt part ++ decode.
func mergeLogprobObj(pRaw, dRaw []byte, n int) (rawjson.Edit, bool) {
	if !isObject(pRaw) || !isObject(dRaw) {
		return rawjson.Edit{}, false
	}
	pl, err1 := rawjson.Parse(pRaw)
	dl, err2 := rawjson.Parse(dRaw)
	if err1 != nil || err2 != nil {
		return rawjson.Edit{}, false
	}
	var edits []rawjson.Edit
	for _, k := range []string{"tokens", "token_logprobs", "top_logprobs"} {
		pa, ok1 := splitArray(pl.Get(k))
		da, ok2 := splitArray(dl.Get(k))
		if !ok1 || !ok2 {
			continue
		}
		m := min(n, len(pa))
		edits = append(edits, rawjson.Set(k, joinArray(append(append([][]byte{}, pa[:m]...), da...))))
	}
	pOff, ok1 := intArray(pl.Get("text_offset"))
	dOff, ok2 := intArray(dl.Get("text_offset"))
	if ok1 && ok2 {
		m := min(n, len(pOff))
		out := append([]int64{}, pOff[:m]...)
		var base int64
		if m > 0 {
			base = pOff[m-1]
			if toks, ok := splitArray(pl.Get("tokens")); ok && m-1 < len(toks) {
				var s string
				if json.Unmarshal(toks[m-1], &s) == nil {
					base += int64(utf8.RuneCountInString(s))
				}
			}
		}
		for _, d := range dOff {
			out = append(out, d+base)
		}
		b := []byte{'['}
		for i, v := range out {
			if i > 0 {
				b = append(b, ',')
			}
			b = strconv.AppendInt(b, v, 10)
		}
		edits = append(edits, rawjson.Set("text_offset", append(b, ']')))
	}
	if len(edits) == 0 {
		return rawjson.Edit{}, false
	}
	return rawjson.Set("logprobs", dl.Apply(edits...)), true
}

func isPresent(v []byte) bool { return v != nil && string(v) != "null" }

func isObject(v []byte) bool {
	v = bytes.TrimSpace(v)
	return len(v) > 0 && v[0] == '{'
}

// splitArray returns the raw elements of a JSON array.
func splitArray(v []byte) ([][]byte, bool) {
	v = bytes.TrimSpace(v)
	if len(v) == 0 || v[0] != '[' {
		return nil, false
	}
	var elems []json.RawMessage
	if json.Unmarshal(v, &elems) != nil {
		return nil, false
	}
	out := make([][]byte, len(elems))
	for i, e := range elems {
		out[i] = e
	}
	return out, true
}

func joinArray(elems [][]byte) []byte {
	b := []byte{'['}
	for i, e := range elems {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, e...)
	}
	return append(b, ']')
}

func intArray(v []byte) ([]int64, bool) {
	v = bytes.TrimSpace(v)
	if len(v) == 0 || v[0] != '[' {
		return nil, false
	}
	var out []int64
	if json.Unmarshal(v, &out) != nil {
		return nil, false
	}
	return out, true
}
