package sim

import (
	"context"
	"io"
	"log"
	"strconv"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/switchyard-llm/switchyard/internal/sim/sidechan"
)

// Registration payloads (PROTOCOL §2.3, §4.1), msgpack maps with vLLM's keys
// in vLLM's order.

// RegistrationNew is the current MoRI-IO heartbeat.
type RegistrationNew struct {
	Type         string `msgpack:"type"`
	HTTPAddress  string `msgpack:"http_address"`
	ZMQAddress   string `msgpack:"zmq_address"`
	DPSize       int    `msgpack:"dp_size"`
	TPSize       int    `msgpack:"tp_size"`
	TransferMode string `msgpack:"transfer_mode"`
}

// RegistrationOld is the early MoRI-IO "register" heartbeat.
type RegistrationOld struct {
	Type           string `msgpack:"type"`
	Role           string `msgpack:"role"`
	Index          string `msgpack:"index"`
	RequestAddress string `msgpack:"request_address"`
	HandshakePort  int    `msgpack:"handshake_port"`
	NotifyPort     int    `msgpack:"notify_port"`
	DPSize         int    `msgpack:"dp_size"`
	TPSize         int    `msgpack:"tp_size"`
	TransferMode   string `msgpack:"transfer_mode"`
}

// RegistrationP2P is P2P-NCCL's heartbeat (also used by the sim's NIXL and
// Mooncake workers, which vLLM does not register over ZMQ).
type RegistrationP2P struct {
	Type        string `msgpack:"type"`
	HTTPAddress string `msgpack:"http_address"`
	ZMQAddress  string `msgpack:"zmq_address"`
}

func (in *Instance) roleLetter() string {
	if in.cfg.Role == RolePrefill {
		return "P"
	}
	return "D"
}

// registrationPayload builds the n-th heartbeat and the DEALER identity.
func (in *Instance) registrationPayload(n int) ([]byte, string) {
	c := &in.cfg
	if c.KVConnector != ConnMoRIIO {
		zmq := in.zmqAddress()
		return sidechan.Encode(RegistrationP2P{Type: in.roleLetter(), HTTPAddress: in.httpAddress(), ZMQAddress: zmq}), zmq
	}
	if c.RegFormat == "old" {
		return sidechan.Encode(RegistrationOld{
			Type: "register", Role: in.roleLetter(), Index: strconv.Itoa(n),
			RequestAddress: "http://" + in.httpAddress() + "/v1/completions",
			HandshakePort:  in.hsBase, NotifyPort: in.notifyBase,
			DPSize: c.DPSize, TPSize: c.TPSize, TransferMode: c.TransferMode,
		}), ""
	}
	return sidechan.Encode(RegistrationNew{
		Type: in.roleLetter(), HTTPAddress: in.httpAddress(), ZMQAddress: in.zmqAddress(),
		DPSize: c.DPSize, TPSize: c.TPSize, TransferMode: c.TransferMode,
	}), ""
}

func (in *Instance) setHeartbeat(on bool) {
	in.heartbeatOn.Store(on)
	select {
	case in.hbWake <- struct{}{}:
	default:
	}
}

// heartbeatLoop is the instance's single registration sender: a DEALER to
// --proxy-address that resends the payload every interval. Like a libzmq
// DEALER it reconnects by itself (fast retry while the router is down) and
// sends at once after (re)connecting, so a restarted router relearns the
// worker quickly.
func (in *Instance) heartbeatLoop(ctx context.Context) {
	const retry = 250 * time.Millisecond
	ep := "tcp://" + in.cfg.ProxyAddress
	var (
		sock   zmq4.Socket
		broken chan struct{}
		rwg    sync.WaitGroup
		n      int
	)
	closeSock := func() {
		if sock != nil {
			_ = sock.Close()
			rwg.Wait()
			sock = nil
			broken = nil
		}
	}
	defer closeSock()
	timer := time.NewTimer(0)
	defer timer.Stop()
	next := time.Now()
	for {
		wait := time.Until(next)
		if in.heartbeatOn.Load() && wait <= 0 {
			payload, identity := in.registrationPayload(n)
			if sock == nil {
				opts := []zmq4.Option{
					zmq4.WithLogger(quietZMQLogger),
					zmq4.WithDialerMaxRetries(0),
					zmq4.WithDialerTimeout(time.Second),
					zmq4.WithTimeout(time.Second),
				}
				if identity != "" {
					opts = append(opts, zmq4.WithID(zmq4.SocketIdentity(identity)))
				}
				s := zmq4.NewDealer(ctx, opts...)
				if err := s.Dial(ep); err != nil {
					_ = s.Close()
					in.log.Debug("registration dial failed", "proxy", in.cfg.ProxyAddress, "err", err)
				} else {
					sock = s
					broken = make(chan struct{})
					rwg.Add(1)
					go func(s zmq4.Socket, b chan struct{}) {
						defer rwg.Done()
						defer close(b)
						for {
							if _, err := s.Recv(); err != nil {
								return
							}
						}
					}(s, broken)
				}
			}
			if sock != nil {
				if err := sock.Send(zmq4.NewMsg(payload)); err != nil {
					in.log.Debug("registration send failed", "err", err)
					closeSock()
				} else {
					n++
					in.ctr.registrationsSent.Add(1)
				}
			}
			if sock != nil {
				next = time.Now().Add(in.cfg.HeartbeatIvl)
			} else {
				next = time.Now().Add(min(retry, in.cfg.HeartbeatIvl))
			}
			wait = time.Until(next)
		}
		if !in.heartbeatOn.Load() {
			wait = time.Hour
		}
		timer.Reset(max(wait, 0))
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		case <-in.hbWake:
			if in.heartbeatOn.Load() {
				next = time.Now()
			}
		case <-broken:
			in.log.Debug("registration connection lost; reconnecting", "proxy", in.cfg.ProxyAddress)
			closeSock()
			next = time.Now()
		}
	}
}

var quietZMQLogger = log.New(io.Discard, "", 0)
