//go:build !unix

package h1server

import "syscall"

// peekWait returns at once: off unix the connection is simply read.
func peekWait(uintptr) bool { return true }

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
