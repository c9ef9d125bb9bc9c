package bench

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
)

type member struct {
	key     string
	keyJSON []byte
	value   json.RawMessage
}

// parseExtraBody decodes a JSON object keeping its key order.
func parseExtraBody(raw []byte) ([]member, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	tok, err := dec.Token()
	if err != nil {
		return nil, fmt.Errorf("extra body: %w", err)
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return nil, fmt.Errorf("extra body must be a JSON object")
	}
	var out []member
	for dec.More() {
		kt, err := dec.Token()
		if err != nil {
			return nil, fmt.Errorf("extra body: %w", err)
		}
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return nil, fmt.Errorf("extra body: %w", err)
		}
		key := kt.(string)
		replaced := false
		for i := range out {
			if out[i].key == key {
				out[i].value, replaced = v, true
			}
		}
		if !replaced {
			kj, _ := json.Marshal(key)
			out = append(out, member{key: key, keyJSON: kj, value: v})
		}
	}
	if _, err := dec.Token(); err != nil {
		return nil, fmt.Errorf("extra body: %w", err)
	}
	return out, nil
}

// payloadBuilder writes request bodies exactly as vllm bench serve builds
// them (§6.1), in the same key order, then applies ExtraBody like Python's
// dict.update: existing keys keep their position, new keys are appended.
type payloadBuilder struct {
	model     []byte // JSON string
	chat      bool
	logprobs  []byte // JSON value
	ignoreEOS bool
	extra     []member
	extraLen  int
}

func newPayloadBuilder(c *Config, model string) (*payloadBuilder, error) {
	m, err := json.Marshal(model)
	if err != nil {
		return nil, err
	}
	pb := &payloadBuilder{model: m, chat: c.chat(), logprobs: []byte("null"), ignoreEOS: c.IgnoreEOS}
	if c.Logprobs != nil {
		pb.logprobs = strconv.AppendInt(nil, int64(*c.Logprobs), 10)
	}
	if len(c.ExtraBody) > 0 {
		if pb.extra, err = parseExtraBody(c.ExtraBody); err != nil {
			return nil, err
		}
		for _, m := range pb.extra {
			pb.extraLen += len(m.key) + len(m.value) + 4
		}
	}
	return pb, nil
}

type payloadWriter struct {
	b     []byte
	used  []bool
	extra []member
	n     int
}

// key writes the member name k (a plain ASCII key) and, when ExtraBody
// overrides k, its value; the caller writes the default value otherwise.
func (w *payloadWriter) key(k string) (overridden bool) {
	if w.n > 0 {
		w.b = append(w.b, ',')
	}
	w.n++
	w.b = strconv.AppendQuote(w.b, k)
	w.b = append(w.b, ':')
	for i, m := range w.extra {
		if m.key == k {
			w.used[i] = true
			w.b = append(w.b, m.value...)
			return true
		}
	}
	return false
}

func (w *payloadWriter) raw(k string, v []byte) {
	if !w.key(k) {
		w.b = append(w.b, v...)
	}
}

func (w *payloadWriter) int(k string, v int) {
	if !w.key(k) {
		w.b = strconv.AppendInt(w.b, int64(v), 10)
	}
}

// build returns the JSON body for s.
func (pb *payloadBuilder) build(s Sample) []byte {
	w := payloadWriter{b: make([]byte, 0, s.promptBytes()+256+pb.extraLen), extra: pb.extra}
	if len(pb.extra) > 0 {
		w.used = make([]bool, len(pb.extra))
	}
	w.b = append(w.b, '{')
	w.raw("model", pb.model)
	if pb.chat {
		if !w.key("messages") {
			w.b = append(w.b, `[{"role":"user","content":[{"type":"text","text":"`...)
			w.b = s.AppendPrompt(w.b)
			w.b = append(w.b, `"}]}]`...)
		}
		w.int("max_completion_tokens", s.OutputLen)
	} else {
		if !w.key("prompt") {
			w.b = append(w.b, '"')
			w.b = s.AppendPrompt(w.b)
			w.b = append(w.b, '"')
		}
		w.raw("repetition_penalty", []byte("1.0"))
		w.int("max_tokens", s.OutputLen)
		w.raw("logprobs", pb.logprobs)
	}
	w.raw("stream", []byte("true"))
	w.raw("stream_options", []byte(`{"include_usage":true}`))
	if pb.ignoreEOS {
		w.raw("ignore_eos", []byte("true"))
	}
	for i, m := range pb.extra {
		if !w.used[i] {
			w.b = append(w.b, ',')
			w.b = append(w.b, m.keyJSON...)
			w.b = append(w.b, ':')
			w.b = append(w.b, m.value...)
		}
	}
	return append(w.b, '}')
}

// mergeExtraBody combines sampling flags with an --extra-body JSON object
// ({**sampling, **extra_body}, as vllm bench serve does) into one object.
func mergeExtraBody(sampling map[string]any, extraBody string) (json.RawMessage, error) {
	var members []member
	keys := make([]string, 0, len(sampling))
	for k := range sampling {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		v, err := json.Marshal(sampling[k])
		if err != nil {
			return nil, err
		}
		members = append(members, member{key: k, value: v})
	}
	if extraBody != "" {
		extra, err := parseExtraBody([]byte(extraBody))
		if err != nil {
			return nil, err
		}
	next:
		for _, e := range extra {
			for i := range members {
				if members[i].key == e.key {
					members[i].value = e.value
					continue next
				}
			}
			members = append(members, e)
		}
	}
	var b bytes.Buffer
	b.WriteByte('{')
	for i, m := range members {
		if i > 0 {
			b.WriteByte(',')
		}
		k, _ := json.Marshal(m.key)
		b.Write(k)
		b.WriteByte(':')
		b.Write(m.value)
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}
