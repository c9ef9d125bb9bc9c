package rawjson

import "encoding/json"

// AppendString appends s as a JSON string literal, byte for byte what
// encoding/json.Marshal writes (HTML characters escaped too). Printable
// ASCII without a quote, backslash or HTML character is copied as it is;
// anything else goes through encoding/json.
func AppendString(dst []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c >= 0x7f || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			b, _ := json.Marshal(s)
			return append(dst, b...)
		}
	}
	dst = append(dst, '"')
	dst = append(dst, s...)
	return append(dst, '"')
}
