package sim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/switchyard-llm/switchyard/internal/sim/engine"
	"github.com/switchyard-llm/switchyard/internal/sim/oracle"
	"github.com/switchyard-llm/switchyard/internal/sim/sidechan"
	"github.com/switchyard-llm/switchyard/internal/tokenizer"
)

// Options are the process-level hooks of an Instance.
type Options struct {
	// Logger receives all logs; nil means a text logger on os.Stderr.
	Logger *slog.Logger
	// Exit is called by --crash-after; nil means os.Exit.
	Exit func(code int)
}

// Instance is one running simulated vLLM server.
type Instance struct {
	cfg    Config
	lora   *loraSet             // the LoRA adapters it serves
	tok    *tokenizer.Tokenizer // --tokenizer; nil = the word tokenizer
	params engine.Params        // after --time-scale
	log    *slog.Logger
	exit   func(int)

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup // background goroutines (engines, links, servers)

	engines []*engine.Engine
	links   []*engine.Link // per DP rank: the prefill's serial KV writer

	httpLn  net.Listener
	httpSrv *http.Server
	bootLn  net.Listener
	bootSrv *http.Server

	hsServers     []*sidechan.Server
	notifyServers []*sidechan.Server
	kvServers     []*sidechan.Server
	hsBase        int
	notifyBase    int
	kvBase        int

	pool    *sidechan.Pool
	clients *sidechan.Clients
	hs      *handshakes
	conn    connector

	ctr         counters
	faults      faults
	heartbeatOn atomic.Bool
	rrNext      atomic.Uint64 // DP load balancer: round-robin start for ties
	hbWake      chan struct{}

	created int64
	permID  string

	wordsMu sync.Mutex
	words   map[uint32]string

	// respStore is the Responses API store (--responses-store); nil = off.
	respStore *responseStore

	// kvPubs are the KV event publishers, one per DP rank (--kv-events-config).
	kvPubs []*kvPublisher

	// freshConns are accepted HTTP connections that have not carried a
	// request yet (a client's spare dial). http.Server.Shutdown counts them
	// as active for 5 s, so Close closes them itself.
	freshConns sync.Map // net.Conn -> struct{}

	closeOnce sync.Once
}

// ReadyLine is the JSON object printed on stdout once every socket is bound.
type ReadyLine struct {
	Event         string `json:"event"`
	HTTPAddress   string `json:"http_address"`
	ZMQAddress    string `json:"zmq_address"`
	Role          string `json:"role"`
	KVConnector   string `json:"kv_connector"`
	TransferMode  string `json:"transfer_mode"`
	DPSize        int    `json:"dp_size"`
	TPSize        int    `json:"tp_size"`
	BootstrapPort int    `json:"bootstrap_port"`
}

// Main runs the vllm-sim command: it parses args, starts the instance,
// prints the ready line on stdout and serves until ctx is done.
func Main(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cfg, err := ParseArgs(args, stderr)
	if err != nil {
		if errors.Is(err, ErrHelp) {
			return nil
		}
		return err
	}
	logger := newLogger(stderr, cfg.LogLevel)
	in, err := Start(ctx, cfg, Options{Logger: logger})
	if err != nil {
		return err
	}
	b, _ := json.Marshal(in.Ready())
	if _, err := fmt.Fprintf(stdout, "%s\n", b); err != nil {
		in.Close()
		return fmt.Errorf("write ready line: %w", err)
	}
	usr1 := make(chan os.Signal, 1)
	signal.Notify(usr1, syscall.SIGUSR1)
	defer signal.Stop(usr1)
	for {
		select {
		case <-ctx.Done():
			in.Close()
			return nil
		case <-usr1:
			on := !in.heartbeatOn.Load()
			in.setHeartbeat(on)
			logger.Info("SIGUSR1: heartbeat toggled", "heartbeat", on)
		}
	}
}

func newLogger(w io.Writer, level string) *slog.Logger {
	var l slog.Level
	_ = l.UnmarshalText([]byte(level))
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: l}))
}

