// Package freeport picks loopback TCP ports for child processes that need a
// port number before they start (a router's --port, a vLLM engine's NIXL
// side channel, a ZMQ listener).
//
// A port from bind(":0") is in the kernel's ephemeral range, the same range
// outgoing connections take their local ports from: on a busy machine one
// of them can take the port between the pick and the child's bind. These
// ports are picked below that range, where only listeners live, and each
// is checked free by binding it. A process never hands out a port twice.
package freeport

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
)

// low is the bottom of the range ports are picked from.
const low = 20000

var (
	mu     sync.Mutex
	issued = map[int]bool{}
)

// Pick returns one free port.
func Pick() (int, error) {
	ps, err := PickN(1)
	if err != nil {
		return 0, err
	}
	return ps[0], nil
}

// PickN returns n distinct free ports.
func PickN(n int) ([]int, error) {
	return pick(n, false)
}

// Run returns the first of n consecutive free ports (a vLLM data-parallel
// deployment publishes KV events on base+rank).
func Run(n int) (int, error) {
	ps, err := pick(n, true)
	if err != nil {
		return 0, err
	}
	return ps[0], nil
}

func pick(n int, consecutive bool) ([]int, error) {
	if n <= 0 {
		return nil, nil
	}
	hi := ephemeralLow()
	if hi-low < 1000 {
		return nil, fmt.Errorf("freeport: the ephemeral range starts at %d, leaving no room below it", hi)
	}
	mu.Lock()
	defer mu.Unlock()
	var out []int
	for try := 0; try < 1000 && len(out) < n; try++ {
		if consecutive {
			base := low + rand.IntN(hi-low-n)
			out = out[:0]
			for p := base; p < base+n && usable(p); p++ {
				out = append(out, p)
			}
			continue
		}
		if p := low + rand.IntN(hi-low); !slices.Contains(out, p) && usable(p) {
			out = append(out, p)
		}
	}
	if len(out) != n {
		return nil, fmt.Errorf("freeport: no %d free ports found below %d in 1000 tries", n, hi)
	}
	for _, p := range out {
		issued[p] = true
	}
	return out, nil
}

// usable reports whether p was not handed out before and binds now.
func usable(p int) bool {
	if issued[p] {
		return false
	}
	l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
	if err != nil {
		return false
	}
	_ = l.Close()
	return true
}

// ephemeralLow is the first port of the kernel's ephemeral range (Linux's
// default when it cannot be read).
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 32768
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 32768
	}
	v, err := strconv.Atoi(f[0])
	if err != nil {
		return 32768
	}
	return v
}
