// Package discovery is where worker sources meet the registry. Each source
// (the ZMQ self-registration listener in discovery/zmq, Kubernetes in
// discovery/k8s) writes into a *worker.Registry through its public API and
// runs until its context is cancelled.
package discovery

import "context"

// Source is a running worker source. Run blocks until ctx is cancelled (or
// the source is closed) and returns nil then; it returns an error only when
// the source cannot continue. Startup failures such as a bind error belong in
// the source's constructor, so the application fails before it serves.
type Source interface {
	Run(ctx context.Context) error
}
