package k8s

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"

	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

const (
	ns   = "llm"
	port = 8000
)

var (
	regularSel = map[string]string{"app": "vllm"}
	prefillSel = map[string]string{"app": "vllm-prefill"}
	decodeSel  = map[string]string{"app": "vllm-decode"}
)

// pod builds a pod; ready=true means Running with Ready=True.
func pod(name string, lbls map[string]string, ip string, ready bool, ann ...string) *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: lbls, UID: types.UID("uid-" + name)},
		Status:     corev1.PodStatus{Phase: corev1.PodPending, PodIP: ip},
	}
	if ready {
		p.Status.Phase = corev1.PodRunning
		p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}
	}
	if len(ann) > 0 {
		p.Annotations = map[string]string{}
		for i := 0; i+1 < len(ann); i += 2 {
			p.Annotations[ann[i]] = ann[i+1]
		}
	}
	return p
}

func setReady(p *corev1.Pod, ready bool) *corev1.Pod {
	p = p.DeepCopy()
	st := corev1.ConditionFalse
	if ready {
		st = corev1.ConditionTrue
	}
	p.Status.Phase = corev1.PodRunning
	p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: st}}
	return p
}

type env struct {
	t    *testing.T
	cs   *fake.Clientset
	reg  *worker.Registry
	m    *metrics.Metrics
	src  *Source
	done chan error
	stop context.CancelFunc
	once sync.Once
}

// start runs a Source over cs (a new fake clientset holding objs when nil).
func start(t *testing.T, cs *fake.Clientset, opts Options, objs ...runtime.Object) *env {
	t.Helper()
	if cs == nil {
		cs = fake.NewClientset(objs...)
	}
	e := &env{t: t, cs: cs, reg: worker.NewRegistry(worker.BreakerConfig{}), m: metrics.New(prometheus.NewRegistry())}
	opts.Clientset = cs
	opts.Registry = e.reg
	opts.Metrics = e.m
	if opts.Port == 0 {
		opts.Port = port
	}
	src, err := New(opts)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	e.src = src
	ctx, cancel := context.WithCancel(context.Background())
	e.stop = cancel
	e.done = make(chan error, 1)
	go func() { e.done <- src.Run(ctx) }()
	t.Cleanup(e.close)
	e.waitSynced()
	return e
}

func (e *env) close() {
	e.once.Do(func() {
		e.stop()
		select {
		case err := <-e.done:
			if err != nil {
				e.t.Errorf("Run: %v", err)
			}
		case <-time.After(5 * time.Second):
			e.t.Error("Run did not return after cancel")
		}
	})
}

func (e *env) waitSynced() {
	e.t.Helper()
	waitFor(e.t, "initial sync", func() bool { return e.src.synced.Load() })
}

// waitFor polls cond for at most 5 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// keys renders the registry as sorted "role key" lines.
func keys(reg *worker.Registry) []string {
	var out []string
	for _, w := range reg.Snapshot().All {
		out = append(out, w.Role.String()+" "+w.Key())
	}
	slices.Sort(out)
	return out
}

