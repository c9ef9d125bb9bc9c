//go:build !linux

package h1server

// poller is Linux's epoll watch; elsewhere the watches use their timers.
type poller struct{}

func newPoller() *poller          { return nil }
func (*poller) stop()             {}
func (*poller) add(*watch) bool   { return false }
func (*poller) rearm(*watch) bool { return false }
func (*poller) remove(*watch)     {}
