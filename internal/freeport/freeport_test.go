package freeport

import (
	"fmt"
	"net"
	"testing"
)

func TestPickN(t *testing.T) {
	hi := ephemeralLow()
	seen := map[int]bool{}
	for range 20 {
		ps, err := PickN(5)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range ps {
			if p < low || p >= hi {
				t.Fatalf("port %d outside [%d, %d)", p, low, hi)
			}
			if seen[p] {
				t.Fatalf("port %d handed out twice", p)
			}
			seen[p] = true
			l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p))
			if err != nil {
				t.Fatalf("picked port %d does not bind: %v", p, err)
			}
			l.Close()
		}
	}
}

func TestPickSkipsBoundPorts(t *testing.T) {
	// Hold a whole run of ports; a consecutive pick never overlaps it.
	base, err := Run(50)
	if err != nil {
		t.Fatal(err)
	}
	var held []net.Listener
	for p := base; p < base+50; p++ {
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p))
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, l)
	}
	defer func() {
		for _, l := range held {
			l.Close()
		}
	}()
	// As if another process had picked them: only the bind check guards them.
	for p := base; p < base+50; p++ {
		delete(issued, p)
	}
	for range 500 {
		p, err := Pick()
		if err != nil {
			t.Fatal(err)
		}
		if p >= base && p < base+50 {
			t.Fatalf("picked %d, which is bound", p)
		}
	}
	b2, err := Run(3)
	if err != nil {
		t.Fatal(err)
	}
	for p := b2; p < b2+3; p++ {
		if p >= base && p < base+50 {
			t.Fatalf("run %d..%d overlaps the bound ports", b2, b2+2)
		}
	}
}