// tokenize turns a prompt into ids: with --tokenizer as HuggingFace's
// encode(text, add_special_tokens) does, else one id per white-space word.
func (in *Instance) tokenize(text string, addSpecial bool) []uint32 {
	if in.tok != nil {
		return in.tok.Encode(text, addSpecial)
	}
	return oracle.Tokenize(text)
}

// Start binds every socket and starts serving. Close stops it.
func Start(ctx context.Context, cfg Config, opts Options) (*Instance, error) {
	if err := cfg.Validate(); err != nil {
		return nil, &UsageError{Err: err}
	}
	log := opts.Logger
	if log == nil {
		log = newLogger(os.Stderr, cfg.LogLevel)
	}
	exit := opts.Exit
	if exit == nil {
		exit = os.Exit
	}
	var tok *tokenizer.Tokenizer
	if cfg.Tokenizer != "" {
		t, err := tokenizer.Load(cfg.Tokenizer)
		if err != nil {
			return nil, &UsageError{Err: fmt.Errorf("--tokenizer: %w", err)}
		}
		tok = t
	}
	ictx, cancel := context.WithCancel(ctx)
	in := &Instance{
		tok:     tok,
		cfg:     cfg,
		params:  cfg.Engine.Scaled(cfg.TimeScale),
		log:     log.With("role", cfg.Role),
		exit:    exit,
		ctx:     ictx,
		cancel:  cancel,
		hbWake:  make(chan struct{}, 1),
		created: time.Now().Unix(),
		lora:    newLoRASet(cfg.LoRAModules),
		permID:  randomHex(),
		words:   make(map[uint32]string),
	}
	in.faults = faults{
		failNext: cfg.Faults.FailNext, failStatus: cfg.Faults.FailStatus, crashAfter: cfg.Faults.CrashAfter,
		stallFirstToken: cfg.Faults.StallFirstToken, dropWriteDone: cfg.Faults.DropWriteDone,
		slowFactor: cfg.Faults.SlowFactor, maxWaiting: cfg.Faults.MaxWaiting, failReads: cfg.Faults.FailReads,
		cutAfterTokens: cfg.Faults.CutAfterTokens, crashAfterToks: cfg.Faults.CrashAfterToks,
	}
	in.heartbeatOn.Store(!cfg.Faults.NoHeartbeat)
	if cfg.ResponsesStore {
		in.respStore = newResponseStore(cfg.ResponsesStoreMax)
	}
	in.hs = &handshakes{in: in, m: make(map[string]*hsState)}
	in.pool = sidechan.NewPool(ictx, in.log, 2*time.Second)
	in.pool.OnDrop = func(string, error) { in.ctr.sideChannelDrops.Add(1) }
	in.clients = sidechan.NewClients(ictx, 2*time.Second)
	for range cfg.DPSize {
		in.engines = append(in.engines, engine.New(in.params))
		in.links = append(in.links, engine.NewLink())
	}
	in.applyEngineFaults()
	switch {
	case !cfg.pd():
	case cfg.KVConnector == ConnMoRIIO:
		in.conn = newMoRIIO(in)
	case cfg.KVConnector == ConnNIXL:
		in.conn = newNIXL(in)
	case cfg.KVConnector == ConnMooncake:
		in.conn = newMooncake(in)
	case cfg.KVConnector == ConnP2PNCCL:
		in.conn = newP2P(in)
	}
	if err := in.bind(); err != nil {
		in.Close()
		return nil, err
	}
	if err := in.startKVEvents(); err != nil {
		in.Close()
		return nil, err
	}
	for i := range in.engines {
		e, l := in.engines[i], in.links[i]
		in.goBackground(e.Run)
		in.goBackground(l.Run)
	}
	in.httpSrv = &http.Server{
		Handler:           in.routes(),
		ReadHeaderTimeout: 30 * time.Second,
		IdleTimeout:       5 * time.Minute,
		MaxHeaderBytes:    1 << 20,
		BaseContext:       func(net.Listener) context.Context { return ictx },
		ConnState:         in.trackConn,
		ErrorLog:          slog.NewLogLogger(in.log.Handler(), slog.LevelDebug),
	}
	in.serveHTTP(in.httpSrv, in.httpLn)
	if in.bootSrv != nil {
		in.serveHTTP(in.bootSrv, in.bootLn)
	}
	if cfg.ProxyAddress != "" && cfg.pd() {
		in.goBackground(in.heartbeatLoop)
	}
	in.log.Info("vllm-sim ready", "http", in.httpLn.Addr().String(), "zmq_address", in.zmqAddress(),
		"kv_connector", cfg.KVConnector, "transfer_mode", cfg.TransferMode, "preset", cfg.Preset)
	return in, nil
}

