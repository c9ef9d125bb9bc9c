package proxy

import (
	"context"
	"errors"
	"io"
	"log"
	"net"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/h1server"
)

// A context that cannot take the deadline, the value or the hook in place
// gets them from the context package, with the same behaviour.
func TestRequestContextHelpersOnPlainContext(t *testing.T) {
	type key struct{}
	parent, cancelParent := context.WithCancel(context.Background())
	defer cancelParent()

	vctx := withValue(parent, key{}, 7)
	if vctx == parent || vctx.Value(key{}) != 7 {
		t.Fatalf("withValue on a plain context: same=%v value=%v", vctx == parent, vctx.Value(key{}))
	}

	dctx, cancel := WithRequestDeadline(parent, time.Now().Add(20*time.Millisecond))
	defer cancel()
	if _, ok := dctx.Deadline(); !ok {
		t.Fatal("WithRequestDeadline on a plain context set no deadline")
	}
	select {
	case <-dctx.Done():
	case <-time.After(2 * time.Second):
		t.Fatal("deadline did not end the context")
	}
	if !errors.Is(dctx.Err(), context.DeadlineExceeded) {
		t.Errorf("Err = %v, want DeadlineExceeded", dctx.Err())
	}

	var a abortOnDone
	var ran atomic.Int32
	a.set(parent, func() { ran.Add(1) })
	if !a.release() {
		t.Error("release before the end reported the function ran")
	}
	var b abortOnDone
	fired := make(chan struct{})
	b.set(parent, func() { ran.Add(1); close(fired) })
	cancelParent()
	<-fired
	if b.release() {
		t.Error("release after the end reported it stopped the function")
	}
	if n := ran.Load(); n != 1 {
		t.Errorf("functions ran %d times, want 1 (the released one must not)", n)
	}
}

// On the router's own server the request context takes the deadline, the
// request state and the abort hook in place, and they behave as the
// context package's would.
func TestRequestContextHelpersInPlace(t *testing.T) {
	type key struct{}
	type result struct {
		sameValue, sameDeadline bool
		value                   any
		err                     error
		hookRan                 bool
	}
	got := make(chan result, 1)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		var res result
		vctx := withValue(ctx, key{}, 7)
		res.sameValue, res.value = vctx == ctx, vctx.Value(key{})
		dctx, cancel := WithRequestDeadline(vctx, time.Now().Add(30*time.Millisecond))
		defer cancel()
		res.sameDeadline = dctx == ctx
		var a abortOnDone
		hook := make(chan struct{})
		a.set(dctx, func() { close(hook) })
		select {
		case <-dctx.Done():
			res.err = dctx.Err()
		case <-time.After(2 * time.Second):
		}
		select {
		case <-hook:
			res.hookRan = true
		case <-time.After(2 * time.Second):
		}
		got <- res
	})
	s := &h1server.Server{Handler: h, ErrorLog: log.New(io.Discard, "", 0)}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go s.Serve(l)
	defer s.Close()
	resp, err := http.Get("http://" + l.Addr().String() + "/")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	http.DefaultClient.CloseIdleConnections()
	res := <-got
	if !res.sameValue || res.value != 7 {
		t.Errorf("value: in place %v, value %v; want in place, 7", res.sameValue, res.value)
	}
	if !res.sameDeadline {
		t.Error("the deadline was not taken in place")
	}
	if !errors.Is(res.err, context.DeadlineExceeded) {
		t.Errorf("Err at the deadline = %v, want DeadlineExceeded", res.err)
	}
	if !res.hookRan {
		t.Error("the abort hook did not run when the deadline ended the request")
	}
}
