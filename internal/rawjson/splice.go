package rawjson

// Spliced is an edited document held as the pieces it is made of, in
// order: spans of the parsed source and the edits' own bytes, none of them
// copied. Its bytes are those Apply returns. A PD leg's request body is
// one: the prompt stays where the client's body put it, and the transport
// copies the pieces once, into its write buffer.
type Spliced struct {
	parts [][]byte // nil: the document is one piece
	one   []byte
	n     int
}

// Whole is b as a Spliced of one piece.
func Whole(b []byte) Spliced { return Spliced{one: b, n: len(b)} }

// Len is the document's length in bytes.
func (s Spliced) Len() int { return s.n }

// NumParts is how many pieces there are; none is empty but a Whole one.
func (s Spliced) NumParts() int {
	if s.parts == nil {
		return 1
	}
	return len(s.parts)
}

// Part is the i-th piece. It aliases the source or an edit: read it,
// never write it.
func (s Spliced) Part(i int) []byte {
	if s.parts == nil {
		return s.one
	}
	return s.parts[i]
}

// AppendTo appends the document's bytes to dst.
func (s Spliced) AppendTo(dst []byte) []byte {
	if s.parts == nil {
		return append(dst, s.one...)
	}
	for _, p := range s.parts {
		dst = append(dst, p...)
	}
	return dst
}

// Bytes is the document in one slice: its only piece, or a copy of all.
func (s Spliced) Bytes() []byte {
	if s.parts == nil {
		return s.one
	}
	return s.AppendTo(make([]byte, 0, s.n))
}

// spliceMin: a document shorter than this is spliced into one piece, a
// copy, as Apply makes it: its pieces (24 bytes each, two or three per
// edit: about 350 bytes for a prefill's five) would cost about as much as
// its bytes. So a leg holds at most this much of its own.
const spliceMin = 512

// Splice is Apply without the copy: the same document as pieces that
// alias the source and the edits' values, which must stay unchanged for
// as long as the result is used. A short source is copied (spliceMin).
func (o *Object) Splice(edits ...Edit) Spliced {
	if len(edits) == 0 {
		return Whole(o.src)
	}
	if len(o.src) < spliceMin {
		return Whole(o.Apply(edits...))
	}
	return o.pieces(edits)
}

// pieces is Splice whatever the source's length.
func (o *Object) pieces(edits []Edit) Spliced {
	// Each edit adds up to two pieces per occurrence of its key (the
	// bytes before the value, the value), a new member two; the first
	// member's comma, the rest of the source and its tail add three.
	var newBuf [editScan]newMember
	parts, news, tail := o.splice(make([][]byte, 0, 2*len(edits)+3), newBuf[:0], edits)
	if len(news) > 0 {
		lit := make([]byte, 0, newRoom(news)) // the keys and separators
		for _, m := range news {
			a := len(lit)
			lit = m.appendKey(lit)
			parts = append(parts, lit[a:len(lit):len(lit)])
			parts = addPart(parts, m.value)
		}
	}
	parts = addPart(parts, tail)
	n := 0
	for _, p := range parts {
		n += len(p)
	}
	return Spliced{parts: parts, n: n}
}

// newMember is a member an edit adds, after the last one kept.
type newMember struct {
	key   string
	value []byte
	comma bool // after another member
}

// appendKey appends the separator, the key and the colon.
func (m newMember) appendKey(dst []byte) []byte {
	if m.comma {
		dst = append(dst, ',')
	}
	dst = AppendString(dst, m.key) // json.Marshal's bytes (FuzzAppendString)
	return append(dst, ':')
}

// newRoom is room for the new members' keys, separators and values (a
// key that needs escaping grows it).
func newRoom(news []newMember) int {
	n := 0
	for _, m := range news {
		n += len(m.key) + 4 + len(m.value)
	}
	return n
}

// addPart appends b to parts unless it is empty.
func addPart(parts [][]byte, b []byte) [][]byte {
	if len(b) > 0 {
		parts = append(parts, b)
	}
	return parts
}

// splice is the edited document (see Apply) as three things: the pieces
// of the source and the replaced values up to where new members go,
// appended to parts; the new members, appended to news; the source's
// tail after them (whitespace and the closing brace).
func (o *Object) splice(parts [][]byte, news []newMember, edits []Edit) ([][]byte, []newMember, []byte) {
	// The last edit of a key is the one applied. A few edits are found by
	// a scan, more through a map.
	var byKey map[string]int
	if len(edits) > editScan {
		byKey = make(map[string]int, len(edits))
		for i, e := range edits {
			byKey[e.Key] = i
		}
	}
	find := func(k string) (int, bool) {
		if byKey != nil {
			i, ok := byKey[k]
			return i, ok
		}
		for i := len(edits) - 1; i >= 0; i-- {
			if edits[i].Key == k {
				return i, true
			}
		}
		return 0, false
	}
	var usedBuf [editScan]bool
	var used []bool
	if len(edits) > editScan {
		used = make([]bool, len(edits))
	} else {
		used = usedBuf[:len(edits)]
	}
	// The source not yet taken is src[from:pos] (a run of untouched
	// bytes), pos the end of the last member seen.
	from, pos := 0, o.open+1
	wrote := false // a member is in the document
	for _, m := range o.members {
		idx, touched := find(m.Key)
		if touched {
			used[idx] = true
			if edits[idx].Delete {
				parts = addPart(parts, o.src[from:pos])
				from, pos = m.end, m.end
				continue
			}
		}
		if !wrote { // the first member kept: no comma before it
			if c := leadingComma(o.src[pos:m.start]); c >= 0 {
				parts = addPart(parts, o.src[from:pos+c])
				from = pos + c + 1
			}
		}
		wrote = true
		if !touched {
			pos = m.end
			continue
		}
		// keep the separators and the key, replace the value
		parts = addPart(parts, o.src[from:m.end-len(m.Value)])
		parts = addPart(parts, edits[idx].Value)
		from, pos = m.end, m.end
	}
	parts = addPart(parts, o.src[from:pos])
	for i, e := range edits {
		if used[i] || e.Delete {
			continue
		}
		if last, _ := find(e.Key); last != i {
			continue // a later edit of the key is the one applied
		}
		news = append(news, newMember{key: e.Key, value: e.Value, comma: wrote})
		wrote = true
		used[i] = true
	}
	return parts, news, o.src[pos:]
}

// leadingComma is the offset of the comma in seg when seg is whitespace
// and a comma (the separator before a member), else -1.
func leadingComma(seg []byte) int {
	i := 0
	for i < len(seg) && isSpace(seg[i]) {
		i++
	}
	if i < len(seg) && seg[i] == ',' {
		return i
	}
	return -1
}
