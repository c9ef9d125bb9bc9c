// Package k8s is the Kubernetes pod discovery source (--service-discovery).
//
// It watches pods with shared informers whose label selectors are applied
// by the API server (one informer per role selector in PD mode), and keeps
// the worker.Registry equal to the set of selected pods that are Running,
// Ready, not terminating and have an IP. It fixes the Rust router's
// weaknesses (REFERENCE §5.3, §10.2 item 19): no client-side filtering of
// every pod in the cluster, delete events (including tombstones) are seen,
// pods are tracked by namespace/name rather than by their whole state,
// NotReady pods leave the registry, and event handlers never wait for a
// worker's health: they only update the registry (the health checker probes
// new workers on its own).
//
// This is the only package that imports k8s.io.
package k8s

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	coreinformers "k8s.io/client-go/informers/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/switchyard-llm/switchyard/internal/discovery"
	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// Defaults.
const (
	// DefaultBootstrapPortAnnotation carries a prefill pod's Mooncake
	// bootstrap port (as in the Rust router).
	DefaultBootstrapPortAnnotation = "vllm.ai/bootstrap-port"
	// KVEventsPortAnnotation carries the port of a pod's KV event
	// publisher (vLLM --kv-events-config endpoint) for the kv_aware
	// policy; without it the router's --kv-events-port applies.
	KVEventsPortAnnotation = "vllm.ai/kv-events-port"
	// ModelAnnotation names the model a pod serves (--enable-igw, with
	// Options.Models); a label of the same name is read when the
	// annotation is absent (label values cannot hold a "/", annotations
	// can: "Qwen/Qwen3-8B").
	ModelAnnotation = "vllm.ai/model"
	// DefaultDPSizeAnnotation carries a pod's data-parallel size.
	DefaultDPSizeAnnotation = "vllm.ai/dp-size"
	// DefaultResync re-delivers every watched pod this often, which also
	// retries pods skipped because of a worker key conflict.
	DefaultResync = 5 * time.Minute
	// DefaultSyncTimeout bounds Run's wait for the initial pod lists. The
	// informers keep retrying afterwards; Status reports synced=false.
	DefaultSyncTimeout = 30 * time.Second
	// MaxDPSize bounds the data-parallel size a pod annotation may ask for.
	MaxDPSize = 1024
)

// Options configure a Source. Clientset and Registry are required, and
// Selector (regular mode) or at least one of PrefillSelector and
// DecodeSelector (PD mode) must be non-empty.
type Options struct {
	// Clientset is the Kubernetes API client; tests pass
	// k8s.io/client-go/kubernetes/fake. NewClientset builds the real one.
	Clientset kubernetes.Interface
	// Namespace to watch; "" watches every namespace.
	Namespace string
	// Selector selects the worker pods in regular mode.
	Selector map[string]string
	// PrefillSelector and DecodeSelector select the pods of each role in
	// PD mode. A pod matching both is a prefill (as in the Rust router).
	PrefillSelector map[string]string
	DecodeSelector  map[string]string
	// PD selects PD mode (prefill/decode selectors) over regular mode.
	PD bool
	// Models is the multi-model mode (--enable-igw): every pod names its
	// model (ModelAnnotation) and its Workers carry it as ModelID; a pod
	// naming none is not routed. The regular, prefill and decode selectors
	// may all be set (a pod several select is a prefill, else a decode,
	// else regular). PD is ignored.
	Models bool
	// Model, in multi-model mode, names the model of a pod that names none
	// (the caller asks the pod's /v1/models in the background); it gets the
	// pod's host:port and must not block. While it answers false the pod is
	// not routed (model_pending); call Refresh when it may answer. Nil =
	// such a pod is not routed (no_model).
	Model func(hostPort string) (model string, ok bool)
	// Port is the workers' HTTP port (--service-discovery-port).
	Port int
	// BootstrapPortAnnotation names the prefill pods' Mooncake bootstrap
	// port annotation; "" means DefaultBootstrapPortAnnotation.
	BootstrapPortAnnotation string
	// DPSizeAnnotation names the pods' data-parallel size annotation; ""
	// means DefaultDPSizeAnnotation.
	DPSizeAnnotation string
	// DefaultDPSize is the data-parallel size of a pod without the
	// annotation (--intra-node-data-parallel-size); < 1 means 1.
	DefaultDPSize int
	Registry      *worker.Registry
	Metrics       *metrics.Metrics // nil: no metrics
	// Logger receives the source's logs; nil discards them. The first
	// non-nil Logger given to New also receives client-go's klog output.
	Logger *slog.Logger
	// Resync is the informers' resync period; 0 means DefaultResync and a
	// negative value disables resyncs.
	Resync time.Duration
	// SyncTimeout bounds the wait for the initial lists; 0 means
	// DefaultSyncTimeout.
	SyncTimeout time.Duration
}

