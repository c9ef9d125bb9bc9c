package k8s

import (
	"context"
	"encoding/json"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

// apiServer is a minimal Kubernetes API for pods in one namespace: list,
// and watch with label selectors evaluated by the server (a pod that stops
// matching is sent as DELETED, as the real API server does).
type apiServer struct {
	t   *testing.T
	srv *httptest.Server

	mu        sync.Mutex
	rv        int
	pods      map[string]*corev1.Pod
	watchers  map[chan struct{}]bool
	events    []apiEvent
	selectors []string // label selectors of list and watch requests
}

type apiEvent struct {
	rv   int
	old  *corev1.Pod // nil = created
	pod  *corev1.Pod // nil = deleted (old is the last state)
	name string
}

func newAPIServer(t *testing.T) *apiServer {
	a := &apiServer{t: t, pods: map[string]*corev1.Pod{}, watchers: map[chan struct{}]bool{}}
	a.srv = httptest.NewServer(http.HandlerFunc(a.serve))
	return a
}

func (a *apiServer) set(p *corev1.Pod) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.rv++
	p = p.DeepCopy()
	p.TypeMeta = metav1.TypeMeta{Kind: "Pod", APIVersion: "v1"}
	p.ResourceVersion = strconv.Itoa(a.rv)
	a.events = append(a.events, apiEvent{rv: a.rv, old: a.pods[p.Name], pod: p, name: p.Name})
	a.pods[p.Name] = p
	a.wakeLocked()
}

func (a *apiServer) del(name string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.rv++
	a.events = append(a.events, apiEvent{rv: a.rv, old: a.pods[name], name: name})
	delete(a.pods, name)
	a.wakeLocked()
}

func (a *apiServer) wakeLocked() {
	for c := range a.watchers {
		select {
		case c <- struct{}{}:
		default:
		}
	}
}

func (a *apiServer) serve(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/api/v1/namespaces/"+ns+"/pods" || r.Method != http.MethodGet {
		http.Error(w, `{"kind":"Status","apiVersion":"v1","status":"Failure","code":404}`, http.StatusNotFound)
		return
	}
	q := r.URL.Query()
	sel, err := labels.Parse(q.Get("labelSelector"))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	a.mu.Lock()
	a.selectors = append(a.selectors, q.Get("labelSelector"))
	a.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	if q.Get("watch") != "true" {
		a.mu.Lock()
		list := corev1.PodList{TypeMeta: metav1.TypeMeta{Kind: "PodList", APIVersion: "v1"}}
		list.ResourceVersion = strconv.Itoa(a.rv)
		for _, k := range slices.Sorted(maps.Keys(a.pods)) {
			if p := a.pods[k]; sel.Matches(labels.Set(p.Labels)) {
				list.Items = append(list.Items, *p)
			}
		}
		a.mu.Unlock()
		_ = json.NewEncoder(w).Encode(list)
		return
	}
	if q.Get("sendInitialEvents") == "true" { // no streaming lists here: the client falls back to list+watch
		w.WriteHeader(http.StatusBadRequest)
		_, _ = w.Write([]byte(`{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"BadRequest","code":400}`))
		return
	}
	from, _ := strconv.Atoi(q.Get("resourceVersion"))
	wake := make(chan struct{}, 1)
	a.mu.Lock()
	a.watchers[wake] = true
	a.mu.Unlock()
	defer func() {
		a.mu.Lock()
		delete(a.watchers, wake)
		a.mu.Unlock()
	}()
	w.WriteHeader(http.StatusOK)
	w.(http.Flusher).Flush()
	enc := json.NewEncoder(w)
	for {
		a.mu.Lock()
		var out []map[string]any
		for _, e := range a.events {
			if e.rv <= from {
				continue
			}
			from = e.rv
			was := e.old != nil && sel.Matches(labels.Set(e.old.Labels))
			is := e.pod != nil && sel.Matches(labels.Set(e.pod.Labels))
			switch {
			case is && was:
				out = append(out, map[string]any{"type": "MODIFIED", "object": e.pod})
			case is:
				out = append(out, map[string]any{"type": "ADDED", "object": e.pod})
			case was:
				last := e.old.DeepCopy()
				last.ResourceVersion = strconv.Itoa(e.rv)
				out = append(out, map[string]any{"type": "DELETED", "object": last})
			}
		}
		a.mu.Unlock()
		for _, ev := range out {
			if enc.Encode(ev) != nil {
				return
			}
		}
		w.(http.Flusher).Flush()
		select {
		case <-r.Context().Done():
			return
		case <-wake:
		}
	}
}

