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