// watcher is one informer: the pods of one role selector.
type watcher struct {
	idx      int
	role     worker.Role
	selector labels.Selector
	informer cache.SharedIndexInformer
}

// Source is the Kubernetes pod discovery source.
type Source struct {
	opts     Options
	log      *slog.Logger
	watchers []*watcher

	mu        sync.Mutex
	pods      map[string]*podState // by namespace/name
	conflicts int                  // pods currently skipped for a key conflict
	lastErr   string
	lastErrAt time.Time

	hasConflicts atomic.Bool
	synced       atomic.Bool
	running      atomic.Bool
	kick         chan struct{}
}

var _ discovery.Source = (*Source)(nil)

var klogOnce sync.Once

// New validates opts and builds the informers. It starts nothing: Run does.
func New(opts Options) (*Source, error) {
	errs := opts.normalize()
	sels, serrs := opts.roleSelectors()
	errs = append(errs, serrs...)
	selectors := make([]labels.Selector, 0, len(sels))
	for _, rs := range sels {
		sel, err := labels.ValidatedSelectorFromSet(rs.set)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", rs.flag, err))
		}
		selectors = append(selectors, sel)
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("kubernetes discovery: %w", err)
	}

	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	} else {
		klogOnce.Do(func() { routeKlog(opts.Logger) })
	}
	s := &Source{
		opts: opts, log: log,
		pods: map[string]*podState{},
		kick: make(chan struct{}, 1),
	}
	for i, rs := range sels {
		if err := s.addWatcher(i, rs.role, selectors[i]); err != nil {
			return nil, fmt.Errorf("kubernetes discovery: %w", err)
		}
	}
	if (opts.PD || opts.Models) && len(opts.PrefillSelector) > 0 && maps.Equal(opts.PrefillSelector, opts.DecodeSelector) {
		log.Warn("kubernetes discovery: the prefill and decode selectors are equal; every selected pod is a prefill")
	}
	return s, nil
}

// normalize fills in the defaults and reports what is missing or out of
// range (the selectors aside).
func (opts *Options) normalize() []error {
	var errs []error
	if opts.Clientset == nil {
		errs = append(errs, errors.New("a Kubernetes clientset is required"))
	}
	if opts.Registry == nil {
		errs = append(errs, errors.New("a registry is required"))
	}
	if opts.Port < 1 || opts.Port > 65535 {
		errs = append(errs, fmt.Errorf("port %d: must be between 1 and 65535", opts.Port))
	}
	if opts.BootstrapPortAnnotation == "" {
		opts.BootstrapPortAnnotation = DefaultBootstrapPortAnnotation
	}
	if opts.DPSizeAnnotation == "" {
		opts.DPSizeAnnotation = DefaultDPSizeAnnotation
	}
	opts.DefaultDPSize = max(opts.DefaultDPSize, 1)
	if opts.DefaultDPSize > MaxDPSize {
		errs = append(errs, fmt.Errorf("default DP size %d exceeds %d", opts.DefaultDPSize, MaxDPSize))
	}
	switch {
	case opts.Resync == 0:
		opts.Resync = DefaultResync
	case opts.Resync < 0:
		opts.Resync = 0
	}
	if opts.SyncTimeout <= 0 {
		opts.SyncTimeout = DefaultSyncTimeout
	}
	return errs
}

