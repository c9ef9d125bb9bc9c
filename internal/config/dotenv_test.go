package config

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

func TestParseDotEnv(t *testing.T) {
	env := func(k string) (string, bool) {
		if k == "HOME" {
			return "/home/sy", true
		}
		return "", false
	}
	tests := []struct {
		name    string
		in      string
		want    []EnvVar
		wantErr string
	}{
		{"simple", "A=1\nB=two\n", []EnvVar{{"A", "1"}, {"B", "two"}}, ""},
		{"comments and blanks", "# c\n\n  # indented\nA=1 # trailing\nB=x#not-comment\n", []EnvVar{{"A", "1"}, {"B", "x#not-comment"}}, ""},
		{"export and spaces", "export A = spaced value  \n\texport\tB=2", []EnvVar{{"A", "spaced value"}, {"B", "2"}}, ""},
		{"empty values", "A=\nB=''\nC=\"\"\n", []EnvVar{{"A", ""}, {"B", ""}, {"C", ""}}, ""},
		{"single quotes are literal", `A='$HOME \n # x'`, []EnvVar{{"A", `$HOME \n # x`}}, ""},
		{"double quote escapes", `A="l1\nl2\t\"q\" \$HOME \\"`, []EnvVar{{"A", "l1\nl2\t\"q\" $HOME \\"}}, ""},
		{"multi-line quotes", "A=\"x\ny\"\nB='p\nq' # c\nC=3", []EnvVar{{"A", "x\ny"}, {"B", "p\nq"}, {"C", "3"}}, ""},
		{"substitution", "A=$HOME/a\nB=\"${HOME}/b\"\nC=${A}-${MISSING}-$\nD=${HOME}x", []EnvVar{{"A", "/home/sy/a"}, {"B", "/home/sy/b"}, {"C", "/home/sy/a--$"}, {"D", "/home/syx"}}, ""},
		{"environment wins over the file in substitution", "HOME=/file\nA=$HOME", []EnvVar{{"HOME", "/file"}, {"A", "/home/sy"}}, ""},
		{"crlf", "A=1\r\nB=\"2\"\r\n", []EnvVar{{"A", "1"}, {"B", "2"}}, ""},
		{"dotted key", "a.b_C=1", []EnvVar{{"a.b_C", "1"}}, ""},
		{"duplicate keys kept in order", "A=1\nA=2", []EnvVar{{"A", "1"}, {"A", "2"}}, ""},
		{"missing equals", "A=1\nB\nC=3", []EnvVar{{"A", "1"}}, "line 2: expected '=' after B"},
		{"bad key", "A=1\n-B=2", []EnvVar{{"A", "1"}}, `line 2: invalid key at "-B=2"`},
		{"unterminated double", "A=\"x", nil, "line 1: unterminated double-quoted value"},
		{"unterminated single", "A='x", nil, "line 1: unterminated single-quoted value"},
		{"text after quote", "A=\"x\" y", nil, `line 1: unexpected text after closing quote: "y"`},
		{"quote inside unquoted", "A=x\"y", nil, "line 1: unexpected quote in unquoted value"},
		{"bad substitution", "A=${X", nil, "line 1: unterminated ${...} substitution"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseDotEnv(strings.NewReader(tc.in), env)
			if diff := cmp.Diff(tc.want, got, cmpopts.EquateEmpty()); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
			gotErr := ""
			if err != nil {
				gotErr = err.Error()
			}
			if gotErr != tc.wantErr {
				t.Errorf("err = %q, want %q", gotErr, tc.wantErr)
			}
		})
	}
}

func TestLoadDotEnv(t *testing.T) {
	const pre = "SWITCHYARD_CONFIG_TEST_"
	// t.Setenv registers restoration; unset afterwards so LoadDotEnv sees
	// the variables as absent.
	for _, k := range []string{"NEW", "KEPT", "AFTER"} {
		t.Setenv(pre+k, "")
		os.Unsetenv(pre + k)
	}
	t.Setenv(pre+"EXISTING", "from-env")

	dir := t.TempDir()
	path := filepath.Join(dir, ".env")
	content := pre + "NEW=new\n" + pre + "EXISTING=from-file\n" + pre + "KEPT=${" + pre + "EXISTING}\n" +
		"API_KEY_VALIDATION_URLS_NOT_USED=1\nbroken line\n" + pre + "AFTER=x\n"
	t.Setenv("API_KEY_VALIDATION_URLS_NOT_USED", "")
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	err := LoadDotEnv(path)
	if err == nil || !strings.Contains(err.Error(), "line 5") || !strings.Contains(err.Error(), ".env") {
		t.Errorf("err = %v, want a line 5 error naming the file", err)
	}
	for k, want := range map[string]string{"NEW": "new", "EXISTING": "from-env", "KEPT": "from-env"} {
		if got := os.Getenv(pre + k); got != want {
			t.Errorf("%s = %q, want %q", k, got, want)
		}
	}
	if _, ok := os.LookupEnv(pre + "AFTER"); ok {
		t.Errorf("variable after the malformed line was set")
	}

	if err := LoadDotEnv(filepath.Join(dir, "missing.env")); err != nil {
		t.Errorf("missing file: %v", err)
	}
	if err := LoadDotEnv(dir); err == nil {
		t.Errorf("directory: no error")
	}

	// .env feeds the API_KEY_VALIDATION_URLS fallback of Parse.
	t.Setenv("API_KEY_VALIDATION_URLS", "")
	os.Unsetenv("API_KEY_VALIDATION_URLS")
	path2 := filepath.Join(dir, "2.env")
	if err := os.WriteFile(path2, []byte("API_KEY_VALIDATION_URLS=http://a/v,http://b/v\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := LoadDotEnv(path2); err != nil {
		t.Fatal(err)
	}
	c, err := Parse([]string{"--worker-urls", "http://w"})
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{"http://a/v", "http://b/v"}, c.APIKeyValidationURLs); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
}
