// Package worker is the one model of an upstream vLLM instance, whatever
// found it: static flags, the admin API, ZMQ self-registration or Kubernetes.
//
// Invariants:
//   - A Worker's Spec is immutable; runtime state (in-flight count, health,
//     breaker, routability) lives in atomics on the Worker.
//   - The Registry publishes an immutable Snapshot through an atomic pointer;
//     a pick reads the snapshot without locks. Membership changes rebuild the
//     snapshot and bump its generation; health changes do not.
//   - A data-parallel instance (dp_size > 1) is expanded into one Worker per
//     rank, all sharing the same Instance key; the rank travels in the
//     X-data-parallel-rank header, never in the URL.
//   - In-flight load is released when the response body finishes, not when
//     headers arrive (Acquire returns the release func).
package worker
