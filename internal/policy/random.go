package policy

// Random picks a uniformly random usable worker.
type Random struct{ base }

var _ Policy = (*Random)(nil)

func newRandom(o Options) *Random { return &Random{base{name: NameRandom, o: o}} }

// Pick implements Policy.
func (p *Random) Pick(req *Request, c Candidates) (Choice, error) {
	req = orEmpty(req)
	i := sample(req, c.Workers, p.o.Rand, -1)
	if i < 0 {
		return Choice{}, ErrNoWorker
	}
	return p.choice(c.Workers[i], "random"), nil
}
