package policy

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

func chatBody(parts ...string) []byte {
	var sb strings.Builder
	sb.WriteString(`{"model":"m","messages":[`)
	for i, p := range parts {
		if i > 0 {
			sb.WriteByte(',')
		}
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		fmt.Fprintf(&sb, `{"role":%q,"content":%q}`, role, p)
	}
	sb.WriteString(`]}`)
	return []byte(sb.String())
}

func randomText(r *rand.Rand, n int) string {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte('a' + r.IntN(26))
	}
	return string(b)
}

func newCA(t testing.TB, o Options) *CacheAware {
	t.Helper()
	return mustNew(t, NameCacheAware, o).(*CacheAware)
}

func TestCacheAwareConversationAffinity(t *testing.T) {
	ws := mkWorkers(4)
	c := Candidates{Gen: 1, Workers: ws}
	p := newCA(t, testOptions(11))
	r := rand.New(rand.NewPCG(1, 1))
	home := map[int]string{}
	opening := make([]string, 20)
	for i := range opening {
		opening[i] = fmt.Sprint("conversation ", i, ": ", randomText(r, 200))
	}
	hits := 0
	for turn := range 5 {
		for conv := range 20 {
			history := []string{opening[conv]}
			for k := range turn {
				history = append(history, fmt.Sprint("reply ", k), fmt.Sprint("follow-up ", k))
			}
			ch, err := p.Pick(&Request{Body: chatBody(history...)}, c)
			if err != nil {
				t.Fatal(err)
			}
			if turn == 0 {
				home[conv] = ch.Worker.Key()
				continue
			}
			if ch.Worker.Key() != home[conv] {
				t.Fatalf("turn %d of conversation %d went to %s, first turn to %s (%s)", turn, conv, ch.Worker.Key(), home[conv], ch.Reason)
			}
			if strings.HasPrefix(ch.Reason, "cache match ") {
				hits++
			}
		}
	}
	if hits != 80 {
		t.Fatalf("%d/80 follow-up turns were cache matches", hits)
	}
	spread := map[string]bool{}
	for _, k := range home {
		spread[k] = true
	}
	if len(spread) < 3 {
		t.Fatalf("20 new conversations used only %d workers", len(spread))
	}
}

func TestCacheAwareSpreadsDiversePrompts(t *testing.T) {
	ws := mkWorkers(4)
	p := newCA(t, testOptions(3))
	r := rand.New(rand.NewPCG(2, 2))
	counts := map[string]int{}
	for range 200 {
		body := fmt.Sprintf(`{"prompt":%q}`, randomText(r, 100))
		counts[pickKey(t, p, &Request{Body: []byte(body)}, Candidates{Gen: 1, Workers: ws})]++
	}
	for _, w := range ws {
		if counts[w.Key()] < 25 {
			t.Errorf("%s got %d/200 diverse prompts", w.Key(), counts[w.Key()])
		}
	}
}

func TestCacheAwareImbalance(t *testing.T) {
	m := metrics.NewForTest()
	ws := mkWorkers(3)
	c := Candidates{Gen: 1, Workers: ws}
	o := testOptions(4)
	o.Metrics = m
	p := newCA(t, o)
	prompt := []byte(`{"prompt":"` + strings.Repeat("shared system prompt ", 20) + `"}`)
	first, _ := p.Pick(&Request{Body: prompt}, c)
	hot := first.Worker

	// 100 in flight on the cached worker, 0 elsewhere: imbalanced.
	var releases []func()
	for range 100 {
		releases = append(releases, hot.Acquire())
	}
	ch, err := p.Pick(&Request{Body: prompt}, c)
	if err != nil {
		t.Fatal(err)
	}
	if ch.Worker == hot || !strings.HasPrefix(ch.Reason, "imbalance, least load 0") {
		t.Fatalf("imbalanced fleet: picked %s (%s)", ch.Worker.Key(), ch.Reason)
	}
	if counterValue(t, m.LBEvents) != 1 || gaugeValue(t, m.MaxLoad) != 100 || gaugeValue(t, m.MinLoad) != 0 {
		t.Fatal("imbalance metrics not recorded")
	}
	// Below the absolute threshold the cache wins again.
	for _, rel := range releases[:50] {
		rel()
	}
	// Both the hot worker and the one the imbalance chose now hold the prompt.
	if again, _ := p.Pick(&Request{Body: prompt}, c); again.Worker != hot && again.Worker != ch.Worker || !strings.HasPrefix(again.Reason, "cache match") {
		t.Fatalf("balanced again but picked %s (%s)", again.Worker.Key(), again.Reason)
	}
	for _, rel := range releases[50:] {
		rel()
	}
}