func (in *Instance) serveHTTP(srv *http.Server, ln net.Listener) {
	in.wg.Add(1)
	go func() {
		defer in.wg.Done()
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			in.log.Error("http server stopped", "err", err)
		}
	}()
}

// trackConn remembers connections that have not carried a request yet.
func (in *Instance) trackConn(c net.Conn, st http.ConnState) {
	if st == http.StateNew {
		in.freshConns.Store(c, struct{}{})
	} else {
		in.freshConns.Delete(c)
	}
}

// goBackground runs f on a tracked goroutine with the instance context.
func (in *Instance) goBackground(f func(ctx context.Context)) {
	in.wg.Add(1)
	go func() {
		defer in.wg.Done()
		f(in.ctx)
	}()
}

// Close stops serving and waits for every goroutine.
func (in *Instance) Close() {
	in.closeOnce.Do(func() {
		in.cancel()
		shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		for _, srv := range []*http.Server{in.httpSrv, in.bootSrv} {
			if srv != nil {
				srv.SetKeepAlivesEnabled(false)
			}
		}
		in.freshConns.Range(func(c, _ any) bool {
			_ = c.(net.Conn).Close()
			return true
		})
		for _, srv := range []*http.Server{in.httpSrv, in.bootSrv} {
			if srv != nil {
				if err := srv.Shutdown(shutdownCtx); err != nil {
					_ = srv.Close()
				}
			}
		}
		for _, ln := range []net.Listener{in.httpLn, in.bootLn} {
			if ln != nil {
				_ = ln.Close()
			}
		}
		for _, group := range [][]*sidechan.Server{in.hsServers, in.notifyServers, in.kvServers} {
			for _, s := range group {
				_ = s.Close()
			}
		}
		in.pool.Close()
		in.clients.Close()
		in.closeKVEvents()
		in.wg.Wait()
	})
}

// Ready returns the ready line.
func (in *Instance) Ready() ReadyLine {
	r := ReadyLine{
		Event:       "ready",
		HTTPAddress: in.httpAddress(),
		ZMQAddress:  in.zmqAddress(),
		Role:        in.cfg.Role,
		DPSize:      in.cfg.DPSize,
		TPSize:      in.cfg.TPSize,
	}
	if in.cfg.pd() {
		r.KVConnector = in.cfg.KVConnector
		if in.cfg.KVConnector == ConnMoRIIO {
			r.TransferMode = in.cfg.TransferMode
		}
	}
	if in.bootLn != nil {
		r.BootstrapPort = in.bootLn.Addr().(*net.TCPAddr).Port
	}
	return r
}

// HTTPAddr returns the bound HTTP address ("127.0.0.1:PORT").
func (in *Instance) HTTPAddr() string { return in.httpLn.Addr().String() }

func (in *Instance) httpPort() int { return in.httpLn.Addr().(*net.TCPAddr).Port }

func (in *Instance) httpAddress() string {
	return net.JoinHostPort(in.cfg.AdvertiseHost, strconv.Itoa(in.httpPort()))
}