// roleSel is one role's label selector and the flag that set it.
type roleSel struct {
	role worker.Role
	flag string
	set  map[string]string
}

// roleSelectors are the selectors the mode watches, one informer each,
// and what the mode's selectors lack or must not have.
func (opts *Options) roleSelectors() ([]roleSel, []error) {
	var sels []roleSel
	var errs []error
	switch {
	case opts.Models:
		if len(opts.Selector) == 0 && len(opts.PrefillSelector) == 0 && len(opts.DecodeSelector) == 0 {
			errs = append(errs, errors.New("multi-model mode needs a non-empty selector, prefill selector or decode selector"))
		}
		for _, rs := range []roleSel{
			{worker.RolePrefill, "prefill selector", opts.PrefillSelector},
			{worker.RoleDecode, "decode selector", opts.DecodeSelector},
			{worker.RoleRegular, "selector", opts.Selector},
		} {
			if len(rs.set) > 0 {
				sels = append(sels, rs)
			}
		}
	case opts.PD:
		if len(opts.Selector) > 0 {
			errs = append(errs, errors.New("PD mode uses the prefill and decode selectors, not the regular selector"))
		}
		if len(opts.PrefillSelector) == 0 && len(opts.DecodeSelector) == 0 {
			errs = append(errs, errors.New("PD mode needs a non-empty prefill or decode selector"))
		}
		if len(opts.PrefillSelector) > 0 {
			sels = append(sels, roleSel{worker.RolePrefill, "prefill selector", opts.PrefillSelector})
		}
		if len(opts.DecodeSelector) > 0 {
			sels = append(sels, roleSel{worker.RoleDecode, "decode selector", opts.DecodeSelector})
		}
	default:
		if len(opts.PrefillSelector) > 0 || len(opts.DecodeSelector) > 0 {
			errs = append(errs, errors.New("prefill and decode selectors need PD mode"))
		}
		if len(opts.Selector) == 0 {
			errs = append(errs, errors.New("regular mode needs a non-empty selector"))
		}
		sels = append(sels, roleSel{worker.RoleRegular, "selector", opts.Selector})
	}
	return sels, errs
}

// addWatcher builds watcher i: a pod informer for role's selector.
func (s *Source) addWatcher(i int, role worker.Role, selector labels.Selector) error {
	sel := selector.String()
	// A shared pod informer per selector (not a SharedInformerFactory:
	// the factory links every API group's informers into the binary).
	inf := coreinformers.NewFilteredPodInformer(s.opts.Clientset, s.opts.Namespace, s.opts.Resync, cache.Indexers{},
		func(o *metav1.ListOptions) { o.LabelSelector = sel })
	w := &watcher{idx: i, role: role, selector: selector, informer: inf}
	if err := errors.Join(
		inf.SetTransform(slimPod),
		inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
			s.watchError(w, err)
		}),
	); err != nil {
		return err
	}
	s.watchers = append(s.watchers, w)
	return nil
}

