package legctx

import "sync"

// AfterFuncs is a context's AfterFunc registrations, guarded by the
// context's own mutex: context.AfterFunc's contract for a context type of
// this project's (the context package's children follow such a context
// through its AfterFunc method). The first two registrations (a PD
// attempt's legs) are kept inline, not allocated one by one.
type AfterFuncs struct {
	mu   *sync.Mutex // the owner's
	list []*afterFn
	buf  [2]afterFn
	ptrs [2]*afterFn
	used int // buf slots handed out
}

// afterFn is one registration.
type afterFn struct {
	a *AfterFuncs
	f func()
}

// Add registers f and returns its stop function; the owner holds mu (its
// mutex, the same on every call) and has checked that it has not ended.
func (a *AfterFuncs) Add(mu *sync.Mutex, f func()) (stop func() bool) {
	a.mu = mu
	var r *afterFn
	if a.used < len(a.buf) {
		r = &a.buf[a.used]
		a.used++
	} else {
		r = new(afterFn)
	}
	r.a, r.f = a, f
	if a.list == nil {
		a.list = a.ptrs[:0]
	}
	a.list = append(a.list, r)
	return r.stop
}

// Len is the number of registrations pending (mu held).
func (a *AfterFuncs) Len() int { return len(a.list) }

// Take removes every registration and returns their functions' runner:
// the owner calls Take with mu held, as it ends, and the returned Fire
// after releasing mu.
func (a *AfterFuncs) Take() Fire {
	l := a.list
	a.list = nil
	return Fire(l)
}

// Fire runs taken registrations, each in its own goroutine.
type Fire []*afterFn

// Run starts them.
func (f Fire) Run() {
	for _, r := range f {
		go r.f()
	}
}

// Stopped is the stop function of a registration on an ended context.
func Stopped() bool { return false }

func (r *afterFn) stop() bool {
	a := r.a
	a.mu.Lock()
	defer a.mu.Unlock()
	for i, b := range a.list {
		if b == r {
			a.list = append(a.list[:i], a.list[i+1:]...)
			return true
		}
	}
	return false
}

// Slots holds up to two registrations, each under an id of its own,
// guarded by the owner's mutex: abort hooks (Ctx.HookAbort) and children
// following a parent in place (Follower).
type Slots[T any] struct {
	seq uint64
	s   [2]slot[T]
}

// slot is one registration; id 0 is a free slot.
type slot[T any] struct {
	id uint64
	v  T
}

// Put stores v and returns its id, or false when both slots are taken.
func (s *Slots[T]) Put(v T) (id uint64, ok bool) {
	for i := range s.s {
		if s.s[i].id == 0 {
			s.seq++
			s.s[i] = slot[T]{id: s.seq, v: v}
			return s.seq, true
		}
	}
	return 0, false
}

// Remove drops the registration id and reports whether it was there.
func (s *Slots[T]) Remove(id uint64) bool {
	for i := range s.s {
		if id != 0 && s.s[i].id == id {
			s.s[i] = slot[T]{}
			return true
		}
	}
	return false
}

// Has reports whether slot i holds a registration (tests).
func (s *Slots[T]) Has(i int) bool { return s.s[i].id != 0 }

// Take empties the slots and returns what they held.
func (s *Slots[T]) Take() Taken[T] {
	t := Taken[T](s.s)
	s.s = [2]slot[T]{}
	return t
}

// Taken is what Take emptied, to run once the owner's mutex is released.
type Taken[T any] [2]slot[T]

// Each calls f with every registration taken.
func (t Taken[T]) Each(f func(T)) {
	for _, s := range t {
		if s.id != 0 {
			f(s.v)
		}
	}
}