// zmqAddress is the address advertised in registration and the ready line.
func (in *Instance) zmqAddress() string {
	if !in.cfg.pd() {
		return ""
	}
	ip := in.cfg.AdvertiseHost
	switch in.cfg.KVConnector {
	case ConnMoRIIO:
		return fmt.Sprintf("host:%s,handshake:%d,notify:%d", ip, in.hsBase, in.notifyBase)
	case ConnP2PNCCL:
		return fmt.Sprintf("%s:%d", ip, in.kvBase)
	case ConnMooncake:
		if in.bootLn != nil {
			return fmt.Sprintf("%s:%d", ip, in.bootLn.Addr().(*net.TCPAddr).Port)
		}
	}
	return fmt.Sprintf("%s:%d", ip, in.hsBase)
}

// bind opens every listening socket before anything is announced.
func (in *Instance) bind() error {
	cfg := &in.cfg
	ln, err := net.Listen("tcp", net.JoinHostPort(cfg.Host, strconv.Itoa(cfg.Port)))
	if err != nil {
		return fmt.Errorf("listen on --host %s --port %d: %w", cfg.Host, cfg.Port, err)
	}
	in.httpLn = ln
	if !cfg.pd() {
		return nil
	}
	n := cfg.portSpan()
	needHS := true // MoRI-IO, NIXL and Mooncake have a handshake/side-channel socket
	if cfg.KVConnector == ConnP2PNCCL {
		needHS = false
	}
	if needHS {
		in.hsServers, in.hsBase, err = in.bindRange("handshake-port", cfg.HandshakePort, n, in.handshakeHandler)
		if err != nil {
			return err
		}
	}
	if cfg.KVConnector == ConnMoRIIO {
		in.notifyServers, in.notifyBase, err = in.bindRange("notify-port", cfg.NotifyPort, n, in.notifyHandler)
		if err != nil {
			return err
		}
	}
	if cfg.KVConnector == ConnP2PNCCL {
		in.kvServers, in.kvBase, err = in.bindRange("kv-port", cfg.KVPort, n, in.kvHandler)
		if err != nil {
			return err
		}
	}
	if cfg.KVConnector == ConnMooncake && cfg.Role == RolePrefill {
		bl, err := net.Listen("tcp", net.JoinHostPort(cfg.Host, strconv.Itoa(cfg.BootstrapPort)))
		if err != nil {
			return fmt.Errorf("listen on --bootstrap-port %d: %w", cfg.BootstrapPort, err)
		}
		in.bootLn = bl
		in.bootSrv = &http.Server{
			Handler:           in.conn.(*mooncake).bootstrapHandler(),
			ReadHeaderTimeout: 10 * time.Second,
			BaseContext:       func(net.Listener) context.Context { return in.ctx },
			ConnState:         in.trackConn,
		}
	}
	return nil
}

// Where bindRange looks for a free run of ports first.
const runPortLow, runPortHigh = 20000, 32000

// bindRange binds n ROUTER sockets on consecutive ports from base (0 =
// find a free run of ports).
func (in *Instance) bindRange(flagName string, base, n int, mk func(offset int) sidechan.Handler) ([]*sidechan.Server, int, error) {
	closeAll := func(ss []*sidechan.Server) {
		for _, s := range ss {
			_ = s.Close()
		}
	}
	for attempt := 0; attempt < 200; attempt++ {
		var servers []*sidechan.Server
		start := base
		if base == 0 && n > 1 && attempt%2 == 0 {
			// A run starting at an ephemeral port often finds the next
			// port taken by an outgoing connection on a busy machine, so
			// every other try starts below Linux's ephemeral range
			// (32768-60999 by default).
			start = runPortLow + rand.IntN(runPortHigh-runPortLow-n)
		}
		first, err := sidechan.Listen(in.ctx, in.cfg.Host, start, mk(0))
		if err != nil {
			if base != 0 {
				return nil, 0, fmt.Errorf("bind --%s %d: %w", flagName, base, err)
			}
			continue
		}
		servers = append(servers, first)
		b := first.Port()
		ok := true
		for o := 1; o < n; o++ {
			if b+o > 65535 {
				ok = false
				break
			}
			s, err := sidechan.Listen(in.ctx, in.cfg.Host, b+o, mk(o))
			if err != nil {
				if base != 0 {
					closeAll(servers)
					return nil, 0, fmt.Errorf("bind --%s %d+%d: %w", flagName, base, o, err)
				}
				ok = false
				break
			}
			servers = append(servers, s)
		}
		if ok {
			return servers, b, nil
		}
		closeAll(servers)
	}
	return nil, 0, fmt.Errorf("bind --%s: no free run of %d consecutive ports", flagName, n)
}