func writeKubeconfig(t *testing.T, server string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kubeconfig")
	cfg := `apiVersion: v1
kind: Config
clusters:
- name: test
  cluster:
    server: ` + server + `
users:
- name: test
  user:
    token: secret
contexts:
- name: test
  context:
    cluster: test
    user: test
    namespace: ` + ns + `
current-context: test
`
	if err := os.WriteFile(path, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestAgainstAPIServer runs the real client (NewClientset from
// $KUBECONFIG, HTTP list and watch) against a minimal API server: label
// selectors travel in the request, and pods are added, updated and removed.
func TestAgainstAPIServer(t *testing.T) {
	api := newAPIServer(t)
	defer api.srv.Close()
	api.set(pod("p0", prefillSel, "10.0.0.1", true, DefaultBootstrapPortAnnotation, "8998"))
	api.set(pod("d0", decodeSel, "10.0.0.2", true))
	api.set(pod("web", map[string]string{"app": "web"}, "10.0.0.3", true))

	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	t.Setenv("KUBECONFIG", writeKubeconfig(t, api.srv.URL))
	cs, err := NewClientset("switchyard-test")
	if err != nil {
		t.Fatal(err)
	}
	reg := worker.NewRegistry(worker.BreakerConfig{})
	s, err := New(Options{Clientset: cs, Registry: reg, Namespace: ns, Port: port, PD: true,
		PrefillSelector: prefillSel, DecodeSelector: decodeSel})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	defer func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Error(err)
			}
		case <-time.After(5 * time.Second):
			t.Error("Run did not return")
		}
	}()

	expect := func(want ...string) {
		t.Helper()
		slices.Sort(want)
		waitFor(t, strings.Join(want, ", "), func() bool { return slices.Equal(keys(reg), want) })
	}
	expect("prefill http://10.0.0.1:8000", "decode http://10.0.0.2:8000")
	waitFor(t, "synced", func() bool { return s.status().Synced })
	if w := reg.Get("http://10.0.0.1:8000"); w.BootstrapPort != 8998 {
		t.Fatalf("bootstrap port %d", w.BootstrapPort)
	}

	api.set(pod("d1", decodeSel, "10.0.0.4", true))
	expect("prefill http://10.0.0.1:8000", "decode http://10.0.0.2:8000", "decode http://10.0.0.4:8000")
	api.set(setReady(pod("d1", decodeSel, "10.0.0.4", true), false))
	expect("prefill http://10.0.0.1:8000", "decode http://10.0.0.2:8000")
	api.set(pod("d0", prefillSel, "10.0.0.2", true)) // relabel: DELETED on the decode watch
	expect("prefill http://10.0.0.1:8000", "prefill http://10.0.0.2:8000")
	api.del("p0")
	expect("prefill http://10.0.0.2:8000")

	api.mu.Lock()
	sels := slices.Clone(api.selectors)
	api.mu.Unlock()
	slices.Sort(sels)
	sels = slices.Compact(sels)
	if !slices.Equal(sels, []string{"app=vllm-decode", "app=vllm-prefill"}) {
		t.Fatalf("label selectors sent to the API server: %q", sels)
	}
}

func TestNewClientsetErrors(t *testing.T) {
	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	bad := filepath.Join(t.TempDir(), "bad")
	if err := os.WriteFile(bad, []byte("not: [valid"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("KUBECONFIG", bad)
	if _, err := NewClientset(""); err == nil || !strings.Contains(err.Error(), "$KUBECONFIG") {
		t.Fatalf("bad $KUBECONFIG: err = %v", err)
	}
	t.Setenv("KUBECONFIG", "")
	if _, err := os.Stat(clientcmd.RecommendedHomeFile); err == nil {
		t.Skipf("%s exists", clientcmd.RecommendedHomeFile)
	}
	if _, err := NewClientset(""); err == nil || !strings.Contains(err.Error(), "not running in a cluster") {
		t.Fatalf("no config at all: err = %v", err)
	}
}
