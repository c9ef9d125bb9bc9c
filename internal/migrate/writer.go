package migrate

import (
	"errors"
	"net/http"
	"time"
)

// ErrAnswerEnded stops the relay of a continuation leg whose answer the
// stitcher ended (a stop string completed across the cut).
var ErrAnswerEnded = errors.New("answer ended by the router")

// Writer is the client writer of a migratable stream: it writes only
// complete SSE events (a worker that dies mid-event leaves nothing
// half-written for the continuation to follow), records each in the
// tracker, rewrites a continuation leg's events through its stitcher, and
// holds back an engine's error event (and what follows it) so the answer
// can continue elsewhere instead.
type Writer struct {
	w       http.ResponseWriter
	sp      Splitter
	tr      *Tracker
	rewrite func([]byte) ([]byte, bool) // nil on the original leg
	onFirst func()                      // the leg's first event written
	held    bool                        // an error event was withheld
	ended   bool                        // the stitcher ended the answer
	wrote   bool                        // an event reached the client in this Write
	werr    error
	// run: the original leg's events of this Write not yet written, one
	// slice (they are consecutive in the splitter's buffer): one write
	// through the client writer's layers per read, not per event.
	run []byte
}

// NewWriter wraps the client writer w, recording what it writes into tr.
func NewWriter(w http.ResponseWriter, tr *Tracker) *Writer {
	return &Writer{w: w, tr: tr}
}

func (e *Writer) Header() http.Header { return e.w.Header() }

func (e *Writer) WriteHeader(int) {} // the status line is already out

func (e *Writer) Write(p []byte) (int, error) {
	if e.werr == nil {
		e.sp.FeedBatch(p, e.event, e.writeRun)
	}
	if e.wrote { // one clock read per write, not per event
		e.tr.lastWrite, e.wrote = time.Now(), false
	}
	if e.werr != nil {
		return 0, e.werr
	}
	return len(p), nil
}

func (e *Writer) event(ev []byte) {
	if e.held || e.werr != nil {
		return
	}
	final := false
	if e.rewrite != nil {
		if ev, final = e.rewrite(ev); ev == nil {
			return
		}
	}
	if e.tr.Event(ev); e.tr.ErrorEvent() {
		e.held = true
		return
	}
	if e.rewrite == nil {
		e.addToRun(ev)
		return
	}
	if _, err := e.w.Write(ev); err != nil {
		e.werr = err
		return
	}
	e.wrote = true
	if e.onFirst != nil {
		e.onFirst()
		e.onFirst = nil
	}
	if final {
		done := []byte("data: [DONE]\n\n")
		e.tr.Event(done)
		if _, err := e.w.Write(done); err != nil {
			e.werr = err
			return
		}
		_ = e.FlushError()
		e.ended, e.werr = true, ErrAnswerEnded
	}
}

// addToRun adds ev to the run of events to write: the run grows when ev
// follows it in memory, else the run is written and ev starts the next.
func (e *Writer) addToRun(ev []byte) {
	n := len(e.run)
	if n > 0 && cap(e.run)-n >= len(ev) && &e.run[:n+1][n] == &ev[0] {
		e.run = e.run[:n+len(ev)]
		return
	}
	e.writeRun()
	e.run = ev
}

// writeRun writes the run of events (a FeedBatch done hook).
func (e *Writer) writeRun() {
	if len(e.run) == 0 {
		return
	}
	run := e.run
	e.run = nil
	if e.werr != nil {
		return
	}
	if _, err := e.w.Write(run); err != nil {
		e.werr = err
		return
	}
	e.wrote = true
}

// FlushError flushes the client (http.ResponseController finds it).
func (e *Writer) FlushError() error {
	var err error
	if f, ok := e.w.(interface{ FlushError() error }); ok {
		err = f.FlushError() // directly: one frame less on the deep first flush
	} else {
		err = http.NewResponseController(e.w).Flush()
	}
	if err != nil && !errors.Is(err, http.ErrNotSupported) {
		return err
	}
	return nil
}

// StartLeg resets the writer for a continuation leg.
func (e *Writer) StartLeg(s *Stitcher, onFirst func()) {
	e.sp.Reset()
	e.held = false
	e.tr.ClearError()
	e.rewrite, e.onFirst = s.Rewrite, onFirst
}

// Held reports whether an engine error event was withheld on this leg.
func (e *Writer) Held() bool { return e.held }

// Ended reports whether the stitcher ended the answer.
func (e *Writer) Ended() bool { return e.ended }

// Client is the wrapped client writer.
func (e *Writer) Client() http.ResponseWriter { return e.w }

// Finish ends a leg that ended cleanly: any trailing bytes that did not
// form a complete event are written as they came.
func (e *Writer) Finish() {
	if rest := e.sp.Pending(); len(rest) > 0 && e.werr == nil {
		_, _ = e.w.Write(rest)
		_ = e.FlushError()
	}
	e.sp.Reset()
}
