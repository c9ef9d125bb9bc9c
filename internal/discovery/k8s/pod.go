package k8s

import (
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

// Removal reasons (the vllm_router_discovery_workers_removed_total label).
const (
	reasonDeleted      = "deleted"       // pod deleted (or its tombstone seen)
	reasonUnselected   = "unselected"    // labels no longer match the selector
	reasonTerminating  = "terminating"   // deletionTimestamp set
	reasonNotRunning   = "not_running"   // phase other than Running
	reasonNotReady     = "not_ready"     // Ready condition not True
	reasonNoIP         = "no_ip"         // no pod IP
	reasonBadIP        = "bad_ip"        // pod IP that makes no valid URL
	reasonReplaced     = "replaced"      // IP, role, DP size or bootstrap port changed
	reasonConflict     = "conflict"      // another instance holds the worker key
	reasonNoModel      = "no_model"      // multi-model mode: the pod names no model
	reasonModelPending = "model_pending" // multi-model mode: the pod's model is being asked for
)

// podView is what one informer last saw of one pod; nil means the pod is
// not (or no longer) selected by that informer.
type podView struct {
	role          worker.Role
	phase         string
	ready         bool
	terminating   bool
	ip            string
	url           string // "" when ip is empty or unusable
	dpSize        int
	bootstrapPort int    // prefill only; 0 = connector default
	kvEventsPort  int    // KV event publisher port; 0 = the router's --kv-events-port
	model         string // multi-model mode: the model the pod names
	noModel       bool   // multi-model mode and the pod names none
	modelPending  bool   // multi-model mode: Options.Model has not named it yet
	warn          string // annotation problems, logged once per value
}

// ineligible returns why the pod must not be routed, or "".
func (v *podView) ineligible() string {
	switch {
	case v.terminating:
		return reasonTerminating
	case v.phase != string(corev1.PodRunning):
		return reasonNotRunning
	case !v.ready:
		return reasonNotReady
	case v.ip == "":
		return reasonNoIP
	case v.url == "":
		return reasonBadIP
	case v.modelPending:
		return reasonModelPending
	case v.noModel:
		return reasonNoModel
	}
	return ""
}

// podState is the source's record of one pod (namespace/name), across
// informers. The worker instance key is the pod key.
type podState struct {
	key      string
	views    []*podView    // by watcher index; lower index wins (prefill over decode)
	applied  []worker.Spec // specs in the registry; nil = none
	conflict string        // instance holding one of our keys, "" = none
	cause    string        // why the last view was cleared
	lastWarn string        // last annotation warning logged
}

// current returns the view that decides the pod's role: the first informer
// (prefill before decode) that selects it.
func (p *podState) current() (*podView, worker.Role) {
	for _, v := range p.views {
		if v != nil {
			return v, v.role
		}
	}
	return nil, worker.RoleRegular
}

func (p *podState) seen() bool {
	v, _ := p.current()
	return v != nil
}

// viewOf evaluates a pod as selected by an informer of role.
func (s *Source) viewOf(pod *corev1.Pod, role worker.Role) *podView {
	v := &podView{
		role:        role,
		phase:       string(pod.Status.Phase),
		terminating: pod.DeletionTimestamp != nil,
		ip:          pod.Status.PodIP,
		dpSize:      s.opts.DefaultDPSize,
	}
	if v.phase == "" {
		v.phase = string(corev1.PodUnknown)
	}
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			v.ready = c.Status == corev1.ConditionTrue
		}
	}
	if v.ip != "" && net.ParseIP(v.ip) != nil {
		u := "http://" + net.JoinHostPort(v.ip, strconv.Itoa(s.opts.Port))
		if base, rank, err := worker.NormalizeURL(u); err == nil && rank < 0 {
			v.url = base
		}
	}
	var warns []string
	if a, ok := pod.Annotations[s.opts.DPSizeAnnotation]; ok {
		n, err := strconv.Atoi(strings.TrimSpace(a))
		if err != nil || n < 1 || n > MaxDPSize {
			warns = append(warns, fmt.Sprintf("annotation %s=%q is not a DP size in 1..%d; using %d",
				s.opts.DPSizeAnnotation, a, MaxDPSize, s.opts.DefaultDPSize))
		} else {
			v.dpSize = n
		}
	}
	if role == worker.RolePrefill {
		if a, ok := pod.Annotations[s.opts.BootstrapPortAnnotation]; ok {
			n, err := strconv.Atoi(strings.TrimSpace(a))
			if err != nil || n < 1 || n > 65535 {
				warns = append(warns, fmt.Sprintf("annotation %s=%q is not a port; using the connector's default bootstrap port",
					s.opts.BootstrapPortAnnotation, a))
			} else {
				v.bootstrapPort = n
			}
		}
	}
	if a, ok := pod.Annotations[KVEventsPortAnnotation]; ok {
		n, err := strconv.Atoi(strings.TrimSpace(a))
		if err != nil || n < 1 || n > 65535 {
			warns = append(warns, fmt.Sprintf("annotation %s=%q is not a port; using --kv-events-port", KVEventsPortAnnotation, a))
		} else {
			v.kvEventsPort = n
		}
	}
	if s.opts.Models {
		v.model = podModel(pod)
		switch {
		case v.model != "":
		case s.opts.Model != nil && v.url != "":
			v.model, _ = s.opts.Model(hostPort(v.url))
			v.modelPending = v.model == ""
		default:
			v.noModel = true
			warns = append(warns, fmt.Sprintf("pod names no model (annotation or label %s); it is not routed", ModelAnnotation))
		}
	}
	v.warn = strings.Join(warns, "; ")
	return v
}

