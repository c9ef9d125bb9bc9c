// Package deploy holds the container image and Kubernetes/Helm artifacts.
// Neither docker nor helm runs on the build machines, so this test lints
// them structurally: every manifest parses into objects with apiVersion,
// kind and metadata.name and decodes strictly into its k8s.io/api type
// (test-only import); the router's container args are accepted by
// config.Parse and config.Validate; the manifests agree with each other
// (selectors, Services, proxy_ip); and the Helm chart is rendered with a
// small Helm-compatible template engine for each preset and checked the
// same way.
package deploy

import (
	"bytes"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"text/template"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"sigs.k8s.io/yaml"

	"github.com/switchyard-llm/switchyard/internal/config"
)

type obj = map[string]any

// get walks a path of map keys and list indexes ("spec.template.spec.containers.0").
func get(o any, path string) any {
	for _, p := range strings.Split(path, ".") {
		switch v := o.(type) {
		case map[string]any:
			o = v[p]
		case []any:
			i, err := strconv.Atoi(p)
			if err != nil || i >= len(v) {
				return nil
			}
			o = v[i]
		default:
			return nil
		}
	}
	return o
}

func str(o any, path string) string { s, _ := get(o, path).(string); return s }
func list(o any, path string) []any { l, _ := get(o, path).([]any); return l }
func mapAt(o any, path string) obj  { m, _ := get(o, path).(map[string]any); return m }

var docSep = regexp.MustCompile(`(?m)^---\s*$`)

// parseDocs splits a multi-document YAML stream and checks every object's
// identity fields.
func parseDocs(t *testing.T, name string, data []byte) []obj {
	t.Helper()
	var out []obj
	for i, doc := range docSep.Split(string(data), -1) {
		if strings.TrimSpace(stripComments(doc)) == "" {
			continue
		}
		var o obj
		if err := yaml.UnmarshalStrict([]byte(doc), &o); err != nil {
			t.Errorf("%s: document %d: %v", name, i, err)
			continue
		}
		for _, f := range []string{"apiVersion", "kind", "metadata.name"} {
			if str(o, f) == "" {
				t.Errorf("%s: document %d: missing %s", name, i, f)
			}
		}
		// Strict decoding into the API type catches misspelt or misplaced fields.
		if typed := typedFor(str(o, "apiVersion"), str(o, "kind")); typed != nil {
			if err := yaml.UnmarshalStrict([]byte(doc), typed); err != nil {
				t.Errorf("%s: document %d (%s %s): %v", name, i, o["kind"], str(o, "metadata.name"), err)
			}
		} else if o["kind"] != "ServiceMonitor" {
			t.Errorf("%s: document %d: unexpected %s %s", name, i, o["apiVersion"], o["kind"])
		}
		out = append(out, o)
	}
	return out
}

// typedFor returns an empty API object for the kinds the artifacts use.
func typedFor(apiVersion, kind string) any {
	switch apiVersion + " " + kind {
	case "apps/v1 Deployment":
		return &appsv1.Deployment{}
	case "v1 Service":
		return &corev1.Service{}
	case "v1 ServiceAccount":
		return &corev1.ServiceAccount{}
	case "rbac.authorization.k8s.io/v1 Role":
		return &rbacv1.Role{}
	case "rbac.authorization.k8s.io/v1 RoleBinding":
		return &rbacv1.RoleBinding{}
	case "rbac.authorization.k8s.io/v1 ClusterRole":
		return &rbacv1.ClusterRole{}
	case "rbac.authorization.k8s.io/v1 ClusterRoleBinding":
		return &rbacv1.ClusterRoleBinding{}
	case "policy/v1 PodDisruptionBudget":
		return &policyv1.PodDisruptionBudget{}
	}
	return nil
}

func stripComments(doc string) string {
	var b strings.Builder
	for _, l := range strings.Split(doc, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(l), "#") {
			b.WriteString(l + "\n")
		}
	}
	return b.String()
}

// podSpec returns the pod template spec of a workload.
func podSpec(o obj) obj { return mapAt(o, "spec.template.spec") }

func containers(o obj) []obj {
	var out []obj
	for _, c := range list(podSpec(o), "containers") {
		out = append(out, c.(map[string]any))
	}
	return out
}

