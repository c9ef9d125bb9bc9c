// Package sidechan is vllm-sim's P↔D side channel over real ZeroMQ
// (go-zeromq): the notify and handshake ROUTER sockets a MoRI-IO worker
// binds, the DEALER senders that reach a peer's sockets, a small
// request/reply client, and the msgpack messages of PROTOCOL §2.6.
//
// Messages vLLM defines keep vLLM's keys exactly (remote_blocks,
// write_done, release, get_meta_msg). The simulator adds keys prefixed
// "sim_" to carry the prompt digest that stands in for the KV cache, and
// its own message types (sim_read, sim_mooncake_pull) for transfers that
// vLLM does over RDMA/NIXL/Mooncake rather than ZeroMQ.
package sidechan

import (
	"bytes"
	"fmt"
	"strconv"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/switchyard-llm/switchyard/internal/mpread"
)

// Message types.
const (
	TypeRemoteBlocks  = "remote_blocks"
	TypeWriteDone     = "write_done"
	TypeRelease       = "release"
	TypeRead          = "sim_read"
	TypeReadReply     = "sim_read_reply"
	TypeMooncakePull  = "sim_mooncake_pull"
	TypeMooncakeReply = "sim_mooncake_reply"
	// GetMetaMsg is the raw handshake request (not msgpack).
	GetMetaMsg = "get_meta_msg"
)

// RemoteBlocks is D→P in WRITE mode: D's allocated blocks for a transfer.
type RemoteBlocks struct {
	Type            string `msgpack:"type"`
	ReqID           string `msgpack:"req_id"`
	TransferID      string `msgpack:"transfer_id"`
	BlockNotifyList []int  `msgpack:"block_notify_list"`
	DecodeRank      int    `msgpack:"decode_rank"`
}

// WriteDone is P→D in WRITE mode once every layer write finished. SimDigest
// and SimNumTokens are the simulator's KV payload.
type WriteDone struct {
	Type         string `msgpack:"type"`
	TransferID   string `msgpack:"transfer_id"`
	SimDigest    string `msgpack:"sim_digest"`
	SimNumTokens int    `msgpack:"sim_num_tokens"`
}

// Release is D→P: the consumer is done with (or abandoned) P's blocks.
type Release struct {
	Type           string `msgpack:"type"`
	TransferID     string `msgpack:"transfer_id"`
	ConsumerTPSize int    `msgpack:"consumer_tp_size"`
}

// ReadRequest is D→P (simulator RPC on P's handshake socket): read the KV
// of a pinned transfer (MoRI-IO READ, NIXL).
type ReadRequest struct {
	Type       string `msgpack:"type"`
	RPCID      string `msgpack:"rpc_id"`
	TransferID string `msgpack:"transfer_id"`
	BlockIDs   []int  `msgpack:"block_ids"`
}

// MooncakePull is D→P (simulator RPC on P's worker address): D registers
// its blocks for transfer_id; P replies once it has pushed the KV.
type MooncakePull struct {
	Type       string `msgpack:"type"`
	RPCID      string `msgpack:"rpc_id"`
	TransferID string `msgpack:"transfer_id"`
	BlockIDs   []int  `msgpack:"block_ids"`
}

// Reply answers ReadRequest and MooncakePull.
type Reply struct {
	Type         string `msgpack:"type"`
	RPCID        string `msgpack:"rpc_id"`
	OK           bool   `msgpack:"ok"`
	Error        string `msgpack:"error"`
	SimDigest    string `msgpack:"sim_digest"`
	SimNumTokens int    `msgpack:"sim_num_tokens"`
}

// Push is P2P-NCCL's P→D KV push (sent to D's kv_port).
type Push struct {
	Cmd          string `msgpack:"cmd"`
	RequestID    string `msgpack:"request_id"`
	SimDigest    string `msgpack:"sim_digest"`
	SimNumTokens int    `msgpack:"sim_num_tokens"`
}

// AgentMetadata is the first handshake reply (MoRIIOAgentMetadata).
type AgentMetadata struct {
	EngineID         string  `msgpack:"engine_id"`
	AgentMetadata    []byte  `msgpack:"agent_metadata"`
	KVCachesBaseAddr []int64 `msgpack:"kv_caches_base_addr"`
	NumBlocks        int     `msgpack:"num_blocks"`
	BlockLen         int     `msgpack:"block_len"`
	AttnBackendName  string  `msgpack:"attn_backend_name"`
}

// Any is a lenient decoding of every message above. A payload that is not a
// msgpack map decodes as Bare (the older bare transfer-id string format).
type Any struct {
	Type            string `msgpack:"type"`
	Cmd             string `msgpack:"cmd"`
	ReqID           string `msgpack:"req_id"`
	RequestID       string `msgpack:"request_id"`
	TransferID      string `msgpack:"transfer_id"`
	BlockNotifyList []int  `msgpack:"block_notify_list"`
	BlockIDs        []int  `msgpack:"block_ids"`
	DecodeRank      int    `msgpack:"decode_rank"`
	ConsumerTPSize  int    `msgpack:"consumer_tp_size"`
	RPCID           string `msgpack:"rpc_id"`
	OK              bool   `msgpack:"ok"`
	Error           string `msgpack:"error"`
	SimDigest       string `msgpack:"sim_digest"`
	SimNumTokens    int    `msgpack:"sim_num_tokens"`

	Bare string `msgpack:"-"`
}

// Encode marshals v as msgpack with compact integers, as Python's
// msgpack.dumps does.
func Encode(v any) []byte {
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	enc.UseCompactInts(true)
	if err := enc.Encode(v); err != nil {
		// Only our own fixed structs are encoded; this cannot fail.
		return nil
	}
	return buf.Bytes()
}

// Decode parses a side-channel payload leniently.
func Decode(payload []byte) (Any, error) {
	var m Any
	if len(payload) == 0 {
		return m, fmt.Errorf("empty payload")
	}
	if mpread.FamilyOf(payload[0]) != mpread.Map {
		m.Bare = string(payload)
		return m, nil
	}
	if err := checkBounds(payload); err != nil {
		return m, fmt.Errorf("decode msgpack: %w", err)
	}
	if err := msgpack.Unmarshal(payload, &m); err != nil {
		return m, fmt.Errorf("decode msgpack: %w", err)
	}
	return m, nil
}

// FormatDigest renders a digest for the sim_digest field.
func FormatDigest(d uint64) string { return fmt.Sprintf("%016x", d) }

// ParseDigest parses a sim_digest field.
func ParseDigest(s string) (uint64, bool) {
	if s == "" {
		return 0, false
	}
	v, err := strconv.ParseUint(s, 16, 64)
	return v, err == nil
}

func decodeMeta(b []byte, m *AgentMetadata) error {
	if err := checkBounds(b); err != nil {
		return fmt.Errorf("decode handshake metadata: %w", err)
	}
	if err := msgpack.Unmarshal(b, m); err != nil {
		return fmt.Errorf("decode handshake metadata: %w", err)
	}
	return nil
}