// hostPort is the host:port of a worker base URL.
func hostPort(url string) string {
	return strings.TrimPrefix(strings.TrimPrefix(url, "http://"), "https://")
}

// podModel is the model a pod names: its ModelAnnotation, else its label
// of that name.
func podModel(pod *corev1.Pod) string {
	if m := strings.TrimSpace(pod.Annotations[ModelAnnotation]); m != "" {
		return m
	}
	return strings.TrimSpace(pod.Labels[ModelAnnotation])
}

// specs are the registry entries of an eligible view: one per DP rank.
func (v *podView) specs(instance string) []worker.Spec {
	spec := worker.Spec{
		URL: v.url, Role: v.role, DPRank: -1, TPSize: 1,
		Source: worker.SourceK8s, Instance: instance, ModelID: v.model,
	}
	if v.role == worker.RolePrefill {
		spec.BootstrapPort = v.bootstrapPort
	}
	spec.KVEventsPort = v.kvEventsPort
	return worker.ExpandDP(spec, v.dpSize)
}

// reconcileLocked makes the registry match the pod's current view. The
// caller holds s.mu. It never blocks on anything but the registry's lock.
func (s *Source) reconcileLocked(st *podState) {
	v, role := st.current()
	var want []worker.Spec
	reason := st.cause
	if v != nil {
		if v.warn != st.lastWarn {
			if v.warn != "" {
				s.log.Warn("kubernetes discovery: "+v.warn, "pod", st.key, "role", role.String())
			}
			st.lastWarn = v.warn
		}
		if reason = v.ineligible(); reason == "" {
			want = v.specs(st.key)
		}
	}
	reg := s.opts.Registry

	if want == nil {
		s.setConflictLocked(st, "")
		if st.applied != nil {
			s.removeLocked(st, reason)
		}
		return
	}
	if slices.Equal(want, st.applied) && s.presentLocked(st) {
		return
	}
	if other := s.conflictFor(st.key, want); other != "" {
		if st.conflict == "" {
			s.log.Warn("kubernetes discovery: pod not routed: its worker URL is already registered by another instance",
				"pod", st.key, "role", role.String(), "url", v.url, "other_instance", other)
			if m := s.opts.Metrics; m != nil {
				m.DiscoveryDropped.WithLabelValues(reasonConflict).Inc()
			}
		}
		s.setConflictLocked(st, other)
		if st.applied != nil {
			s.removeLocked(st, reasonConflict)
		}
		return
	}
	s.setConflictLocked(st, "")

	old := st.applied
	restored := slices.Equal(want, old) // an admin removed them; put them back
	replaced := old != nil && !restored
	_, changed := reg.UpsertWith(st.key, want, time.Now(), nil)
	st.applied = want
	if m := s.opts.Metrics; m != nil && changed {
		m.DiscoveryUpdates.Inc()
		m.DiscoveryAdded.Inc()
		if replaced {
			m.DiscoveryRemoved.WithLabelValues(reasonReplaced).Inc()
		}
	}
	attrs := []any{"pod", st.key, "role", role.String(), "url", v.url, "dp_size", v.dpSize}
	if v.model != "" {
		attrs = append(attrs, "model", v.model)
	}
	if role == worker.RolePrefill && v.bootstrapPort > 0 {
		attrs = append(attrs, "bootstrap_port", v.bootstrapPort)
	}
	switch {
	case restored:
		s.log.Info("kubernetes discovery: pod workers restored", attrs...)
	case replaced:
		attrs = append(attrs, "old_url", old[0].URL, "old_role", old[0].Role.String(), "old_dp_size", old[0].DPSize)
		s.log.Info("kubernetes discovery: pod changed; workers replaced", attrs...)
	default:
		s.log.Info("kubernetes discovery: pod added", attrs...)
	}
}

