package proxy

import (
	"context"
	"errors"
	"net"
	"net/http"

	"github.com/switchyard-llm/switchyard/internal/policy"
)

// StatusClientClosed is the status logged (never written) when the client
// went away before the response was complete (nginx's 499).
const StatusClientClosed = 499

// ErrHeaderTimeout is the error reported when an attempt's response headers
// did not arrive in time (RegularOptions.HeaderTimeout). It is retryable.
var ErrHeaderTimeout = errors.New("upstream response header timeout")

// StatusFor maps a dispatch error to the HTTP status for the client; it is
// the single place where that mapping lives:
//
//	policy.ErrNoWorker                    → 503
//	context.Canceled (client went away)   → 499 (logged only, nothing to write)
//	DialError (connect failed)            → 502
//	deadline / idle / header timeout      → 504
//	any other upstream transport error    → 502
//
// Callers replace an attempt's error by the request context's error when
// that context is done, so a dial aborted by the client is a 499 and one cut
// by the request deadline a 504.
func StatusFor(err error) int {
	var ne net.Error
	switch {
	case err == nil:
		return http.StatusOK
	case errors.Is(err, policy.ErrNoWorker):
		return http.StatusServiceUnavailable
	case errors.Is(err, context.Canceled):
		return StatusClientClosed
	case IsDialError(err):
		return http.StatusBadGateway
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, ErrIdleTimeout),
		errors.Is(err, ErrHeaderTimeout):
		return http.StatusGatewayTimeout
	case errors.As(err, &ne) && ne.Timeout():
		return http.StatusGatewayTimeout
	}
	return http.StatusBadGateway
}

// messageFor is the client-facing error message for err.
func messageFor(err error) string {
	switch StatusFor(err) {
	case http.StatusServiceUnavailable:
		return "No available workers (all circuits open or unhealthy)"
	case StatusClientClosed:
		return "client closed request"
	case http.StatusGatewayTimeout:
		return "upstream timeout: " + err.Error()
	}
	if IsDialError(err) {
		return "upstream connect failed: " + err.Error()
	}
	return "upstream request failed: " + err.Error()
}

// errorType is the error_type label of vllm_router_request_errors_total.
func errorType(err error) string {
	switch StatusFor(err) {
	case http.StatusServiceUnavailable:
		return "no_available_workers"
	case StatusClientClosed:
		return "client_canceled"
	case http.StatusGatewayTimeout:
		return "timeout"
	}
	if IsDialError(err) {
		return "connect_failed"
	}
	return "upstream_error"
}