// REFERENCE §10.3: the imbalance must be computed over usable workers only;
// a loaded but unhealthy worker must not force least-load routing.
func TestCacheAwareImbalanceIgnoresUnusable(t *testing.T) {
	ws := mkWorkers(3)
	c := Candidates{Gen: 1, Workers: ws}
	p := newCA(t, testOptions(4))
	prompt := []byte(`{"prompt":"` + strings.Repeat("a long cached prefix ", 20) + `"}`)
	first, _ := p.Pick(&Request{Body: prompt}, c)
	var sick *worker.Worker
	for _, w := range ws {
		if w != first.Worker {
			sick = w
			break
		}
	}
	for range 200 {
		defer sick.Acquire()()
	}
	sick.SetHealthy(false)
	ch, _ := p.Pick(&Request{Body: prompt}, c)
	if ch.Worker != first.Worker || !strings.HasPrefix(ch.Reason, "cache match") {
		t.Fatalf("picked %s (%s), want cache match on %s", ch.Worker.Key(), ch.Reason, first.Worker.Key())
	}
}

// The longest match wins; when its worker is unusable the next-longest
// usable match is taken if still above the threshold.
func TestCacheAwareLongestUsableMatch(t *testing.T) {
	ws := mkWorkers(3)
	c := Candidates{Gen: 1, Workers: ws}
	p := newCA(t, testOptions(4))
	base := strings.Repeat("x", 100)
	p.tree.Insert(base+"-short", p.tree.Tenant(ws[0].Key()))
	p.tree.Insert(base+"-short and then a much longer tail", p.tree.Tenant(ws[1].Key()))
	req := func() *Request {
		return &Request{Body: []byte(`{"prompt":"` + base + `-short and then a much longer tail!"}`)}
	}
	if ch, _ := p.Pick(req(), c); ch.Worker != ws[1] {
		t.Fatalf("longest match: picked %s (%s)", ch.Worker.Key(), ch.Reason)
	}
	ws[1].SetHealthy(false)
	if ch, _ := p.Pick(req(), c); ch.Worker != ws[0] || !strings.HasPrefix(ch.Reason, "cache match") {
		t.Fatalf("fallback to shorter usable match: picked %s (%s)", ch.Worker.Key(), ch.Reason)
	}
	ws[1].SetHealthy(true)
	r := req()
	r.Exclude = map[string]bool{ws[1].Key(): true, ws[0].Key(): true}
	if ch, _ := p.Pick(r, c); ch.Worker != ws[2] || !strings.HasPrefix(ch.Reason, "least load") {
		t.Fatalf("retry excluding both cached workers: picked %s (%s)", ch.Worker.Key(), ch.Reason)
	}
}

func TestCacheAwareThreshold(t *testing.T) {
	ws := mkWorkers(2)
	c := Candidates{Gen: 1, Workers: ws}
	o := testOptions(4)
	o.CacheThreshold = 0.5
	p := newCA(t, o)
	p.tree.Insert("0123456789", p.tree.Tenant(ws[0].Key()))
	release := ws[0].Acquire() // make ws[1] the least-loaded choice
	defer release()
	tests := []struct {
		prompt string
		want   *worker.Worker
	}{
		{"0123456789abcd", ws[0]},            // 10/14 > 0.5
		{"01234zzzzz", ws[1]},                // 5/10 is not > 0.5
		{"0123456789" + "0123456789", ws[1]}, // 10/20 is not > 0.5 (and ws[1] now has it)
	}
	for _, tt := range tests {
		got := pickKey(t, p, &Request{Body: []byte(`{"prompt":"` + tt.prompt + `"}`)}, c)
		if got != tt.want.Key() {
			t.Errorf("%q: picked %s want %s", tt.prompt, got, tt.want.Key())
		}
	}
}

func TestCacheAwareEvictBoundsTree(t *testing.T) {
	m := metrics.NewForTest()
	ws := mkWorkers(3)
	o := testOptions(6)
	o.MaxTreeSize = 500
	o.Metrics = m
	p := newCA(t, o)
	r := rand.New(rand.NewPCG(9, 9))
	for range 100 {
		body := fmt.Sprintf(`{"prompt":%q}`, randomText(r, 80))
		pickKey(t, p, &Request{Body: []byte(body)}, Candidates{Gen: 1, Workers: ws})
	}
	over := false
	for _, w := range ws {
		over = over || p.Size(w.Key()) > 500
	}
	if !over {
		t.Fatal("test did not overfill the tree")
	}
	if p.Evict() == 0 {
		t.Fatal("nothing evicted")
	}
	for _, w := range ws {
		if s := p.Size(w.Key()); s > 500 || s < 400 {
			t.Errorf("%s holds %d chars after eviction to 500", w.Key(), s)
		}
		if g := gaugeValue(t, m.TreeSize.WithLabelValues(w.Key())); int(g) != p.Size(w.Key()) {
			t.Errorf("tree size gauge %v, size %d", g, p.Size(w.Key()))
		}
	}
}