// presentLocked reports whether every applied worker is still in the
// registry under this pod's instance (an admin may have removed one).
func (s *Source) presentLocked(st *podState) bool {
	for _, sp := range st.applied {
		w := s.opts.Registry.Get(sp.Key())
		if w == nil || w.Instance != st.key {
			return false
		}
	}
	return true
}

// conflictFor returns the instance that already holds one of the keys, or "".
func (s *Source) conflictFor(instance string, specs []worker.Spec) string {
	for _, sp := range specs {
		if w := s.opts.Registry.Get(sp.Key()); w != nil && w.Instance != instance {
			return w.Source.String() + " " + w.Instance
		}
	}
	return ""
}

func (s *Source) setConflictLocked(st *podState, other string) {
	switch {
	case st.conflict == "" && other != "":
		s.conflicts++
	case st.conflict != "" && other == "":
		s.conflicts--
	}
	st.conflict = other
	s.hasConflicts.Store(s.conflicts > 0)
}

func (s *Source) removeLocked(st *podState, reason string) {
	removed := s.opts.Registry.RemoveInstance(st.key)
	role := st.applied[0].Role
	url := st.applied[0].URL
	st.applied = nil
	if m := s.opts.Metrics; m != nil && len(removed) > 0 {
		m.DiscoveryUpdates.Inc()
		m.DiscoveryRemoved.WithLabelValues(reason).Inc()
	}
	s.log.Info("kubernetes discovery: pod removed", "pod", st.key, "role", role.String(), "url", url,
		"reason", reason, "workers", len(removed))
}

// slimPod is the informers' transform: the cache keeps only what discovery
// reads (metadata without managed fields, phase, IPs and conditions), not
// the pod spec.
func slimPod(obj any) (any, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil
	}
	out := &corev1.Pod{TypeMeta: p.TypeMeta, ObjectMeta: p.ObjectMeta}
	out.ManagedFields = nil
	const lastApplied = "kubectl.kubernetes.io/last-applied-configuration"
	if _, ok := p.Annotations[lastApplied]; ok {
		a := make(map[string]string, len(p.Annotations)-1)
		for k, v := range p.Annotations {
			if k != lastApplied {
				a[k] = v
			}
		}
		out.Annotations = a
	}
	out.Status = corev1.PodStatus{
		Phase:      p.Status.Phase,
		PodIP:      p.Status.PodIP,
		PodIPs:     p.Status.PodIPs,
		Conditions: p.Status.Conditions,
	}
	return out, nil
}

// routeKlog sends client-go's klog output to log.
func routeKlog(log *slog.Logger) {
	klog.SetSlogLogger(log)
}
