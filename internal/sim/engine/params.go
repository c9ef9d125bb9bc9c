package engine

import (
	"errors"
	"fmt"
	"time"
)

// Params are one engine's capacity and timing parameters (PROTOCOL §9).
type Params struct {
	MaxNumSeqs          int // running slots (remote-KV waiters hold one too)
	NumBlocks           int // KV blocks per engine
	BlockSize           int // tokens per block
	MaxNumBatchedTokens int // token budget of one step (chunked prefill)
	// PrefixCaching keeps full blocks of finished requests for reuse
	// (vLLM's --enable-prefix-caching).
	PrefixCaching bool
	// SchedulingPolicy is vLLM's --scheduling-policy: PolicyFCFS ("" too)
	// or PolicyPriority.
	SchedulingPolicy string

	PrefillBase     time.Duration // a: fixed cost of a step that carries prefill tokens
	PrefillPerToken time.Duration // b: per prefill token
	// PrefillQuadratic is c in F(L) = a + b·L + c·L², in nanoseconds per
	// token² (attention cost). A chunk [s, e) of one sequence costs
	// c·(e² − s²), so chunking does not change a prompt's total.
	PrefillQuadratic float64
	DecodeStepBase   time.Duration // s0: fixed cost of a step that carries decode tokens
	DecodeStepPerSeq time.Duration // s1: per decoding sequence

	NumLayers       int           // layers a transfer is split over
	KVBytesPerToken int64         // KV size of one token
	KVBandwidth     float64       // bytes per second; 0 means infinite
	TransferBase    time.Duration // x0: fixed cost of one transfer
	HandshakeTime   time.Duration // Hs: first contact with a peer engine
}

// Scheduling policies (vLLM's SchedulingPolicy).
const (
	// PolicyFCFS serves the waiting queue in arrival order and preempts the
	// most recently admitted running request.
	PolicyFCFS = "fcfs"
	// PolicyPriority serves the waiting queue by (priority, arrival), lower
	// priority values first, and preempts the running request with the
	// largest (priority, arrival).
	PolicyPriority = "priority"
)

// Priority reports whether p schedules by request priority.
func (p Params) Priority() bool { return p.SchedulingPolicy == PolicyPriority }

// Validate reports every invalid field.
func (p Params) Validate() error {
	var errs []error
	pos := func(name string, v int) {
		if v < 1 {
			errs = append(errs, fmt.Errorf("%s: must be >= 1, got %d", name, v))
		}
	}
	pos("max-num-seqs", p.MaxNumSeqs)
	pos("num-blocks", p.NumBlocks)
	pos("block-size", p.BlockSize)
	pos("max-num-batched-tokens", p.MaxNumBatchedTokens)
	pos("num-layers", p.NumLayers)
	switch p.SchedulingPolicy {
	case "", PolicyFCFS, PolicyPriority:
	default:
		errs = append(errs, fmt.Errorf("scheduling-policy: %q (want fcfs or priority)", p.SchedulingPolicy))
	}
	nonNeg := func(name string, d time.Duration) {
		if d < 0 {
			errs = append(errs, fmt.Errorf("%s: must be >= 0, got %v", name, d))
		}
	}
	nonNeg("prefill-base", p.PrefillBase)
	nonNeg("prefill-per-token", p.PrefillPerToken)
	if p.PrefillQuadratic < 0 || p.PrefillQuadratic != p.PrefillQuadratic {
		errs = append(errs, fmt.Errorf("prefill-quadratic-ns: must be >= 0, got %g", p.PrefillQuadratic))
	}
	nonNeg("decode-step-base", p.DecodeStepBase)
	nonNeg("decode-step-per-seq", p.DecodeStepPerSeq)
	nonNeg("transfer-base", p.TransferBase)
	nonNeg("handshake-time", p.HandshakeTime)
	if p.KVBytesPerToken < 0 {
		errs = append(errs, fmt.Errorf("kv-bytes-per-token: must be >= 0, got %d", p.KVBytesPerToken))
	}
	if p.KVBandwidth < 0 {
		errs = append(errs, fmt.Errorf("kv-bandwidth: must be >= 0, got %g", p.KVBandwidth))
	}
	return errors.Join(errs...)
}

// Scaled returns p with every simulated duration multiplied by f.
func (p Params) Scaled(f float64) Params {
	s := func(d time.Duration) time.Duration { return time.Duration(float64(d) * f) }
	p.PrefillBase = s(p.PrefillBase)
	p.PrefillPerToken = s(p.PrefillPerToken)
	p.PrefillQuadratic *= f
	p.DecodeStepBase = s(p.DecodeStepBase)
	p.DecodeStepPerSeq = s(p.DecodeStepPerSeq)
	p.TransferBase = s(p.TransferBase)
	p.HandshakeTime = s(p.HandshakeTime)
	if p.KVBandwidth > 0 && f > 0 {
		p.KVBandwidth /= f
	} else if f == 0 {
		p.KVBandwidth = 0
	}
	return p
}

// PrefillTime is F(L) = a + b·L + c·L² for one step prefilling one whole
// prompt of L tokens.
func (p Params) PrefillTime(tokens int) time.Duration {
	return p.prefillStep(tokens, float64(tokens)*float64(tokens))
}

// prefillStep is the prefill part of a step: a + b·(tokens) + c·(Σ e²−s²).
func (p Params) prefillStep(tokens int, quad float64) time.Duration {
	if tokens <= 0 {
		return 0
	}
	return p.PrefillBase + time.Duration(tokens)*p.PrefillPerToken + time.Duration(p.PrefillQuadratic*quad)
}

// StepTime is S(n) = s0 + s1·n for a step carrying n decoding sequences.
func (p Params) StepTime(n int) time.Duration {
	if n <= 0 {
		return 0
	}
	return p.DecodeStepBase + time.Duration(n)*p.DecodeStepPerSeq
}

// TransferTime is X(L) = x0 + L·kv_bytes_per_token/bandwidth.
func (p Params) TransferTime(tokens int) time.Duration {
	x := p.TransferBase
	if p.KVBandwidth > 0 && p.KVBytesPerToken > 0 && tokens > 0 {
		x += time.Duration(float64(tokens) * float64(p.KVBytesPerToken) / p.KVBandwidth * float64(time.Second))
	}
	return x
}

// LayerTransferTime is X(L)/num_layers, the time of one layer's transfer.
func (p Params) LayerTransferTime(tokens int) time.Duration {
	return p.TransferTime(tokens) / time.Duration(max(p.NumLayers, 1))
}

// BlocksFor is ceil(tokens/block_size).
func (p Params) BlocksFor(tokens int) int {
	return (tokens + p.BlockSize - 1) / p.BlockSize
}