// Run starts the informers, waits (bounded by SyncTimeout) for the initial
// pod lists, and keeps the registry in sync until ctx is cancelled; then it
// stops every informer goroutine and returns nil. Registry entries are left
// in place. Run may be called once.
func (s *Source) Run(ctx context.Context) error {
	if !s.running.CompareAndSwap(false, true) {
		return errors.New("kubernetes discovery: Run called twice")
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	var checkers []cache.DoneChecker
	for _, w := range s.watchers {
		reg, err := w.informer.AddEventHandler(s.handler(w))
		if err != nil {
			return fmt.Errorf("kubernetes discovery: %w", err)
		}
		checkers = append(checkers, reg.HasSyncedChecker())
	}
	unsubscribe := s.opts.Registry.Subscribe(s.onRegistryChange)
	defer unsubscribe()

	var wg sync.WaitGroup
	defer func() {
		cancel()
		wg.Wait()
	}()
	for _, w := range s.watchers {
		wg.Go(func() { w.informer.RunWithContext(ctx) })
	}
	s.log.Info("kubernetes discovery: watching pods", "namespace", nsName(s.opts.Namespace),
		"selectors", s.selectorStrings(), "port", s.opts.Port)
	wg.Go(func() { s.waitSynced(ctx, checkers) })

	for {
		select {
		case <-ctx.Done():
			return nil
		case <-s.kick:
			s.retryConflicts()
			s.retryPendingModels()
		}
	}
}

// waitSynced records when every handler has seen its informer's initial
// list, warning once if that takes longer than SyncTimeout.
func (s *Source) waitSynced(ctx context.Context, checkers []cache.DoneChecker) {
	sctx, cancel := context.WithTimeout(ctx, s.opts.SyncTimeout)
	ok := cache.WaitFor(sctx, "", checkers...)
	cancel()
	if !ok {
		if ctx.Err() != nil {
			return
		}
		s.log.Warn("kubernetes discovery: initial pod lists not synced yet; still trying",
			"timeout", s.opts.SyncTimeout.String(), "last_error", s.lastError())
		if !cache.WaitFor(ctx, "", checkers...) {
			return
		}
	}
	s.synced.Store(true)
	s.log.Info("kubernetes discovery: initial pod lists synced", "workers", s.workerCount())
}

// handler returns the event handler of one informer. Handlers only update
// the registry; they never wait on a worker.
func (s *Source) handler(w *watcher) cache.ResourceEventHandler {
	return cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { s.observe(w, obj, false) },
		UpdateFunc: func(_, obj any) { s.observe(w, obj, false) },
		DeleteFunc: func(obj any) { s.observe(w, obj, true) },
	}
}

// observe records one informer's view of one pod and reconciles it.
func (s *Source) observe(w *watcher, obj any, deleted bool) {
	key := ""
	var pod *corev1.Pod
	switch o := obj.(type) {
	case *corev1.Pod:
		pod = o
	case cache.DeletedFinalStateUnknown:
		key = o.Key
		if p, ok := o.Obj.(*corev1.Pod); ok {
			pod = p
		}
		deleted = true
	default:
		s.log.Warn("kubernetes discovery: unexpected object in pod informer", "type", fmt.Sprintf("%T", obj))
		return
	}
	if pod != nil {
		key = pod.Namespace + "/" + pod.Name
	}
	if key == "" {
		return
	}
	cause := ""
	var v *podView
	switch {
	case deleted:
		cause = reasonDeleted
	case !w.selector.Matches(labels.Set(pod.Labels)):
		// The API server reports a pod leaving the selector as a delete;
		// this also covers watches that do not filter.
		cause = reasonUnselected
	default:
		v = s.viewOf(pod, w.role)
	}

	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.pods[key]
	if st == nil {
		if v == nil {
			return
		}
		st = &podState{key: key, views: make([]*podView, len(s.watchers))}
		s.pods[key] = st
	}
	st.views[w.idx] = v
	if v == nil {
		st.cause = cause
	}
	s.reconcileLocked(st)
	if st.applied == nil && st.conflict == "" && !st.seen() {
		delete(s.pods, key)
	}
}