// expandArgs applies Kubernetes $(VAR) expansion with the container's env;
// downward-API values get sample values.
func expandArgs(c obj) []string {
	env := map[string]string{}
	for _, e := range list(c, "env") {
		name := str(e, "name")
		switch {
		case get(e, "value") != nil:
			env[name] = str(e, "value")
		case str(e, "valueFrom.fieldRef.fieldPath") == "metadata.namespace":
			env[name] = "vllm"
		case str(e, "valueFrom.fieldRef.fieldPath") == "status.podIP":
			env[name] = "10.0.0.1"
		}
	}
	var args []string
	for _, a := range list(c, "args") {
		s, ok := a.(string)
		if !ok {
			s = fmt.Sprint(a) // a YAML number: Kubernetes rejects it; reported below
		}
		for k, v := range env {
			s = strings.ReplaceAll(s, "$("+k+")", v)
		}
		args = append(args, s)
	}
	return args
}

// checkRouter validates a switchyard container: its args parse and validate,
// and its probes and ports are the router's.
func checkRouter(t *testing.T, where string, d obj) *config.Config {
	t.Helper()
	var c obj
	for _, x := range containers(d) {
		if str(x, "name") == "switchyard" {
			c = x
		}
	}
	if c == nil {
		t.Fatalf("%s: no switchyard container", where)
	}
	for _, a := range list(c, "args") {
		if _, ok := a.(string); !ok {
			t.Errorf("%s: arg %v is not a string (quote it)", where, a)
		}
	}
	args := expandArgs(c)
	cfg, err := config.Parse(args)
	if err != nil {
		t.Fatalf("%s: config.Parse(%q): %v", where, args, err)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatalf("%s: config.Validate(%q): %v", where, args, err)
	}
	if cfg.Host != "0.0.0.0" || cfg.PrometheusHost != "0.0.0.0" {
		t.Errorf("%s: router must listen on 0.0.0.0 (host %q, prometheus-host %q)", where, cfg.Host, cfg.PrometheusHost)
	}
	if p := str(c, "livenessProbe.httpGet.path"); p != "/liveness" {
		t.Errorf("%s: liveness probe path %q", where, p)
	}
	if p := str(c, "readinessProbe.httpGet.path"); p != "/readiness" {
		t.Errorf("%s: readiness probe path %q", where, p)
	}
	ports := map[string]int{}
	for _, p := range list(c, "ports") {
		ports[str(p, "name")] = int(get(p, "containerPort").(float64))
	}
	if ports["http"] != int(cfg.Port) || ports["metrics"] != int(cfg.PrometheusPort) {
		t.Errorf("%s: container ports %v do not match --port %d / --prometheus-port %d", where, ports, cfg.Port, cfg.PrometheusPort)
	}
	if cfg.VLLMDiscoveryAddress != "" {
		_, port, _ := strings.Cut(cfg.VLLMDiscoveryAddress, ":")
		if strconv.Itoa(ports["zmq"]) != port {
			t.Errorf("%s: zmq container port %d, --vllm-discovery-address %s", where, ports["zmq"], cfg.VLLMDiscoveryAddress)
		}
	}
	if get(podSpec(d), "serviceAccountName") == nil {
		t.Errorf("%s: no serviceAccountName", where)
	}
	if u := get(podSpec(d), "securityContext.runAsUser"); u != float64(65532) {
		t.Errorf("%s: runAsUser %v, want 65532 (the image's user)", where, u)
	}
	return cfg
}

// checkWorkloads checks selector/label consistency of Deployments and that
// every Service selects some pod template.
func checkWorkloads(t *testing.T, where string, objs []obj) {
	t.Helper()
	var podLabels []obj
	for _, o := range objs {
		if o["kind"] != "Deployment" {
			continue
		}
		tl := mapAt(o, "spec.template.metadata.labels")
		for k, v := range mapAt(o, "spec.selector.matchLabels") {
			if tl[k] != v {
				t.Errorf("%s: Deployment %s: selector %s=%v not in the pod labels", where, str(o, "metadata.name"), k, v)
			}
		}
		podLabels = append(podLabels, tl)
	}
	for _, o := range objs {
		if o["kind"] != "Service" {
			continue
		}
		sel := mapAt(o, "spec.selector")
		if !slices.ContainsFunc(podLabels, func(l obj) bool { return subset(sel, l) }) {
			t.Errorf("%s: Service %s selects no pod template", where, str(o, "metadata.name"))
		}
	}
}

