//go:build !linux

package floor

import (
	"context"
	"errors"
	"net"
)

// ServeLoop needs Linux's epoll.
func ServeLoop(ctx context.Context, addr, upstream string, ready func(net.Addr)) error {
	return errors.New("floor: the epoll loop runs on Linux only")
}
