package scenario

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"
)

// scenarioReport is what runScenario needs of a scenario's report.
type scenarioReport interface {
	WriteMarkdown(w io.Writer) error
	// head returns the report's wall time and notes.
	head() (elapsed *time.Duration, notes *[]string)
}

func (r *PDReport) head() (*time.Duration, *[]string)       { return &r.Elapsed, &r.Notes }
func (r *OverheadReport) head() (*time.Duration, *[]string) { return &r.Elapsed, &r.Notes }
func (r *CeilingReport) head() (*time.Duration, *[]string)  { return &r.Elapsed, &r.Notes }
func (r *CompareReport) head() (*time.Duration, *[]string)  { return &r.Elapsed, &r.Notes }
func (r *RelayReport) head() (*time.Duration, *[]string)    { return &r.Elapsed, &r.Notes }

// scenarioFile is one output written under --out-dir.
type scenarioFile[R any] struct {
	name  string
	write func(rep R, w io.Writer) error
}

// scenarioSpec describes one scenario for runScenario.
type scenarioSpec[R scenarioReport] struct {
	name    string        // "pd", "overhead", "ceiling"
	defMax  time.Duration // default --max-duration
	skipped string        // what a reached --max-duration skips: "points", "steps"
	// report builds the empty report once the environment is up.
	report func(e *env) R
	// run measures into rep.
	run func(ctx context.Context, e *env, rep R) error
	// partial, if set, reports whether the Markdown of a failed run is
	// still worth printing.
	partial func(rep R) bool
	files   []scenarioFile[R]
}

// runScenario is the driver every scenario shares: it starts the
// environment, runs the measurements, prints the Markdown and writes the
// outputs; every child process is stopped on return.
func runScenario[R scenarioReport](ctx context.Context, o Options, s scenarioSpec[R]) (rep R, err error) {
	e, ctx, cancel, err := setup(ctx, o, s.defMax)
	if err != nil {
		return rep, err
	}
	defer cancel()
	defer func() { e.finish(err) }()
	rep = s.report(e)
	elapsed, notes := rep.head()
	e.printf("scenario %s: %s; logs in %s\n", s.name, e.m, e.o.LogDir)

	runErr := s.run(ctx, e, rep)
	*elapsed = time.Since(e.start)
	if runErr != nil && !errors.Is(runErr, errBudget) {
		if s.partial != nil && s.partial(rep) {
			_ = rep.WriteMarkdown(e.o.Out)
		}
		return rep, runErr
	}
	if errors.Is(runErr, errBudget) {
		*notes = append(*notes, fmt.Sprintf("The scenario's --max-duration (%v) was reached; the remaining %s were skipped.", e.o.MaxDuration, s.skipped))
	}
	e.printf("\n")
	if err := rep.WriteMarkdown(e.o.Out); err != nil {
		return rep, err
	}
	e.printf("scenario %s finished in %s\n", s.name, sec(*elapsed))
	for _, f := range s.files {
		p, err := e.writeOut(f.name, func(w io.Writer) error { return f.write(rep, w) })
		if err != nil {
			return rep, err
		}
		if p != "" {
			e.printf("wrote %s\n", p)
		}
	}
	return rep, nil
}