func subset(sel, labels obj) bool {
	if len(sel) == 0 {
		return false
	}
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}

func anyMap(m map[string]string) obj {
	out := obj{}
	for k, v := range m {
		out[k] = v
	}
	return out
}

func byKind(objs []obj, kind string) []obj {
	var out []obj
	for _, o := range objs {
		if o["kind"] == kind {
			out = append(out, o)
		}
	}
	return out
}

func byName(objs []obj, kind, name string) obj {
	for _, o := range objs {
		if o["kind"] == kind && str(o, "metadata.name") == name {
			return o
		}
	}
	return nil
}

func readDocs(t *testing.T, path string) []obj {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return parseDocs(t, path, data)
}

func TestKubernetesManifests(t *testing.T) {
	var files []string
	err := filepath.WalkDir("kubernetes", func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() && (strings.HasSuffix(p, ".yaml") || strings.HasSuffix(p, ".yml")) {
			files = append(files, p)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(files) < 5 {
		t.Fatalf("found only %d manifests: %v", len(files), files)
	}
	all := map[string][]obj{}
	for _, f := range files {
		all[f] = readDocs(t, f)
	}
	rbac := all[filepath.Join("kubernetes", "rbac.yaml")]
	if byName(rbac, "ServiceAccount", "switchyard") == nil {
		t.Fatal("rbac.yaml: no ServiceAccount switchyard")
	}
	for _, f := range []string{"rbac.yaml", "rbac-clusterwide.yaml"} {
		objs := all[filepath.Join("kubernetes", f)]
		var role obj
		for _, o := range objs {
			if o["kind"] == "Role" || o["kind"] == "ClusterRole" {
				role = o
			}
		}
		if role == nil || !grantsPodWatch(role) {
			t.Errorf("%s: no (Cluster)Role granting get/list/watch on pods", f)
		}
	}

	// Each directory is one deployable example: its router's selectors
	// must select its vLLM pods, and ZMQ registration must reach the router.
	for _, dir := range []string{"pod-discovery", "zmq-discovery"} {
		var objs []obj
		for f, o := range all {
			if filepath.Dir(f) == filepath.Join("kubernetes", dir) {
				objs = append(objs, o...)
			}
		}
		checkWorkloads(t, dir, objs)
		var routers, prefill, decode []obj
		for _, d := range byKind(objs, "Deployment") {
			switch {
			case slices.ContainsFunc(containers(d), func(c obj) bool { return str(c, "name") == "switchyard" }):
				routers = append(routers, d)
			case mapAt(d, "spec.template.metadata.labels")["app"] == "vllm-prefill":
				prefill = append(prefill, d)
			case mapAt(d, "spec.template.metadata.labels")["app"] == "vllm-decode":
				decode = append(decode, d)
			}
		}
		if len(routers) != 1 || len(prefill) != 1 || len(decode) != 1 {
			t.Fatalf("%s: want one router, one prefill and one decode Deployment; got %d, %d, %d", dir, len(routers), len(prefill), len(decode))
		}
		router := routers[0]
		cfg := checkRouter(t, dir, router)
		if sa := str(podSpec(router), "serviceAccountName"); byName(rbac, "ServiceAccount", sa) == nil {
			t.Errorf("%s: router uses ServiceAccount %q, not defined in rbac.yaml", dir, sa)
		}
		if cfg.Mode() != config.ModeVLLMPD {
			t.Errorf("%s: router is not in PD mode", dir)
		}
		switch dir {
		case "pod-discovery":
			if !cfg.ServiceDiscovery || cfg.ServiceDiscoveryNamespace != "vllm" {
				t.Errorf("pod-discovery: --service-discovery %v, namespace %q", cfg.ServiceDiscovery, cfg.ServiceDiscoveryNamespace)
			}
			if n := get(router, "spec.replicas"); n.(float64) < 2 {
				t.Errorf("pod-discovery: %v router replicas, want several", n)
			}
			if !subset(anyMap(cfg.PrefillSelectorMap()), mapAt(prefill[0], "spec.template.metadata.labels")) ||
				!subset(anyMap(cfg.DecodeSelectorMap()), mapAt(decode[0], "spec.template.metadata.labels")) {
				t.Errorf("pod-discovery: router selectors %v / %v do not select the vLLM pods", cfg.PrefillSelectorMap(), cfg.DecodeSelectorMap())
			}
			if subset(anyMap(cfg.PrefillSelectorMap()), mapAt(decode[0], "spec.template.metadata.labels")) {
				t.Error("pod-discovery: the prefill selector also selects the decode pods")
			}
			if mapAt(prefill[0], "spec.template.metadata.annotations")["vllm.ai/bootstrap-port"] == nil {
				t.Error("pod-discovery: prefill pods lack the vllm.ai/bootstrap-port annotation")
			}
			for _, d := range []obj{prefill[0], decode[0]} {
				c := containers(d)[0]
				if str(c, "readinessProbe.httpGet.path") == "" {
					t.Errorf("pod-discovery: %s has no readiness probe (the router routes to Ready pods)", str(d, "metadata.name"))
				}
				if !slices.ContainsFunc(list(c, "ports"), func(p any) bool { return get(p, "containerPort") == float64(cfg.ServiceDiscoveryPort) }) {
					t.Errorf("pod-discovery: %s does not serve on --service-discovery-port %d", str(d, "metadata.name"), cfg.ServiceDiscoveryPort)
				}
			}
		case "zmq-discovery":
			if n := get(router, "spec.replicas"); n != float64(1) || str(router, "spec.strategy.type") != "Recreate" {
				t.Errorf("zmq-discovery: a ZMQ fleet has exactly one router (replicas %v, strategy %q)", n, str(router, "spec.strategy.type"))
			}
			_, zport, _ := strings.Cut(cfg.VLLMDiscoveryAddress, ":")
			for _, d := range []obj{prefill[0], decode[0]} {
				extra := kvExtra(t, containers(d)[0])
				svc := byName(objs, "Service", fmt.Sprint(extra["proxy_ip"]))
				if svc == nil {
					t.Fatalf("zmq-discovery: %s: proxy_ip %v is not a Service of the example", str(d, "metadata.name"), extra["proxy_ip"])
				}
				if get(svc, "spec.publishNotReadyAddresses") != true {
					t.Errorf("zmq-discovery: Service %s must publish not-ready addresses (the router is Ready only after registrations)", str(svc, "metadata.name"))
				}
				if !subset(mapAt(svc, "spec.selector"), mapAt(router, "spec.template.metadata.labels")) {
					t.Errorf("zmq-discovery: Service %s does not select the router", str(svc, "metadata.name"))
				}
				if fmt.Sprint(get(svc, "spec.ports.0.port")) != zport || fmt.Sprint(extra["proxy_ping_port"]) != zport {
					t.Errorf("zmq-discovery: proxy_ping_port %v, Service port %v, router %s", extra["proxy_ping_port"], get(svc, "spec.ports.0.port"), cfg.VLLMDiscoveryAddress)
				}
			}
		}
	}
}

// kvExtra returns kv_connector_extra_config of a vLLM container's
// --kv-transfer-config.
func kvExtra(t *testing.T, c obj) map[string]any {
	t.Helper()
	args := expandArgs(c)
	i := slices.Index(args, "--kv-transfer-config")
	if i < 0 || i+1 >= len(args) {
		t.Fatalf("%s: no --kv-transfer-config", str(c, "name"))
	}
	var kv map[string]any
	if err := yaml.Unmarshal([]byte(args[i+1]), &kv); err != nil {
		t.Fatalf("--kv-transfer-config: %v", err)
	}
	extra, _ := kv["kv_connector_extra_config"].(map[string]any)
	return extra
}

func grantsPodWatch(role obj) bool {
	for _, r := range list(role, "rules") {
		var res, verbs []string
		for _, x := range list(r, "resources") {
			res = append(res, x.(string))
		}
		for _, x := range list(r, "verbs") {
			verbs = append(verbs, x.(string))
		}
		if slices.Contains(res, "pods") && slices.Contains(verbs, "get") && slices.Contains(verbs, "list") && slices.Contains(verbs, "watch") {
			return true
		}
	}
	return false
}

func TestDockerfile(t *testing.T) {
	data, err := os.ReadFile("Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	s := string(data)
	for _, want := range []string{"CGO_ENABLED=0", "FROM golang:${GO_VERSION} AS build", "ARG GO_VERSION=1.26",
		"distroless", "USER 65532", "EXPOSE 30000 29000 36367", "./cmd/switchyard", `ENTRYPOINT ["/usr/local/bin/switchyard"]`} {
		if !strings.Contains(s, want) {
			t.Errorf("Dockerfile lacks %q", want)
		}
	}
	if strings.Count(s, "\nFROM ") < 2 {
		t.Error("Dockerfile is not multi-stage")
	}
	// The image's default args must be accepted by the router.
	if _, err := config.Parse([]string{"--host", "0.0.0.0", "--prometheus-host", "0.0.0.0"}); err != nil {
		t.Error(err)
	}
}

// --- Helm ---------------------------------------------------------------

const chartDir = "helm/switchyard"

func readYAMLMap(t *testing.T, path string) obj {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var m obj
	if err := yaml.UnmarshalStrict(data, &m); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	if m == nil {
		m = obj{}
	}
	return m
}

// hasPath reports whether the dotted path exists in values.
func hasPath(values obj, path []string) bool {
	var cur any = values
	for _, p := range path {
		m, ok := cur.(map[string]any)
		if !ok {
			return false
		}
		if cur, ok = m[p]; !ok {
			return false
		}
	}
	return true
}

// leaves lists the dotted paths of every non-map value.
func leaves(m obj, prefix []string, out *[][]string) {
	for _, k := range slices.Sorted(maps.Keys(m)) {
		p := append(slices.Clone(prefix), k)
		if sub, ok := m[k].(map[string]any); ok && len(sub) > 0 {
			leaves(sub, p, out)
		} else {
			*out = append(*out, p)
		}
	}
}

// merge overlays src on dst as Helm coalesces values: maps merge, other
// values (lists included) replace.
func merge(dst, src obj) obj {
	out := maps.Clone(dst)
	for k, v := range src {
		if sm, ok := v.(map[string]any); ok {
			if dm, ok := out[k].(map[string]any); ok {
				out[k] = merge(dm, sm)
				continue
			}
		}
		out[k] = v
	}
	return out
}

var presets = []string{"values-regular.yaml", "values-pd-zmq.yaml", "values-pd-k8s.yaml"}

func TestHelmChartStructure(t *testing.T) {
	chart := readYAMLMap(t, filepath.Join(chartDir, "Chart.yaml"))
	for _, f := range []string{"apiVersion", "name", "version", "appVersion"} {
		if chart[f] == nil || chart[f] == "" {
			t.Errorf("Chart.yaml: missing %s", f)
		}
	}
	if chart["apiVersion"] != "v2" || chart["name"] != "switchyard" {
		t.Errorf("Chart.yaml: apiVersion %v name %v", chart["apiVersion"], chart["name"])
	}
	values := readYAMLMap(t, filepath.Join(chartDir, "values.yaml"))

	// A preset key absent from values.yaml is a typo Helm would ignore.
	for _, p := range presets {
		var paths [][]string
		leaves(readYAMLMap(t, filepath.Join(chartDir, p)), nil, &paths)
		if len(paths) == 0 {
			t.Errorf("%s is empty", p)
		}
		for _, path := range paths {
			if !hasPath(values, path) {
				t.Errorf("%s sets %s, which values.yaml does not define", p, strings.Join(path, "."))
			}
		}
	}

	// Every .Values reference (and $kube.x, an alias of
	// .Values.discovery.kubernetes) must exist in values.yaml.
	ref := regexp.MustCompile(`(\.Values|\$kube)((?:\.[A-Za-z0-9_]+)+)`)
	tpls, _ := filepath.Glob(filepath.Join(chartDir, "templates", "*"))
	if len(tpls) < 6 {
		t.Fatalf("templates: %v", tpls)
	}
	n := 0
	for _, f := range tpls {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range ref.FindAllStringSubmatch(string(data), -1) {
			path := strings.Split(strings.TrimPrefix(m[2], "."), ".")
			if m[1] == "$kube" {
				path = append([]string{"discovery", "kubernetes"}, path...)
			}
			n++
			if !hasPath(values, path) {
				t.Errorf("%s: %s%s is not defined in values.yaml", filepath.Base(f), m[1], m[2])
			}
		}
	}
	if n < 40 {
		t.Errorf("found only %d .Values references", n)
	}
}

// renderChart renders the chart's templates with values (already merged)
// the way Helm does: all files parsed into one template set, partials
// (_*.tpl) not rendered, missing keys rendered empty.
func renderChart(t *testing.T, values obj) (map[string]string, error) {
	t.Helper()
	chart := readYAMLMap(t, filepath.Join(chartDir, "Chart.yaml"))
	top := map[string]any{
		"Values":  values,
		"Release": map[string]any{"Name": "sy", "Namespace": "vllm", "Service": "Helm", "IsInstall": true},
		"Chart":   map[string]any{"Name": chart["name"], "Version": chart["version"], "AppVersion": chart["appVersion"]},
	}
	root := template.New("chart").Option("missingkey=zero")
	root.Funcs(helmFuncs(root))
	files, _ := filepath.Glob(filepath.Join(chartDir, "templates", "*"))
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := root.New(filepath.Base(f)).Parse(string(data)); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
	}
	out := map[string]string{}
	for _, f := range files {
		name := filepath.Base(f)
		if strings.HasPrefix(name, "_") {
			continue
		}
		var b bytes.Buffer
		if err := root.ExecuteTemplate(&b, name, top); err != nil {
			return nil, err
		}
		out[name] = strings.ReplaceAll(b.String(), "<no value>", "")
	}
	return out, nil
}

// helmFuncs implements the Helm/Sprig functions the chart uses, with their
// semantics.
func helmFuncs(root *template.Template) template.FuncMap {
	return template.FuncMap{
		"include": func(name string, data any) (string, error) {
			var b bytes.Buffer
			err := root.ExecuteTemplate(&b, name, data)
			return b.String(), err
		},
		"toYaml": func(v any) string {
			b, err := yaml.Marshal(v)
			if err != nil {
				return ""
			}
			return strings.TrimSuffix(string(b), "\n")
		},
		"nindent": func(n int, s string) string { return "\n" + indent(n, s) },
		"indent":  indent,
		"quote": func(vs ...any) string {
			var out []string
			for _, v := range vs {
				if v != nil {
					out = append(out, strconv.Quote(fmt.Sprint(v)))
				}
			}
			return strings.Join(out, " ")
		},
		"default": func(d any, given ...any) any {
			if len(given) == 0 || empty(given[0]) {
				return d
			}
			return given[0]
		},
		"empty": empty,
		"fail":  func(msg string) (string, error) { return "", errors.New(msg) },
		"trunc": func(n int, s string) string {
			if len(s) > n {
				return s[:n]
			}
			return s
		},
		"trimSuffix": func(suf, s string) string { return strings.TrimSuffix(s, suf) },
		"contains":   func(sub, s string) bool { return strings.Contains(s, sub) },
		"replace":    func(old, new, s string) string { return strings.ReplaceAll(s, old, new) },
		"int": func(v any) int {
			switch x := v.(type) {
			case float64:
				return int(x)
			case int:
				return x
			case string:
				n, _ := strconv.Atoi(x)
				return n
			}
			return 0
		},
	}
}

func indent(n int, s string) string {
	pad := strings.Repeat(" ", n)
	return pad + strings.ReplaceAll(s, "\n", "\n"+pad)
}

func empty(v any) bool {
	if v == nil {
		return true
	}
	rv := reflect.ValueOf(v)
	switch rv.Kind() {
	case reflect.String, reflect.Slice, reflect.Map, reflect.Array:
		return rv.Len() == 0
	case reflect.Bool:
		return !rv.Bool()
	case reflect.Int, reflect.Int64, reflect.Float64:
		return rv.IsZero()
	}
	return false
}

// renderObjects renders and parses every manifest (NOTES.txt only renders).
func renderObjects(t *testing.T, values obj) ([]obj, error) {
	t.Helper()
	out, err := renderChart(t, values)
	if err != nil {
		return nil, err
	}
	var objs []obj
	for _, name := range slices.Sorted(maps.Keys(out)) {
		if name == "NOTES.txt" {
			if !strings.Contains(out[name], "OpenAI API") {
				t.Errorf("NOTES.txt rendered as %q", out[name])
			}
			continue
		}
		objs = append(objs, parseDocs(t, name, []byte(out[name]))...)
	}
	return objs, nil
}

func TestHelmPresetsRender(t *testing.T) {
	base := readYAMLMap(t, filepath.Join(chartDir, "values.yaml"))
	for _, p := range presets {
		t.Run(p, func(t *testing.T) {
			values := merge(base, readYAMLMap(t, filepath.Join(chartDir, p)))
			objs, err := renderObjects(t, values)
			if err != nil {
				t.Fatalf("render: %v", err)
			}
			checkWorkloads(t, p, objs)
			deps := byKind(objs, "Deployment")
			if len(deps) != 1 {
				t.Fatalf("%d Deployments", len(deps))
			}
			cfg := checkRouter(t, p, deps[0])
			if got, want := get(deps[0], "spec.replicas"), get(values, "replicaCount"); got != want {
				t.Errorf("replicas %v, values %v", got, want)
			}
			sa := str(podSpec(deps[0]), "serviceAccountName")
			if byName(objs, "ServiceAccount", sa) == nil {
				t.Errorf("ServiceAccount %q not rendered", sa)
			}
			roles := append(byKind(objs, "Role"), byKind(objs, "ClusterRole")...)
			switch p {
			case "values-regular.yaml":
				if cfg.Mode() != config.ModeRegular || len(cfg.WorkerURLs) != 2 || len(roles) != 0 {
					t.Errorf("regular: mode %s, workers %v, %d roles", cfg.Mode(), cfg.WorkerURLs, len(roles))
				}
			case "values-pd-zmq.yaml":
				if cfg.Mode() != config.ModeVLLMPD || cfg.VLLMDiscoveryAddress != "0.0.0.0:36367" || cfg.KVConnector != "moriio" {
					t.Errorf("pd-zmq: mode %s, discovery %q, connector %s", cfg.Mode(), cfg.VLLMDiscoveryAddress, cfg.KVConnector)
				}
				svc := byName(objs, "Service", "sy-switchyard-discovery")
				if svc == nil || get(svc, "spec.publishNotReadyAddresses") != true || get(svc, "spec.ports.0.port") != float64(36367) {
					t.Errorf("pd-zmq: discovery Service = %v", svc)
				}
				if str(deps[0], "spec.strategy.type") != "Recreate" {
					t.Error("pd-zmq: a ZMQ router must be replaced with Recreate (never two at once)")
				}
			case "values-pd-k8s.yaml":
				if cfg.Mode() != config.ModeVLLMPD || !cfg.ServiceDiscovery || cfg.ServiceDiscoveryNamespace != "vllm" ||
					cfg.PrefillSelectorMap()["app"] != "vllm-prefill" || cfg.DecodeSelectorMap()["app"] != "vllm-decode" ||
					cfg.ServiceDiscoveryPort != 8000 || cfg.DPSizeAnnotation != "vllm.ai/dp-size" {
					t.Errorf("pd-k8s: %+v", cfg)
				}
				if len(byKind(objs, "Role")) != 1 || len(byKind(objs, "RoleBinding")) != 1 || !grantsPodWatch(byKind(objs, "Role")[0]) {
					t.Error("pd-k8s: want a Role granting pod get/list/watch and its RoleBinding")
				}
				rb := byKind(objs, "RoleBinding")[0]
				if str(rb, "subjects.0.name") != sa || str(rb, "roleRef.name") != str(byKind(objs, "Role")[0], "metadata.name") {
					t.Errorf("pd-k8s: RoleBinding %v does not bind the router's ServiceAccount to the Role", rb)
				}
				if get(deps[0], "spec.replicas") != float64(2) || len(byKind(objs, "PodDisruptionBudget")) != 1 {
					t.Error("pd-k8s: want 2 replicas and a PodDisruptionBudget")
				}
			}
		})
	}
}

func TestHelmVariants(t *testing.T) {
	base := readYAMLMap(t, filepath.Join(chartDir, "values.yaml"))
	preset := func(p string) obj { return merge(base, readYAMLMap(t, filepath.Join(chartDir, p))) }
	set := func(v obj, path string, x any) obj {
		keys := strings.Split(path, ".")
		over := obj{keys[len(keys)-1]: x}
		for i := len(keys) - 2; i >= 0; i-- {
			over = obj{keys[i]: over}
		}
		return merge(v, over)
	}

	// Refusals that would otherwise be a crash-looping router.
	for _, tc := range []struct {
		name   string
		values obj
		want   string
	}{
		{"defaults alone", base, "no workers"},
		{"zmq with 2 replicas", set(preset("values-pd-zmq.yaml"), "replicaCount", float64(2)), "replicaCount 1"},
		{"moriio without zmq", set(preset("values-pd-k8s.yaml"), "router.kvConnector", "moriio"), "needs discovery.zmq"},
		{"zmq in regular mode", set(preset("values-regular.yaml"), "discovery.zmq.enabled", true), "router.mode=pd"},
		{"bad mode", set(preset("values-regular.yaml"), "router.mode", "igw"), "router.mode must be"},
	} {
		if _, err := renderChart(t, tc.values); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want %q", tc.name, err, tc.want)
		}
	}

	// Every namespace: a ClusterRole, no namespace flag.
	v := set(preset("values-pd-k8s.yaml"), "discovery.kubernetes.allNamespaces", true)
	objs, err := renderObjects(t, v)
	if err != nil {
		t.Fatal(err)
	}
	cfg := checkRouter(t, "allNamespaces", byKind(objs, "Deployment")[0])
	if cfg.ServiceDiscoveryNamespace != "" || len(byKind(objs, "ClusterRole")) != 1 || len(byKind(objs, "ClusterRoleBinding")) != 1 || len(byKind(objs, "Role")) != 0 {
		t.Errorf("allNamespaces: namespace %q, kinds %v", cfg.ServiceDiscoveryNamespace, kinds(objs))
	}

	// Regular mode with pod discovery, static PD workers, ServiceMonitor and extras.
	v = set(set(preset("values-regular.yaml"), "router.workerUrls", []any{}), "discovery.kubernetes.enabled", true)
	v = set(set(v, "serviceMonitor.enabled", true), "router.extraArgs", []any{"--route-receipt"})
	v = set(set(v, "nodeSelector", obj{"gpu": "none"}), "image.tag", "v9")
	objs, err = renderObjects(t, v)
	if err != nil {
		t.Fatal(err)
	}
	d := byKind(objs, "Deployment")[0]
	cfg = checkRouter(t, "regular+k8s", d)
	if !cfg.ServiceDiscovery || cfg.SelectorMap()["app"] != "vllm" || !cfg.RouteReceipt || len(byKind(objs, "ServiceMonitor")) != 1 {
		t.Errorf("regular+k8s: %+v, kinds %v", cfg, kinds(objs))
	}
	if str(d, "spec.template.spec.nodeSelector.gpu") != "none" || str(d, "spec.template.spec.containers.0.image") != "ghcr.io/switchyard-llm/switchyard:v9" {
		t.Errorf("regular+k8s: nodeSelector/image not applied: %v", podSpec(d))
	}

	v = set(preset("values-pd-k8s.yaml"), "discovery.kubernetes.enabled", false)
	v = set(v, "router.prefill", []any{obj{"url": "http://p0:8000", "bootstrapPort": float64(8998)}, obj{"url": "http://p1:8000"}})
	v = set(v, "router.decode", []any{"http://d0:8000"})
	objs, err = renderObjects(t, v)
	if err != nil {
		t.Fatal(err)
	}
	cfg = checkRouter(t, "static pd", byKind(objs, "Deployment")[0])
	if len(cfg.Prefill) != 2 || cfg.Prefill[0].BootstrapPort == nil || *cfg.Prefill[0].BootstrapPort != 8998 ||
		cfg.Prefill[1].BootstrapPort != nil || len(cfg.Decode) != 1 || len(byKind(objs, "Role")) != 0 {
		t.Errorf("static pd: prefill %+v decode %v kinds %v", cfg.Prefill, cfg.Decode, kinds(objs))
	}
}

func kinds(objs []obj) []string {
	var out []string
	for _, o := range objs {
		out = append(out, fmt.Sprint(o["kind"]))
	}
	return out
}
