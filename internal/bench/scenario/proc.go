package scenario

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

// stopGrace is how long a child gets between SIGTERM and SIGKILL.
const stopGrace = 5 * time.Second

// proc is one started child process. Every child runs in its own process
// group (so a terminal's Ctrl-C reaches only sybench, which then stops the
// children in order) and gets SIGKILL if sybench itself dies (Pdeathsig).
type proc struct {
	name    string
	cmd     *exec.Cmd
	logPath string
	done    chan struct{}
	waitErr error // valid after done is closed
	// firstLine receives the first stdout line (vllm-sim's ready line).
	firstLine chan string
}

// Pid returns the child's process id.
func (p *proc) Pid() int { return p.cmd.Process.Pid }

// exited reports whether the process has ended.
func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// stop sends SIGTERM to the child's process group, then SIGKILL after
// stopGrace, and waits for it.
func (p *proc) stop() {
	if p.exited() {
		return
	}
	pid := p.cmd.Process.Pid
	_ = syscall.Kill(-pid, syscall.SIGTERM)
	t := time.NewTimer(stopGrace)
	defer t.Stop()
	select {
	case <-p.done:
	case <-t.C:
		_ = syscall.Kill(-pid, syscall.SIGKILL)
		<-p.done
	}
	// Anything left in the group (there should be nothing) goes too.
	_ = syscall.Kill(-pid, syscall.SIGKILL)
}

// logTail returns the last n bytes of the child's log, starting at a line.
func (p *proc) logTail(n int) string {
	b, err := os.ReadFile(p.logPath)
	if err != nil {
		return ""
	}
	return tailLines(b, n)
}

func tailLines(b []byte, n int) string {
	if len(b) > n {
		b = b[len(b)-n:]
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			b = b[i+1:]
		}
	}
	return strings.TrimRight(string(b), "\n")
}

// crashSummary describes how a child ended: its exit status and the first
// panic line (or the last log lines).
func (p *proc) crashSummary() string {
	status := "exited"
	if p.waitErr != nil {
		status = p.waitErr.Error()
	}
	b, _ := os.ReadFile(p.logPath)
	// The log opens with the command line; the reason is in what follows.
	if bytes.HasPrefix(b, []byte("# ")) {
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			b = b[i+1:]
		}
	}
	if i := bytes.Index(b, []byte("panic: ")); i >= 0 {
		line := b[i:]
		if j := bytes.IndexByte(line, '\n'); j >= 0 {
			line = line[:j]
		}
		// The goroutine trace's first frame names the culprit.
		rest := b[i:]
		frame := ""
		if k := bytes.Index(rest, []byte("\ngoroutine ")); k >= 0 {
			lines := strings.SplitN(string(rest[k+1:]), "\n", 4)
			if len(lines) >= 3 {
				frame = " at " + strings.TrimSpace(lines[2])
			}
		}
		return fmt.Sprintf("%s (%s): %s%s", p.name, status, line, frame)
	}
	return fmt.Sprintf("%s (%s); log tail:\n%s", p.name, status, tailLines(b, 600))
}

// lineCatcher copies a child's stdout to w and delivers the first line.
type lineCatcher struct {
	w    io.Writer
	mu   sync.Mutex
	buf  []byte
	sent bool
	ch   chan string
}

func (c *lineCatcher) Write(p []byte) (int, error) {
	c.mu.Lock()
	if !c.sent {
		c.buf = append(c.buf, p...)
		if i := bytes.IndexByte(c.buf, '\n'); i >= 0 {
			c.ch <- string(c.buf[:i])
			c.sent, c.buf = true, nil
		} else if len(c.buf) > 64<<10 {
			c.ch <- string(c.buf)
			c.sent, c.buf = true, nil
		}
	}
	c.mu.Unlock()
	return c.w.Write(p)
}

// group owns every child a scenario starts and guarantees they are gone
// when stopAll returns.
type group struct {
	binDir string
	logDir string
	mu     sync.Mutex
	procs  []*proc
	seq    int
}

func newGroup(binDir, logDir string) *group { return &group{binDir: binDir, logDir: logDir} }

// start runs binDir/bin with args; stdout's first line is delivered on
// proc.firstLine; stdout and stderr go to logDir/<name>.log.
func (g *group) start(name, bin string, args ...string) (*proc, error) {
	return g.startEnv(name, bin, nil, args...)
}

// startEnv is start with the child's environment (nil: sybench's own).
func (g *group) startEnv(name, bin string, env []string, args ...string) (*proc, error) {
	g.mu.Lock()
	g.seq++
	seq := g.seq
	g.mu.Unlock()
	path := bin // an absolute path runs as is (peer routers, nginx)
	if !filepath.IsAbs(bin) {
		path = filepath.Join(g.binDir, bin)
	}
	if _, err := os.Stat(path); err != nil {
		if filepath.IsAbs(bin) {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		return nil, fmt.Errorf("%s: %w (build it with: go build -o %s/ ./cmd/...)", path, err, g.binDir)
	}
	logPath := filepath.Join(g.logDir, fmt.Sprintf("%02d-%s.log", seq, name))
	lf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_TRUNC|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(lf, "# %s %s\n", path, strings.Join(args, " "))
	cmd := exec.Command(path, args...)
	cmd.Env = env
	lc := &lineCatcher{w: lf, ch: make(chan string, 1)}
	cmd.Stdout = lc
	cmd.Stderr = lf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		lf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, logPath: logPath, done: make(chan struct{}), firstLine: lc.ch}
	go func() {
		p.waitErr = cmd.Wait()
		lf.Close()
		close(p.done)
	}()
	g.mu.Lock()
	g.procs = append(g.procs, p)
	g.mu.Unlock()
	return p, nil
}

// stop stops the given processes concurrently and forgets them.
func (g *group) stop(ps ...*proc) {
	var wg sync.WaitGroup
	for _, p := range ps {
		if p != nil {
			wg.Go(p.stop)
		}
	}
	wg.Wait()
	g.mu.Lock()
	defer g.mu.Unlock()
	keep := g.procs[:0]
	for _, q := range g.procs {
		gone := false
		for _, p := range ps {
			gone = gone || p == q
		}
		if !gone {
			keep = append(keep, q)
		}
	}
	g.procs = keep
}

// stopAll stops every child still known to the group.
func (g *group) stopAll() {
	g.mu.Lock()
	ps := append([]*proc(nil), g.procs...)
	g.mu.Unlock()
	g.stop(ps...)
}

// dead returns an error describing the first started process that has
// exited, or nil.
func dead(ps ...*proc) error {
	for _, p := range ps {
		if p != nil && p.exited() {
			return errors.New(p.crashSummary())
		}
	}
	return nil
}
