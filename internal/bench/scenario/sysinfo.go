package scenario

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// clockTicks is USER_HZ, the unit of utime/stime in /proc/<pid>/stat. It is
// 100 on every Linux architecture Go supports (sysconf(_SC_CLK_TCK) needs
// cgo).
const clockTicks = 100

// raiseNoFileLimit sets RLIMIT_NOFILE's soft limit to its hard limit. An
// explicit Setrlimit also stops os/exec from restoring the original soft
// limit in children, so the router and the workers inherit the raised one.
func raiseNoFileLimit() (uint64, error) {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		return 0, err
	}
	rl.Cur = rl.Max
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		return 0, err
	}
	return rl.Cur, nil
}

// parseProcStat returns utime+stime (clock ticks) from /proc/<pid>/stat
// contents. The command name (field 2) may contain spaces and parentheses,
// so fields are counted after the last ')'.
func parseProcStat(b []byte) (uint64, error) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("malformed stat %q", b)
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3 (state); utime is field 14, stime field 15.
	if len(f) < 13 {
		return 0, fmt.Errorf("short stat %q", b)
	}
	u, err := strconv.ParseUint(f[11], 10, 64)
	if err != nil {
		return 0, err
	}
	s, err := strconv.ParseUint(f[12], 10, 64)
	if err != nil {
		return 0, err
	}
	return u + s, nil
}

// cpuTime returns the CPU time (user+system) a process has used so far.
func cpuTime(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	t, err := parseProcStat(b)
	if err != nil {
		return 0, err
	}
	return time.Duration(t) * time.Second / clockTicks, nil
}

// cpuTimes sums cpuTime over pids (errors count as 0: a process that is gone
// cannot be measured, and the scenario reports dead children separately).
func cpuTimes(pids ...int) time.Duration {
	var sum time.Duration
	for _, p := range pids {
		t, _ := cpuTime(p)
		sum += t
	}
	return sum
}

// procFDs counts a process's open file descriptors.
func procFDs(pid int) int {
	es, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return 0
	}
	return len(es)
}

// procRSS returns VmRSS in bytes.
func procRSS(pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	return parseVmRSS(b)
}

func parseVmRSS(b []byte) int64 {
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
			f := strings.Fields(v)
			if len(f) >= 1 {
				kb, _ := strconv.ParseInt(f[0], 10, 64)
				return kb << 10
			}
		}
	}
	return 0
}

// sampler records the peak fd count, RSS and goroutine count of a process
// while running.
type sampler struct {
	stop       chan struct{}
	done       chan struct{}
	fds        int
	rss        int64
	goroutines int // peak go_goroutines of metricsURL (0: not sampled)
}

// startSampler samples pid every period; with metricsURL (a Prometheus
// endpoint of that process) it also reads go_goroutines.
func startSampler(pid int, every time.Duration, metricsURL string) *sampler {
	s := &sampler{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			s.fds = max(s.fds, procFDs(pid))
			s.rss = max(s.rss, procRSS(pid))
			if metricsURL != "" {
				s.goroutines = max(s.goroutines, scrapeGauge(metricsURL, "go_goroutines", every))
			}
			select {
			case <-s.stop:
				return
			case <-t.C:
			}
		}
	}()
	return s
}

// finish stops sampling and returns the peaks.
func (s *sampler) finish() (fds int, rss int64, goroutines int) {
	close(s.stop)
	<-s.done
	return s.fds, s.rss, s.goroutines
}

// scrapeGauge reads one unlabelled gauge from a Prometheus text endpoint
// (0 when it cannot be read within timeout).
func scrapeGauge(url, name string, timeout time.Duration) int {
	c := http.Client{Timeout: timeout}
	resp, err := c.Get(url)
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	return parseGauge(resp.Body, name)
}

// parseGauge finds "name value" in a Prometheus text exposition.
func parseGauge(r io.Reader, name string) int {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err == nil {
				return int(f)
			}
		}
	}
	return 0
}

// machine describes where a scenario ran.
type machine struct {
	CPUModel string
	Cores    int
	Date     time.Time
	Go       string
	Commit   string
	LoadAvg  string // at the start
	NoFile   uint64
}

func cpuModel() string {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return "unknown"
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return "unknown"
}

func gitCommit() string {
	out, err := exec.Command("git", "rev-parse", "--short", "HEAD").Output()
	if err != nil {
		return "unknown"
	}
	c := strings.TrimSpace(string(out))
	if st, err := exec.Command("git", "status", "--porcelain", "--untracked-files=no").Output(); err == nil && len(bytes.TrimSpace(st)) > 0 {
		c += " (uncommitted changes)"
	}
	return c
}

func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}

func currentMachine(nofile uint64) machine {
	return machine{
		CPUModel: cpuModel(),
		Cores:    runtime.NumCPU(),
		Date:     time.Now().UTC(),
		Go:       runtime.Version(),
		Commit:   gitCommit(),
		LoadAvg:  loadAvg(),
		NoFile:   nofile,
	}
}

// String is one Markdown line.
func (m machine) String() string {
	return fmt.Sprintf("%s, %d cores (shared), %s, %s, commit %s, load average at start %s, RLIMIT_NOFILE %d",
		m.CPUModel, m.Cores, m.Date.Format("2006-01-02 15:04 MST"), m.Go, m.Commit, m.LoadAvg, m.NoFile)
}
