package migrate

import (
	"errors"
	"net/http/httptest"
	"strings"
	"testing"
)

// TestWriter: the client sees whole events only, an engine error event
// (and what follows it) is held back, a leg's Finish writes trailing bytes,
// and a continuation leg goes through its stitcher.
func TestWriter(t *testing.T) {
	rec := httptest.NewRecorder()
	tr := NewTracker()
	w := NewWriter(rec, tr)
	first := sse(false, cmplChunk(" a", ""), cmplChunk(" b", ""))
	half := "data: " + cmplChunk(" c", "")[:20]
	for _, part := range []string{first[:10], first[10:], half} {
		if n, err := w.Write([]byte(part)); err != nil || n != len(part) {
			t.Fatalf("Write = %d, %v", n, err)
		}
	}
	if rec.Body.String() != first || tr.Text() != " a b" {
		t.Fatalf("client got %q (tracker %q), want only the whole events", rec.Body.String(), tr.Text())
	}
	// A continuation leg: the half event is dropped, the stitcher rewrites.
	req := NewRequest("/v1/completions", []byte(`{"prompt":"p","stream":true}`))
	w.StartLeg(NewStitcher(req, tr), nil)
	_, _ = w.Write([]byte(strings.ReplaceAll(sse(false, cmplChunk(" c", "")), "cmpl-a", "cmpl-new")))
	if got := rec.Body.String()[len(first):]; !strings.Contains(got, `"cmpl-a"`) || strings.Contains(got, "cmpl-new") || tr.Text() != " a b c" {
		t.Errorf("continuation written as %q", got)
	}
	// An engine error event is held back, with the [DONE] after it.
	before := rec.Body.Len()
	_, _ = w.Write([]byte(sse(true, `{"error":{"message":"boom","code":500}}`)))
	if rec.Body.Len() != before || !w.Held() || !tr.ErrorEvent() {
		t.Errorf("error event reached the client: %q", rec.Body.String()[before:])
	}
	// A new leg clears the hold; a clean end writes a trailing partial event.
	w.StartLeg(NewStitcher(req, tr), nil)
	if w.Held() || tr.ErrorEvent() {
		t.Fatal("StartLeg kept the hold")
	}
	_, _ = w.Write([]byte("data: [DONE]\n"))
	w.Finish()
	if !strings.HasSuffix(rec.Body.String(), "data: [DONE]\n") {
		t.Errorf("trailing bytes not written on Finish: %q", rec.Body.String())
	}
}

// TestWriterStopAcrossCut: the stitcher ends the answer; the writer adds
// [DONE] and refuses more bytes (the relay stops reading the leg).
func TestWriterStopAcrossCut(t *testing.T) {
	rec := httptest.NewRecorder()
	tr := NewTracker()
	w := NewWriter(rec, tr)
	_, _ = w.Write([]byte(sse(false, cmplChunk(" say E", ""))))
	req := NewRequest("/v1/completions", []byte(`{"prompt":"p","stream":true,"stop":"END"}`))
	w.StartLeg(NewStitcher(req, tr), nil)
	_, err := w.Write([]byte(sse(false, cmplChunk("ND of it", ""), cmplChunk(" more", ""))))
	if !errors.Is(err, ErrAnswerEnded) || !w.Ended() {
		t.Fatalf("Write = %v, ended %v", err, w.Ended())
	}
	body := rec.Body.String()
	if !strings.HasSuffix(body, "data: [DONE]\n\n") || strings.Contains(body, "more") || !strings.Contains(body, `"stop_reason":"END"`) {
		t.Errorf("stream %q", body)
	}
	if !tr.Done() || tr.Finished() != "stop" {
		t.Errorf("tracker done %v finish %q", tr.Done(), tr.Finished())
	}
}

func BenchmarkTrackerEvent(b *testing.B) {
	ev := []byte("data: " + cmplChunk(" word", "") + "\n\n")
	tr := NewTracker()
	b.ReportAllocs()
	for b.Loop() {
		tr.Event(ev)
	}
}

// countingWriter records each Write the migration writer makes.
type countingWriter struct {
	*httptest.ResponseRecorder
	writes []string
	fail   bool
}

func (c *countingWriter) Write(p []byte) (int, error) {
	if c.fail {
		return 0, errors.New("client gone")
	}
	c.writes = append(c.writes, string(p))
	return c.ResponseRecorder.Write(p)
}

// TestWriterOneWritePerRead: the original leg's whole events of one Write
// reach the client writer as one write (also when the first of them began
// in an earlier Write), the events before an engine error event are
// written and the rest held, and a failed write ends the leg.
func TestWriterOneWritePerRead(t *testing.T) {
	a, b, c, d := cmplChunk(" a", ""), cmplChunk(" b", ""), cmplChunk(" c", ""), cmplChunk(" d", "")
	three := sse(false, a, b, c)
	cw := &countingWriter{ResponseRecorder: httptest.NewRecorder()}
	tr := NewTracker()
	w := NewWriter(cw, tr)
	if _, err := w.Write([]byte(three)); err != nil {
		t.Fatal(err)
	}
	if len(cw.writes) != 1 || cw.writes[0] != three {
		t.Fatalf("three events in one read: writes %q", cw.writes)
	}
	// An event split across reads: the second read's events go as one.
	next := sse(false, d, a, b)
	_, _ = w.Write([]byte(next[:7]))
	_, _ = w.Write([]byte(next[7:]))
	if len(cw.writes) != 2 || cw.writes[1] != next {
		t.Fatalf("split read: writes %q", cw.writes)
	}
	// An engine error event: the events before it go out, it and the rest are held.
	held := sse(false, c, `{"error":{"message":"boom","code":500}}`, d)
	_, _ = w.Write([]byte(held))
	if want := sse(false, c); len(cw.writes) != 3 || cw.writes[2] != want || !w.Held() {
		t.Fatalf("error event: writes %q, held %v", cw.writes, w.Held())
	}
	if got, want := cw.Body.String(), three+next+sse(false, c); got != want || tr.Text() != " a b c d a b c" {
		t.Fatalf("client got %q (tracker %q), want %q", got, tr.Text(), want)
	}
	// A client that went away ends the leg with its error.
	w2 := NewWriter(&countingWriter{ResponseRecorder: httptest.NewRecorder(), fail: true}, NewTracker())
	if n, err := w2.Write([]byte(three)); err == nil || n != 0 {
		t.Fatalf("Write to a failed client = %d, %v", n, err)
	}
}