func (e *env) expect(want ...string) {
	e.t.Helper()
	slices.Sort(want)
	if want == nil {
		want = []string{}
	}
	var got []string
	deadline := time.Now().Add(5 * time.Second)
	for {
		got = keys(e.reg)
		if got == nil {
			got = []string{}
		}
		if slices.Equal(got, want) {
			return
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("registry:\n got %q\nwant %q", got, want)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func (e *env) create(p *corev1.Pod) {
	e.t.Helper()
	if _, err := e.cs.CoreV1().Pods(p.Namespace).Create(context.Background(), p, metav1.CreateOptions{}); err != nil {
		e.t.Fatalf("create %s: %v", p.Name, err)
	}
}

func (e *env) update(p *corev1.Pod) {
	e.t.Helper()
	if _, err := e.cs.CoreV1().Pods(p.Namespace).Update(context.Background(), p, metav1.UpdateOptions{}); err != nil {
		e.t.Fatalf("update %s: %v", p.Name, err)
	}
}

func (e *env) delete(p *corev1.Pod) {
	e.t.Helper()
	if err := e.cs.CoreV1().Pods(p.Namespace).Delete(context.Background(), p.Name, metav1.DeleteOptions{}); err != nil {
		e.t.Fatalf("delete %s: %v", p.Name, err)
	}
}

func (e *env) removed(reason string) float64 {
	return metricValue(e.m.DiscoveryRemoved.WithLabelValues(reason))
}

func TestRegularPodLifecycle(t *testing.T) {
	e := start(t, nil, Options{Namespace: ns, Selector: regularSel})
	e.expect()

	// Pending without an IP: tracked, not routed.
	p := pod("w0", regularSel, "", false)
	e.create(p)
	waitFor(t, "pending pod in status", func() bool { return len(e.src.status().Pods) == 1 })
	e.expect()
	if ps := e.src.status().Pods[0]; ps.Routed || ps.Reason != "not running" || ps.Phase != "Pending" {
		t.Fatalf("pending pod status = %+v", ps)
	}

	// Running and Ready with an IP: added.
	p = setReady(p, true)
	p.Status.PodIP = "10.0.0.1"
	e.update(p)
	e.expect("regular http://10.0.0.1:8000")
	w := e.reg.Get("http://10.0.0.1:8000")
	if w.Source != worker.SourceK8s || w.Instance != ns+"/w0" || w.DPRank != -1 || w.DPSize != 1 {
		t.Fatalf("worker spec = %+v", w.Spec)
	}
	if got := metricValue(e.m.DiscoveryAdded); got != 1 {
		t.Fatalf("workers_added_total = %v, want 1", got)
	}

	// An unchanged update (e.g. a resync or a label no one selects on)
	// keeps the very same Worker, with its runtime state.
	p.Labels = map[string]string{"app": "vllm", "extra": "x"}
	e.update(p)
	// One informer delivers in order: once a later pod shows up, the
	// update above has been handled.
	sentinel := pod("sentinel", regularSel, "10.0.0.200", true)
	e.create(sentinel)
	e.expect("regular http://10.0.0.1:8000", "regular http://10.0.0.200:8000")
	e.delete(sentinel)
	e.expect("regular http://10.0.0.1:8000")
	if e.reg.Get("http://10.0.0.1:8000") != w {
		t.Fatal("an unchanged pod update replaced its worker")
	}

	// NotReady: removed (Rust kept it).
	p = setReady(p, false)
	e.update(p)
	e.expect()
	if got := e.removed(reasonNotReady); got != 1 {
		t.Fatalf("removed{not_ready} = %v", got)
	}

	// Ready again, then an IP change: replaced.
	p = setReady(p, true)
	e.update(p)
	e.expect("regular http://10.0.0.1:8000")
	p.Status.PodIP = "10.0.0.9"
	e.update(p)
	e.expect("regular http://10.0.0.9:8000")
	if got := e.removed(reasonReplaced); got != 1 {
		t.Fatalf("removed{replaced} = %v", got)
	}

	// Phase change (the container exited): removed.
	p.Status.Phase = corev1.PodFailed
	e.update(p)
	e.expect()
	p.Status.Phase = corev1.PodRunning
	e.update(p)
	e.expect("regular http://10.0.0.9:8000")

	// Terminating (deletionTimestamp set): removed before the pod is gone.
	now := metav1.Now()
	p.DeletionTimestamp = &now
	e.update(p)
	e.expect()
	if got := e.removed(reasonTerminating); got != 1 {
		t.Fatalf("removed{terminating} = %v", got)
	}

	// Deletion of a routed pod.
	q := pod("w1", regularSel, "10.0.0.2", true)
	e.create(q)
	e.expect("regular http://10.0.0.2:8000")
	e.delete(q)
	e.expect()
	if got := e.removed(reasonDeleted); got != 2 { // the sentinel and w1
		t.Fatalf("removed{deleted} = %v", got)
	}

	// Leaving the selector removes the worker; coming back adds it.
	r := pod("w2", regularSel, "10.0.0.3", true)
	e.create(r)
	e.expect("regular http://10.0.0.3:8000")
	r.Labels = map[string]string{"app": "other"}
	e.update(r)
	e.expect()
	r.Labels = regularSel
	e.update(r)
	e.expect("regular http://10.0.0.3:8000")
}

func TestSelectorAndNamespaceScoping(t *testing.T) {
	other := pod("elsewhere", regularSel, "10.1.0.1", true)
	other.Namespace = "other"
	e := start(t, nil, Options{Namespace: ns, Selector: regularSel},
		pod("match", regularSel, "10.0.0.1", true),
		pod("nomatch", map[string]string{"app": "web"}, "10.0.0.2", true),
		pod("partial", map[string]string{"tier": "x"}, "10.0.0.3", true),
		other,
	)
	e.expect("regular http://10.0.0.1:8000")

	// Selectors and namespace are applied by the API server: every list
	// and watch carries them. The watch starts after the list, in the
	// informer's goroutine: wait for it.
	podActions := func() int {
		n := 0
		for _, a := range e.cs.Actions() {
			if a.GetResource().Resource == "pods" {
				n++
			}
		}
		return n
	}
	waitFor(t, "a pod list and a pod watch", func() bool { return podActions() >= 2 })
	var n int
	for _, a := range e.cs.Actions() {
		if a.GetResource().Resource != "pods" {
			continue
		}
		n++
		if a.GetNamespace() != ns {
			t.Errorf("%s pods in namespace %q, want %q", a.GetVerb(), a.GetNamespace(), ns)
		}
		var sel string
		switch a := a.(type) {
		case k8stesting.ListActionImpl:
			sel = a.ListOptions.LabelSelector
		case k8stesting.WatchActionImpl:
			sel = a.ListOptions.LabelSelector
		default:
			t.Errorf("unexpected pod action %s", a.GetVerb())
		}
		if sel != "app=vllm" {
			t.Errorf("%s pods with label selector %q, want app=vllm", a.GetVerb(), sel)
		}
	}
	if n < 2 {
		t.Fatalf("saw %d pod list/watch actions, want a list and a watch", n)
	}
}

func TestAllNamespaces(t *testing.T) {
	a := pod("a", regularSel, "10.0.0.1", true)
	b := pod("b", regularSel, "10.0.0.2", true)
	b.Namespace = "other"
	e := start(t, nil, Options{Selector: regularSel}, a, b)
	e.expect("regular http://10.0.0.1:8000", "regular http://10.0.0.2:8000")
	if w := e.reg.Get("http://10.0.0.2:8000"); w.Instance != "other/b" {
		t.Fatalf("instance = %q, want other/b", w.Instance)
	}
}

func TestPDRolesRelabelAndAnnotations(t *testing.T) {
	e := start(t, nil, Options{Namespace: ns, PD: true, PrefillSelector: prefillSel, DecodeSelector: decodeSel, DefaultDPSize: 1},
		pod("p0", prefillSel, "10.0.0.1", true, DefaultBootstrapPortAnnotation, "8998"),
		pod("d0", decodeSel, "10.0.0.2", true, DefaultBootstrapPortAnnotation, "9999", KVEventsPortAnnotation, "6557"),
		pod("p1", prefillSel, "10.0.0.3", true, DefaultDPSizeAnnotation, "2"),
	)
	e.expect("prefill http://10.0.0.1:8000", "decode http://10.0.0.2:8000",
		"prefill http://10.0.0.3:8000@0", "prefill http://10.0.0.3:8000@1")

	if w := e.reg.Get("http://10.0.0.1:8000"); w.BootstrapPort != 8998 {
		t.Fatalf("prefill bootstrap port = %d, want 8998", w.BootstrapPort)
	}
	if w := e.reg.Get("http://10.0.0.2:8000"); w.BootstrapPort != 0 {
		t.Fatalf("decode bootstrap port = %d, want 0 (prefill only)", w.BootstrapPort)
	}
	if w := e.reg.Get("http://10.0.0.2:8000"); w.KVEventsPort != 6557 {
		t.Fatalf("decode KV events port = %d, want 6557 (annotation)", w.KVEventsPort)
	}
	if w := e.reg.Get("http://10.0.0.1:8000"); w.KVEventsPort != 0 {
		t.Fatalf("prefill KV events port = %d, want 0 (no annotation)", w.KVEventsPort)
	}
	for r := range 2 {
		w := e.reg.Get(fmt.Sprintf("http://10.0.0.3:8000@%d", r))
		if w.DPRank != r || w.DPSize != 2 || w.Instance != ns+"/p1" || w.URL != "http://10.0.0.3:8000" {
			t.Fatalf("DP worker %d = %+v", r, w.Spec)
		}
	}

	// Decode → prefill relabel: the pod's workers change role at once.
	d0 := pod("d0", prefillSel, "10.0.0.2", true, DefaultBootstrapPortAnnotation, "9999")
	e.update(d0)
	e.expect("prefill http://10.0.0.1:8000", "prefill http://10.0.0.2:8000",
		"prefill http://10.0.0.3:8000@0", "prefill http://10.0.0.3:8000@1")
	waitFor(t, "bootstrap port after relabel", func() bool {
		w := e.reg.Get("http://10.0.0.2:8000")
		return w != nil && w.BootstrapPort == 9999
	})
	// Prefill → decode.
	p0 := pod("p0", decodeSel, "10.0.0.1", true, DefaultBootstrapPortAnnotation, "8998")
	e.update(p0)
	e.expect("decode http://10.0.0.1:8000", "prefill http://10.0.0.2:8000",
		"prefill http://10.0.0.3:8000@0", "prefill http://10.0.0.3:8000@1")

	// DP size change: the ranks follow.
	p1 := pod("p1", prefillSel, "10.0.0.3", true, DefaultDPSizeAnnotation, "3")
	e.update(p1)
	e.expect("decode http://10.0.0.1:8000", "prefill http://10.0.0.2:8000",
		"prefill http://10.0.0.3:8000@0", "prefill http://10.0.0.3:8000@1", "prefill http://10.0.0.3:8000@2")

	// An unusable annotation falls back to the default (and is reported).
	p1 = pod("p1", prefillSel, "10.0.0.3", true, DefaultDPSizeAnnotation, "many", DefaultBootstrapPortAnnotation, "x")
	e.update(p1)
	e.expect("decode http://10.0.0.1:8000", "prefill http://10.0.0.2:8000", "prefill http://10.0.0.3:8000")
	if w := e.reg.Get("http://10.0.0.3:8000"); w.BootstrapPort != 0 || w.DPSize != 1 {
		t.Fatalf("fallback spec = %+v", w.Spec)
	}
}

// TestPDOverlappingSelectors: a pod selected by both informers is a
// prefill; leaving the prefill selector turns it into a decode, whatever
// order the two informers deliver their events in.
func TestPDOverlappingSelectors(t *testing.T) {
	e := start(t, nil, Options{Namespace: ns, PD: true,
		PrefillSelector: map[string]string{"vllm": "true", "role": "prefill"},
		DecodeSelector:  map[string]string{"vllm": "true"}},
		pod("a", map[string]string{"vllm": "true", "role": "prefill"}, "10.0.0.1", true),
		pod("b", map[string]string{"vllm": "true"}, "10.0.0.2", true),
	)
	e.expect("prefill http://10.0.0.1:8000", "decode http://10.0.0.2:8000")
	e.update(pod("a", map[string]string{"vllm": "true", "role": "decode"}, "10.0.0.1", true))
	e.expect("decode http://10.0.0.1:8000", "decode http://10.0.0.2:8000")
	e.update(pod("b", map[string]string{"vllm": "true", "role": "prefill"}, "10.0.0.2", true))
	e.expect("decode http://10.0.0.1:8000", "prefill http://10.0.0.2:8000")
	// NotReady while matching both: not routed at all (no fallback to decode).
	e.update(setReady(pod("b", map[string]string{"vllm": "true", "role": "prefill"}, "10.0.0.2", true), false))
	e.expect("decode http://10.0.0.1:8000")
}

// TestHandlerEventOrder drives the handler directly, in the orders two
// informers may deliver a relabel, and with tombstones.
func TestHandlerEventOrder(t *testing.T) {
	reg := worker.NewRegistry(worker.BreakerConfig{})
	s, err := New(Options{Clientset: fake.NewClientset(), Registry: reg, Port: port, PD: true,
		PrefillSelector: prefillSel, DecodeSelector: decodeSel})
	if err != nil {
		t.Fatal(err)
	}
	pw, dw := s.watchers[0], s.watchers[1]
	asP := pod("a", prefillSel, "10.0.0.1", true)
	asD := pod("a", decodeSel, "10.0.0.1", true)
	check := func(want ...string) {
		t.Helper()
		if got := keys(reg); !slices.Equal(got, want) {
			t.Fatalf("registry = %q, want %q", got, want)
		}
	}

	s.observe(dw, asD, false)
	check("decode http://10.0.0.1:8000")
	// decode → prefill, prefill informer first.
	s.observe(pw, asP, false)
	check("prefill http://10.0.0.1:8000")
	s.observe(dw, asP, false) // decode informer: no longer selected
	check("prefill http://10.0.0.1:8000")
	// prefill → decode, decode informer first: still a prefill until the
	// prefill informer lets go.
	s.observe(dw, asD, false)
	check("prefill http://10.0.0.1:8000")
	s.observe(pw, asD, false)
	check("decode http://10.0.0.1:8000")

	// A tombstone with the last known pod.
	s.observe(dw, cache.DeletedFinalStateUnknown{Key: ns + "/a", Obj: asD}, true)
	check()
	// A tombstone without a usable object still removes by key.
	s.observe(pw, asP, false)
	check("prefill http://10.0.0.1:8000")
	s.observe(pw, cache.DeletedFinalStateUnknown{Key: ns + "/a", Obj: "garbage"}, true)
	check()
	if len(s.pods) != 0 {
		t.Fatalf("state left for %d pods after deletion", len(s.pods))
	}
	// A delete for a pod never seen and an unexpected object are ignored.
	s.observe(pw, cache.DeletedFinalStateUnknown{Key: ns + "/ghost"}, true)
	s.observe(pw, "garbage", false)
	check()

	// Delete while NotReady (Rust never removed those: it matched the whole
	// pod state) — the entry is gone either way.
	s.observe(pw, asP, false)
	s.observe(pw, setReady(asP, false), false)
	check()
	s.observe(pw, setReady(asP, true), false)
	check("prefill http://10.0.0.1:8000")
	s.observe(pw, setReady(asP, false), true)
	check()
}

func TestIPv6(t *testing.T) {
	e := start(t, nil, Options{Namespace: ns, Selector: regularSel, Port: 8200},
		pod("v6", regularSel, "fd00::1", true),
		pod("bad", regularSel, "not-an-ip", true),
	)
	e.expect("regular http://[fd00::1]:8200")
	waitFor(t, "bad pod in status", func() bool { return len(e.src.status().Pods) == 2 })
	for _, ps := range e.src.status().Pods {
		if ps.Pod == ns+"/bad" && (ps.Routed || ps.Reason != "bad ip") {
			t.Fatalf("bad-IP pod status = %+v", ps)
		}
	}
}

func TestKeyConflictRetried(t *testing.T) {
	reg := worker.NewRegistry(worker.BreakerConfig{})
	cs := fake.NewClientset(pod("w", regularSel, "10.0.0.1", true))
	// A static worker already owns the URL the pod would get.
	if _, err := reg.Add(worker.Spec{URL: "http://10.0.0.1:8000", DPRank: -1}); err != nil {
		t.Fatal(err)
	}
	m := metrics.New(prometheus.NewRegistry())
	s, err := New(Options{Clientset: cs, Registry: reg, Metrics: m, Port: port, Selector: regularSel})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	waitFor(t, "conflict", func() bool {
		st := s.status()
		return len(st.Pods) == 1 && strings.Contains(st.Pods[0].Reason, "taken by static")
	})
	if w := reg.Get("http://10.0.0.1:8000"); w.Source != worker.SourceStatic {
		t.Fatalf("the pod displaced the static worker: %+v", w.Spec)
	}
	if got := metricValue(m.DiscoveryDropped.WithLabelValues(reasonConflict)); got != 1 {
		t.Fatalf("dropped{conflict} = %v", got)
	}
	// The static worker goes away: the pod is routed without a pod event.
	reg.Remove("http://10.0.0.1:8000")
	waitFor(t, "pod routed after the conflict cleared", func() bool {
		w := reg.Get("http://10.0.0.1:8000")
		return w != nil && w.Source == worker.SourceK8s
	})
}

// TestReplicasAgree: two router replicas watching the same pods build
// registries with identical keys, and consistent_hash (and rendezvous_hash)
// send each session to the same worker on both.
func TestReplicasAgree(t *testing.T) {
	var objs []runtime.Object
	for i := range 6 {
		var ann []string
		if i%3 == 0 {
			ann = []string{DefaultDPSizeAnnotation, "2"}
		}
		objs = append(objs, pod(fmt.Sprintf("p%d", i), prefillSel, fmt.Sprintf("10.0.1.%d", i+1), true, ann...))
	}
	for i := range 5 {
		objs = append(objs, pod(fmt.Sprintf("d%d", i), decodeSel, fmt.Sprintf("10.0.2.%d", i+1), i != 4))
	}
	cs := fake.NewClientset(objs...)
	opts := Options{Namespace: ns, PD: true, PrefillSelector: prefillSel, DecodeSelector: decodeSel}
	a := start(t, cs, opts)
	b := start(t, cs, opts)
	// 6 prefill pods, two of them DP 2 → 8 prefill workers; 4 ready decodes.
	waitFor(t, "both replicas populated", func() bool {
		return len(a.reg.Snapshot().All) == 12 && len(b.reg.Snapshot().All) == 12
	})

	agree := func() {
		t.Helper()
		if ka, kb := keys(a.reg), keys(b.reg); !slices.Equal(ka, kb) {
			t.Fatalf("replica registries differ:\n%q\n%q", ka, kb)
		}
		for _, name := range []string{policy.NameConsistentHash, policy.NameRendezvousHash} {
			pa, err := policy.New(name, policy.DefaultOptions())
			if err != nil {
				t.Fatal(err)
			}
			pb, _ := policy.New(name, policy.DefaultOptions())
			sa, sb := a.reg.Snapshot(), b.reg.Snapshot()
			for _, role := range []worker.Role{worker.RolePrefill, worker.RoleDecode} {
				ca := policy.Candidates{Gen: sa.Gen, Workers: sa.ByRole(role)}
				cb := policy.Candidates{Gen: sb.Gen, Workers: sb.ByRole(role)}
				spread := map[string]bool{}
				for i := range 300 {
					h := http.Header{}
					h.Set("x-session-id", fmt.Sprintf("session-%d", i))
					body := []byte(`{"prompt":"hello"}`)
					ch1, err1 := pa.Pick(&policy.Request{Path: "/v1/completions", Headers: h, Body: body}, ca)
					ch2, err2 := pb.Pick(&policy.Request{Path: "/v1/completions", Headers: h, Body: body}, cb)
					if err1 != nil || err2 != nil {
						t.Fatalf("%s pick: %v, %v", name, err1, err2)
					}
					if ch1.Worker.Key() != ch2.Worker.Key() {
						t.Fatalf("%s %s session-%d: replica A → %s, replica B → %s", name, role, i, ch1.Worker.Key(), ch2.Worker.Key())
					}
					spread[ch1.Worker.Key()] = true
				}
				if len(spread) < 2 {
					t.Fatalf("%s %s: 300 sessions all went to %v", name, role, spread)
				}
			}
			_ = policy.Close(pa)
			_ = policy.Close(pb)
		}
	}
	agree()

	// Churn: a decode becomes ready, a prefill is deleted, one changes IP.
	ctx := context.Background()
	d4 := setReady(objs[10].(*corev1.Pod), true)
	if _, err := cs.CoreV1().Pods(ns).Update(ctx, d4, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := cs.CoreV1().Pods(ns).Delete(ctx, "p1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	p2 := objs[2].(*corev1.Pod).DeepCopy()
	p2.Status.PodIP = "10.0.1.99"
	if _, err := cs.CoreV1().Pods(ns).Update(ctx, p2, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, e := range []*env{a, b} {
		waitFor(t, "churn applied", func() bool {
			return e.reg.Get("http://10.0.2.5:8000") != nil && e.reg.Get("http://10.0.1.2:8000") == nil &&
				e.reg.Get("http://10.0.1.99:8000") != nil && e.reg.Get("http://10.0.1.3:8000") == nil
		})
	}
	agree()
}

func TestStatusJSON(t *testing.T) {
	e := start(t, nil, Options{Namespace: ns, PD: true, PrefillSelector: prefillSel, DecodeSelector: decodeSel},
		pod("p0", prefillSel, "10.0.0.1", true, DefaultBootstrapPortAnnotation, "8998", DefaultDPSizeAnnotation, "2"),
		pod("d0", decodeSel, "10.0.0.2", false),
	)
	e.expect("prefill http://10.0.0.1:8000@0", "prefill http://10.0.0.1:8000@1")
	waitFor(t, "two pods", func() bool { return len(e.src.status().Pods) == 2 })
	b, err := json.Marshal(e.src.Status())
	if err != nil {
		t.Fatal(err)
	}
	var st Status
	if err := json.Unmarshal(b, &st); err != nil {
		t.Fatal(err)
	}
	want := Status{
		Namespace: ns, Port: port, Synced: true,
		Selectors: map[string]string{"prefill": "app=vllm-prefill", "decode": "app=vllm-decode"},
		Pods: []PodStatus{
			{Pod: ns + "/d0", Role: "decode", IP: "10.0.0.2", Phase: "Pending", URL: "http://10.0.0.2:8000", DPSize: 1, Reason: "not running"},
			{Pod: ns + "/p0", Role: "prefill", IP: "10.0.0.1", Phase: "Running", Ready: true, URL: "http://10.0.0.1:8000", DPSize: 2, BootstrapPort: 8998, Routed: true},
		},
	}
	if fmt.Sprint(st) != fmt.Sprint(want) {
		t.Fatalf("status:\n got %+v\nwant %+v", st, want)
	}
}

func TestListFailureIsReportedAndBounded(t *testing.T) {
	cs := fake.NewClientset()
	cs.PrependReactor("list", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, errors.New("pods is forbidden: no RBAC")
	})
	reg := worker.NewRegistry(worker.BreakerConfig{})
	s, err := New(Options{Clientset: cs, Registry: reg, Port: port, Selector: regularSel, SyncTimeout: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	waitFor(t, "list error in status", func() bool { return strings.Contains(s.status().LastError, "forbidden") })
	if s.status().Synced {
		t.Fatal("synced despite failing lists")
	}
	if err := s.Run(ctx); err == nil {
		t.Fatal("second Run: want an error")
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Run did not return after cancel")
	}
}

func TestNewValidation(t *testing.T) {
	cs := fake.NewClientset()
	reg := worker.NewRegistry(worker.BreakerConfig{})
	for _, tc := range []struct {
		name string
		opts Options
		want string
	}{
		{"no clientset", Options{Registry: reg, Port: 80, Selector: regularSel}, "clientset is required"},
		{"no registry", Options{Clientset: cs, Port: 80, Selector: regularSel}, "registry is required"},
		{"bad port", Options{Clientset: cs, Registry: reg, Port: 0, Selector: regularSel}, "port 0"},
		{"regular empty", Options{Clientset: cs, Registry: reg, Port: 80}, "non-empty selector"},
		{"regular with role selectors", Options{Clientset: cs, Registry: reg, Port: 80, Selector: regularSel, PrefillSelector: prefillSel}, "need PD mode"},
		{"pd empty", Options{Clientset: cs, Registry: reg, Port: 80, PD: true}, "non-empty prefill or decode"},
		{"pd with regular selector", Options{Clientset: cs, Registry: reg, Port: 80, PD: true, Selector: regularSel, DecodeSelector: decodeSel}, "not the regular selector"},
		{"bad label", Options{Clientset: cs, Registry: reg, Port: 80, Selector: map[string]string{"bad key!": "v"}}, "selector"},
		{"bad value", Options{Clientset: cs, Registry: reg, Port: 80, PD: true, DecodeSelector: map[string]string{"k": "white space"}}, "decode selector"},
		{"dp too big", Options{Clientset: cs, Registry: reg, Port: 80, Selector: regularSel, DefaultDPSize: MaxDPSize + 1}, "DP size"},
	} {
		_, err := New(tc.opts)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want it to contain %q", tc.name, err, tc.want)
		}
	}
	// PD with only a decode selector is valid (one informer).
	s, err := New(Options{Clientset: cs, Registry: reg, Port: 80, PD: true, DecodeSelector: decodeSel})
	if err != nil || len(s.watchers) != 1 || s.watchers[0].role != worker.RoleDecode {
		t.Fatalf("decode-only: %v", err)
	}
}

func TestSlimPod(t *testing.T) {
	p := pod("a", regularSel, "10.0.0.1", true, "kubectl.kubernetes.io/last-applied-configuration", "{huge}", "keep", "me")
	p.Spec.Containers = []corev1.Container{{Name: "vllm", Image: "vllm/vllm-openai"}}
	p.ManagedFields = []metav1.ManagedFieldsEntry{{Manager: "kubectl"}}
	out, err := slimPod(p)
	if err != nil {
		t.Fatal(err)
	}
	s := out.(*corev1.Pod)
	if len(s.Spec.Containers) != 0 || s.ManagedFields != nil || len(s.Annotations) != 1 || s.Annotations["keep"] != "me" {
		t.Fatalf("slim pod = %+v", s)
	}
	if s.Status.PodIP != "10.0.0.1" || s.Status.Phase != corev1.PodRunning || len(s.Status.Conditions) != 1 || s.Name != "a" {
		t.Fatalf("slim pod lost what discovery reads: %+v", s)
	}
	if len(p.Spec.Containers) != 1 || len(p.Annotations) != 2 {
		t.Fatal("slimPod modified its input")
	}
	tomb := cache.DeletedFinalStateUnknown{Key: "x"}
	if o, _ := slimPod(tomb); o != tomb {
		t.Fatal("slimPod changed a non-pod")
	}
}

func metricValue(m prometheus.Metric) float64 {
	var d dto.Metric
	if err := m.Write(&d); err != nil {
		panic(err)
	}
	if d.Counter != nil {
		return d.Counter.GetValue()
	}
	return d.Gauge.GetValue()
}

// TestAdminRemovalRestored: the pod is the truth. Workers removed behind
// the source's back (admin API) come back at the pod's next event.
func TestAdminRemovalRestored(t *testing.T) {
	p := pod("w", regularSel, "10.0.0.1", true)
	e := start(t, nil, Options{Namespace: ns, Selector: regularSel}, p)
	e.expect("regular http://10.0.0.1:8000")
	e.reg.Remove("http://10.0.0.1:8000")
	e.expect()
	p = p.DeepCopy()
	p.Labels = map[string]string{"app": "vllm", "touched": "1"}
	e.update(p)
	e.expect("regular http://10.0.0.1:8000")
	if got := e.removed(reasonReplaced); got != 0 {
		t.Fatalf("a restore counted as a replacement: %v", got)
	}
}

// TestMultiModelPods: with Options.Models (--enable-igw) regular and
// prefill/decode pods are watched together, every Worker carries its
// pod's model (annotation, else label), a pod naming no model is not
// routed until it names one, and a model change replaces the workers.
func TestMultiModelPods(t *testing.T) {
	labelled := map[string]string{"app": "vllm", ModelAnnotation: "phi-3"}
	e := start(t, nil, Options{Namespace: ns, Models: true, Selector: regularSel, PrefillSelector: prefillSel, DecodeSelector: decodeSel},
		pod("r0", regularSel, "10.0.0.1", true, ModelAnnotation, "Qwen/Qwen3-8B"),
		pod("r1", labelled, "10.0.0.2", true),
		pod("p0", prefillSel, "10.0.0.3", true, ModelAnnotation, "big", DefaultBootstrapPortAnnotation, "8998"),
		pod("d0", decodeSel, "10.0.0.4", true, ModelAnnotation, "big"),
		pod("x0", regularSel, "10.0.0.5", true),
	)
	e.expect("regular http://10.0.0.1:8000", "regular http://10.0.0.2:8000", "prefill http://10.0.0.3:8000", "decode http://10.0.0.4:8000")
	for url, want := range map[string]string{
		"http://10.0.0.1:8000": "Qwen/Qwen3-8B", "http://10.0.0.2:8000": "phi-3",
		"http://10.0.0.3:8000": "big", "http://10.0.0.4:8000": "big",
	} {
		if w := e.reg.Get(url); w == nil || w.ModelID != want {
			t.Fatalf("%s: model %q, want %q", url, w.ModelID, want)
		}
	}
	if w := e.reg.Get("http://10.0.0.3:8000"); w.BootstrapPort != 8998 {
		t.Fatalf("prefill bootstrap port %d", w.BootstrapPort)
	}
	// The pod without a model joins once it names one.
	e.update(pod("x0", regularSel, "10.0.0.5", true, ModelAnnotation, "late"))
	waitFor(t, "x0 registered with its model", func() bool {
		w := e.reg.Get("http://10.0.0.5:8000")
		return w != nil && w.ModelID == "late"
	})
	// A model change replaces the pod's workers; dropping the model
	// removes them.
	e.update(pod("r0", regularSel, "10.0.0.1", true, ModelAnnotation, "Qwen/Qwen3-32B"))
	waitFor(t, "r0's new model", func() bool {
		w := e.reg.Get("http://10.0.0.1:8000")
		return w != nil && w.ModelID == "Qwen/Qwen3-32B"
	})
	e.update(pod("r0", regularSel, "10.0.0.1", true))
	e.expect("regular http://10.0.0.2:8000", "prefill http://10.0.0.3:8000", "decode http://10.0.0.4:8000", "regular http://10.0.0.5:8000")
	waitFor(t, "the removal counted", func() bool { return e.removed(reasonNoModel) == 1 })

	if _, err := New(Options{Clientset: fake.NewClientset(), Registry: e.reg, Port: 80, Models: true}); err == nil ||
		!strings.Contains(err.Error(), "multi-model mode needs a non-empty selector") {
		t.Fatalf("multi-model without selectors: %v", err)
	}
}

// TestMultiModelPodsAskModel: a pod naming no model waits (model_pending)
// for Options.Model, and joins with that model on Refresh.
func TestMultiModelPodsAskModel(t *testing.T) {
	var mu sync.Mutex
	known := map[string]string{}
	var asked []string
	e := start(t, nil, Options{Namespace: ns, Models: true, Selector: regularSel, Model: func(hp string) (string, bool) {
		mu.Lock()
		defer mu.Unlock()
		asked = append(asked, hp)
		m, ok := known[hp]
		return m, ok
	}},
		pod("r0", regularSel, "10.0.0.1", true),
		pod("r1", regularSel, "10.0.0.2", true, ModelAnnotation, "named"),
	)
	e.expect("regular http://10.0.0.2:8000")
	mu.Lock()
	if !slices.Contains(asked, "10.0.0.1:8000") || slices.Contains(asked, "10.0.0.2:8000") {
		t.Errorf("asked %v: want only the pod naming no model", asked)
	}
	known["10.0.0.1:8000"] = "from-v1-models"
	mu.Unlock()
	e.src.Refresh()
	e.expect("regular http://10.0.0.1:8000", "regular http://10.0.0.2:8000")
	if w := e.reg.Get("http://10.0.0.1:8000"); w.ModelID != "from-v1-models" {
		t.Fatalf("model %q", w.ModelID)
	}
}