func (in *Instance) applyEngineFaults() {
	in.faults.mu.Lock()
	slow, mw := in.faults.slowFactor, in.faults.maxWaiting
	in.faults.mu.Unlock()
	for _, e := range in.engines {
		e.SetSlowFactor(slow)
		e.SetMaxWaiting(mw)
	}
}

func (in *Instance) pendingTransfers() int {
	if in.conn == nil {
		return 0
	}
	return in.conn.pending()
}

// Side-channel dispatch: the connector decides what each socket accepts.

type sideHandler interface {
	onHandshakeSocket(offset int, payload []byte, reply func([]byte) error)
	onNotifySocket(offset int, payload []byte)
	onKVSocket(offset int, payload []byte)
}

func (in *Instance) handshakeHandler(offset int) sidechan.Handler {
	port := func() int { return in.hsBase + offset }
	return func(_ []byte, payload []byte, reply func([]byte) error) {
		if string(payload) == sidechan.GetMetaMsg {
			in.ctr.handshakesServed.Add(1)
			in.ctr.notePort(sidechan.GetMetaMsg, port())
			if err := sidechan.ServeHandshake(in.agentMetadata(offset), in.layerDescs(), reply); err != nil {
				in.log.Warn("handshake reply failed", "err", err)
			}
			return
		}
		if sh, ok := in.conn.(sideHandler); ok {
			sh.onHandshakeSocket(offset, payload, reply)
		}
	}
}

func (in *Instance) notifyHandler(offset int) sidechan.Handler {
	return func(_ []byte, payload []byte, _ func([]byte) error) {
		if sh, ok := in.conn.(sideHandler); ok {
			sh.onNotifySocket(offset, payload)
		}
	}
}

func (in *Instance) kvHandler(offset int) sidechan.Handler {
	return func(_ []byte, payload []byte, _ func([]byte) error) {
		if sh, ok := in.conn.(sideHandler); ok {
			sh.onKVSocket(offset, payload)
		}
	}
}

// engineID is MoRI-IO's "<host_ip>:<handshake_base>".
func (in *Instance) engineID() string {
	return net.JoinHostPort(in.cfg.AdvertiseHost, strconv.Itoa(in.hsBase))
}

func (in *Instance) agentMetadata(offset int) sidechan.AgentMetadata {
	p := in.cfg.Engine
	return sidechan.AgentMetadata{
		EngineID:         in.engineID(),
		AgentMetadata:    []byte(fmt.Sprintf("vllm-sim agent %s dp%d", in.engineID(), in.cfg.rankForOffset(offset))),
		KVCachesBaseAddr: []int64{int64(1) << 40},
		NumBlocks:        p.NumBlocks,
		BlockLen:         p.BlockSize * int(p.KVBytesPerToken) / max(p.NumLayers, 1),
		AttnBackendName:  "VLLM_SIM",
	}
}

func (in *Instance) layerDescs() map[string][][]byte {
	n := min(in.cfg.Engine.NumLayers, 4)
	m := make(map[string][][]byte, n)
	for i := range n {
		m[fmt.Sprintf("model.layers.%d.self_attn.attn", i)] = [][]byte{[]byte("simdesc")}
	}
	return m
}