// The eviction goroutine runs every EvictionInterval and stops on Close;
// synctest's fake clock makes this exact without sleeping.
func TestCacheAwareEvictionLoop(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ws := mkWorkers(2)
		o := testOptions(1)
		o.EvictionInterval = time.Minute
		o.MaxTreeSize = 50
		p, err := New(NameCacheAware, o)
		if err != nil {
			t.Fatal(err)
		}
		ca := p.(*CacheAware)
		for i := range 20 {
			body := fmt.Sprintf(`{"prompt":"prompt number %d with some padding text"}`, i)
			pickKey(t, p, &Request{Body: []byte(body)}, Candidates{Gen: 1, Workers: ws})
		}
		if ca.Size(ws[0].Key()) <= 50 && ca.Size(ws[1].Key()) <= 50 {
			t.Fatal("not filled")
		}
		time.Sleep(59 * time.Second)
		synctest.Wait()
		if !ca.LastEviction().IsZero() {
			t.Fatal("evicted early")
		}
		time.Sleep(2 * time.Second)
		synctest.Wait()
		if ca.LastEviction().IsZero() {
			t.Fatal("no eviction after the interval")
		}
		for _, w := range ws {
			if s := ca.Size(w.Key()); s > 50 {
				t.Fatalf("%s: %d chars after eviction", w.Key(), s)
			}
		}
		if err := Close(p); err != nil {
			t.Fatal(err)
		}
		if err := Close(p); err != nil { // idempotent
			t.Fatal(err)
		}
	})
}

func TestCacheAwareRemoveWorker(t *testing.T) {
	ws := mkWorkers(2)
	m := metrics.NewForTest()
	o := testOptions(1)
	o.Metrics = m
	p := newCA(t, o)
	for i := range 10 {
		pickKey(t, p, &Request{Body: []byte(fmt.Sprintf(`{"prompt":"p%d"}`, i))}, Candidates{Gen: 1, Workers: ws})
	}
	if p.Size(ws[0].Key())+p.Size(ws[1].Key()) == 0 {
		t.Fatal("nothing cached")
	}
	RemoveWorker(p, ws[0].Key())
	if p.Size(ws[0].Key()) != 0 {
		t.Fatal("RemoveWorker kept the tenant")
	}
	p.Evict()
	if m.TreeSize.DeleteLabelValues(ws[0].Key()) {
		t.Fatal("eviction re-created the departed worker's tree-size series")
	}
	if !m.TreeSize.DeleteLabelValues(ws[1].Key()) {
		t.Fatal("no tree-size series for a live worker")
	}
	// The worker comes back in a new membership: it is cached and reported again.
	pickKey(t, p, &Request{Body: []byte(`{"prompt":"back"}`)}, Candidates{Gen: 2, Workers: ws[:1]})
	p.Evict()
	if !m.TreeSize.DeleteLabelValues(ws[0].Key()) || p.Size(ws[0].Key()) == 0 {
		t.Fatal("returning worker not tracked")
	}
}

func TestCacheAwareRegistrySubscription(t *testing.T) {
	reg := worker.NewRegistry(worker.BreakerConfig{})
	added, err := reg.Add(worker.Spec{URL: "http://a:1", DPRank: -1}, worker.Spec{URL: "http://b:1", DPRank: -1})
	if err != nil {
		t.Fatal(err)
	}
	o := testOptions(1)
	o.Registry = reg
	p, err := New(NameCacheAware, o)
	if err != nil {
		t.Fatal(err)
	}
	ca := p.(*CacheAware)
	snap := reg.Snapshot()
	for i := range 10 {
		pickKey(t, p, &Request{Body: []byte(fmt.Sprintf(`{"prompt":"prompt %d"}`, i))}, Candidates{Gen: snap.Gen, Workers: snap.Regular})
	}
	gone := added[0].Key()
	if ca.Size(gone) == 0 {
		t.Fatal("nothing cached for a")
	}
	reg.Remove(gone)
	if ca.Size(gone) != 0 {
		t.Fatal("registry removal did not clear the tenant")
	}
	_ = Close(p)
	// After Close the subscription is gone: a removal no longer reaches us.
	pickKey(t, p, &Request{Body: []byte(`{"prompt":"late"}`)}, Candidates{Gen: snap.Gen, Workers: snap.Regular[1:]})
	other := added[1].Key()
	before := ca.Size(other)
	reg.Remove(other)
	if ca.Size(other) != before {
		t.Fatal("closed policy still subscribed")
	}
}
