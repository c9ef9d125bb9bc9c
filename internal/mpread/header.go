package mpread

// Family is the kind of value a type byte starts.
type Family uint8

// The msgpack families. Int holds the positive and negative fixints and
// int 8..64; Uint holds uint 8..64; Ext holds ext 8..32 and fixext.
const (
	Invalid Family = iota // 0xc1
	Nil
	Bool
	Int
	Uint
	Float
	Str
	Bin
	Ext
	Array
	Map
)

var familyNames = [...]string{"invalid", "nil", "bool", "int", "uint", "float", "str", "bin", "ext", "array", "map"}

func (f Family) String() string {
	if int(f) < len(familyNames) {
		return familyNames[f]
	}
	return "unknown"
}

// FamilyOf classifies a type byte.
func FamilyOf(c byte) Family {
	switch {
	case c <= 0x7f || c >= 0xe0:
		return Int
	case c <= 0x8f:
		return Map
	case c <= 0x9f:
		return Array
	case c <= 0xbf:
		return Str
	}
	switch c {
	case 0xc0:
		return Nil
	case 0xc2, 0xc3:
		return Bool
	case 0xc4, 0xc5, 0xc6:
		return Bin
	case 0xc7, 0xc8, 0xc9, 0xd4, 0xd5, 0xd6, 0xd7, 0xd8:
		return Ext
	case 0xca, 0xcb:
		return Float
	case 0xcc, 0xcd, 0xce, 0xcf:
		return Uint
	case 0xd0, 0xd1, 0xd2, 0xd3:
		return Int
	case 0xd9, 0xda, 0xdb:
		return Str
	case 0xdc, 0xdd:
		return Array
	case 0xde, 0xdf:
		return Map
	}
	return Invalid
}

// Header is what a value's header says about it. Reader.Header has checked
// that Body bytes and Children values can fit in the input that follows.
type Header struct {
	Code   byte // the type byte
	Family Family
	// Len is the declared length: data bytes of a str, bin or ext (its
	// type byte excluded), elements of an array, entries of a map; 0 for
	// the others.
	Len int
	// Body is how many bytes after the header belong to the value itself:
	// a number's, the data of a str or bin, an ext's type byte and data;
	// 0 for nil, bools, fixints and containers.
	Body int
	// Children is how many values nested in it follow: Len for an array,
	// 2*Len for a map (keys and values), 0 for the others.
	Children int
}