// onRegistryChange runs on the registry writer's goroutine: it only wakes
// Run to retry pods whose worker keys were taken by another instance.
func (s *Source) onRegistryChange(c worker.Change) {
	if len(c.Removed) == 0 || !s.hasConflicts.Load() {
		return
	}
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// Refresh re-evaluates the pods whose model was not known yet
// (Options.Model). It never blocks.
func (s *Source) Refresh() {
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

func (s *Source) retryPendingModels() {
	if s.opts.Model == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, k := range slices.Sorted(maps.Keys(s.pods)) {
		st := s.pods[k]
		v, _ := st.current()
		if v == nil || !v.modelPending {
			continue
		}
		if m, ok := s.opts.Model(hostPort(v.url)); ok {
			v.model, v.modelPending = m, false
			s.reconcileLocked(st)
		}
	}
}

func (s *Source) retryConflicts() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, k := range slices.Sorted(maps.Keys(s.pods)) {
		if st := s.pods[k]; st.conflict != "" {
			s.reconcileLocked(st)
		}
	}
}

func (s *Source) watchError(w *watcher, err error) {
	if err == nil {
		return
	}
	s.mu.Lock()
	s.lastErr = fmt.Sprintf("%s watch: %v", w.role, err)
	s.lastErrAt = time.Now()
	s.mu.Unlock()
	s.log.Warn("kubernetes discovery: pod list/watch failed; retrying with backoff",
		"role", w.role.String(), "selector", w.selector.String(), "namespace", nsName(s.opts.Namespace), "err", err)
}

func (s *Source) lastError() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lastErr
}

func (s *Source) workerCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, st := range s.pods {
		n += len(st.applied)
	}
	return n
}

func (s *Source) selectorStrings() map[string]string {
	m := make(map[string]string, len(s.watchers))
	for _, w := range s.watchers {
		m[w.role.String()] = w.selector.String()
	}
	return m
}

func nsName(ns string) string {
	if ns == "" {
		return "(all)"
	}
	return ns
}

// Status is the JSON view of the source for /workers-style endpoints.
type Status struct {
	Namespace   string            `json:"namespace"` // "" = all namespaces
	Selectors   map[string]string `json:"selectors"` // role → label selector
	Port        int               `json:"port"`
	Synced      bool              `json:"synced"`
	LastError   string            `json:"last_error,omitempty"`
	LastErrorAt *time.Time        `json:"last_error_at,omitempty"`
	Pods        []PodStatus       `json:"pods"`
}

// PodStatus is one selected pod.
type PodStatus struct {
	Pod           string `json:"pod"` // namespace/name
	Role          string `json:"role"`
	IP            string `json:"ip,omitempty"`
	Phase         string `json:"phase"`
	Ready         bool   `json:"ready"`
	Terminating   bool   `json:"terminating,omitempty"`
	URL           string `json:"url,omitempty"`
	DPSize        int    `json:"dp_size"`
	BootstrapPort int    `json:"bootstrap_port,omitempty"`
	Routed        bool   `json:"routed"` // its workers are in the registry
	Reason        string `json:"reason,omitempty"`
}

// Status returns the source's state: a Status value (typed any so the
// server can embed it without importing this package).
func (s *Source) Status() any { return s.status() }

func (s *Source) status() Status {
	st := Status{
		Namespace: s.opts.Namespace,
		Selectors: s.selectorStrings(),
		Port:      s.opts.Port,
		Synced:    s.synced.Load(),
		Pods:      []PodStatus{},
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.lastErr != "" {
		st.LastError = s.lastErr
		t := s.lastErrAt
		st.LastErrorAt = &t
	}
	for _, k := range slices.Sorted(maps.Keys(s.pods)) {
		p := s.pods[k]
		v, role := p.current()
		if v == nil {
			continue
		}
		ps := PodStatus{
			Pod: k, Role: role.String(), IP: v.ip, Phase: v.phase, Ready: v.ready,
			Terminating: v.terminating, URL: v.url, DPSize: v.dpSize,
			Routed: p.applied != nil,
		}
		if role == worker.RolePrefill {
			ps.BootstrapPort = v.bootstrapPort
		}
		switch {
		case p.conflict != "":
			ps.Reason = "worker key taken by " + p.conflict
		case !ps.Routed:
			ps.Reason = strings.ReplaceAll(v.ineligible(), "_", " ")
		}
		st.Pods = append(st.Pods, ps)
	}
	return st
}
