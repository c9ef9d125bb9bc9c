//go:build !unix

package h1server

import "syscall"

// readNow reads nothing off unix: the connection's next read does.
func readNow(uintptr, []byte) (int, bool) { return 0, false }

type peekResult int

const (
	peekAlive peekResult = iota
	peekData
	peekGone
)

// peek cannot look at a connection off unix; reporting data stops the watch.
func peek(syscall.RawConn) peekResult { return peekData }

// peekNow cannot look either.
func peekNow(syscall.RawConn) peekResult { return peekData }
