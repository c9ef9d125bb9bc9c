package app

import (
	"fmt"

	"github.com/switchyard-llm/switchyard/internal/discovery/zmq"
	"github.com/switchyard-llm/switchyard/internal/server"
)

// buildZMQ creates the ZMQ self-registration listener
// (--vllm-discovery-address). model, when set (--enable-igw), names each
// instance's model (zmq.Options.Model).
func (a *app) buildZMQ(sopts *server.Options, model func(string) (string, bool)) error {
	cfg := a.cfg
	l, err := zmq.New(zmq.Options{
		Address:   cfg.VLLMDiscoveryAddress,
		Registry:  a.reg,
		Metrics:   a.m,
		Logger:    a.log,
		TTL:       cfg.DiscoveryTTL(),
		Connector: cfg.KVConnector,
		Model:     model,
	})
	if err != nil {
		return fmt.Errorf("--vllm-discovery-address %s: %w", cfg.VLLMDiscoveryAddress, err)
	}
	a.zmq = l
	a.closers = append(a.closers, func() { _ = l.Close() })
	sopts.DiscoveryStatus = func() any { return l.Status() }
	return nil
}
