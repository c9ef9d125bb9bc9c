package policy

// PowerOfTwo draws two distinct usable workers at random and takes the one
// with the lower load (see base.load; the first draw wins ties).
type PowerOfTwo struct{ base }

var _ Policy = (*PowerOfTwo)(nil)

func newPowerOfTwo(o Options) *PowerOfTwo { return &PowerOfTwo{base{name: NamePowerOfTwo, o: o}} }

// Pick implements Policy.
func (p *PowerOfTwo) Pick(req *Request, c Candidates) (Choice, error) {
	req = orEmpty(req)
	ws := c.Workers
	i := sample(req, ws, p.o.Rand, -1)
	if i < 0 {
		return Choice{}, ErrNoWorker
	}
	j := sample(req, ws, p.o.Rand, i)
	if j < 0 {
		return p.choice(ws[i], "p2c single"), nil
	}
	li, lj := p.load(ws[i]), p.load(ws[j])
	if lj < li {
		return p.choice(ws[j], p2cReason(lj, '<', li)), nil
	}
	op := byte('<')
	if li == lj {
		op = '='
	}
	return p.choice(ws[i], p2cReason(li, op, lj)), nil
}

// p2cReason is "p2c 1<4": the chosen load, then the other's.
func p2cReason(a int64, op byte, b int64) string {
	var buf [48]byte
	s := append(buf[:0], "p2c "...)
	s = appendInt(s, a)
	s = append(s, op)
	s = appendInt(s, b)
	return string(s)
}
