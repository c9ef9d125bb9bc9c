package config

import (
	"encoding/json"
	"errors"
	"io/fs"
	"reflect"
	"sort"
	"strings"

	"sigs.k8s.io/yaml"
)

// loadFile decodes a YAML or JSON settings file over c, strictly: an
// unknown key (or one in the wrong case) is an error naming the key. Every
// top-level key present counts as an explicitly set flag.
func (c *Config) loadFile(path string, readFile func(string) ([]byte, error)) error {
	fileErr := func(reason string) *Error {
		return &Error{Kind: KindConfigFile, Field: "--config", Value: path, Reason: reason}
	}
	data, err := readFile(path)
	if err != nil {
		var pe *fs.PathError
		if errors.As(err, &pe) {
			err = pe.Err
		}
		return fileErr(err.Error())
	}

	// Top-level keys first: exact names, a hint for kebab-case, all at once.
	js, err := yaml.YAMLToJSON(data)
	if err != nil {
		return fileErr(strings.TrimPrefix(err.Error(), "error converting YAML to JSON: "))
	}
	var top map[string]json.RawMessage
	if t := strings.TrimSpace(string(js)); t != "null" {
		if err := json.Unmarshal(js, &top); err != nil {
			return fileErr("must be a mapping of settings (flag names with '-' replaced by '_')")
		}
	}
	known := jsonKeys()
	var unknown []string
	for k := range top {
		if !known[k] {
			unknown = append(unknown, k)
		}
	}
	if len(unknown) > 0 {
		sort.Strings(unknown)
		errs := make([]error, 0, len(unknown))
		for _, k := range unknown {
			r := "unknown key " + `"` + k + `"`
			if alt := strings.ToLower(strings.ReplaceAll(k, "-", "_")); known[alt] {
				r += ` (did you mean "` + alt + `"?)`
			}
			errs = append(errs, fileErr(r))
		}
		return errors.Join(errs...)
	}

	if err := yaml.UnmarshalStrict(data, c); err != nil {
		msg := err.Error()
		for _, p := range []string{"error converting YAML to JSON: ", "error unmarshaling JSON: ", "while decoding JSON: "} {
			msg = strings.TrimPrefix(msg, p)
		}
		return fileErr(msg)
	}
	for k := range top {
		c.markExplicit(strings.ReplaceAll(k, "_", "-"))
	}
	return nil
}

// jsonKeys is the set of top-level keys a settings file may use.
func jsonKeys() map[string]bool {
	t := reflect.TypeFor[Config]()
	keys := make(map[string]bool, t.NumField())
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if !f.IsExported() || name == "" || name == "-" {
			continue
		}
		keys[name] = true
	}
	return keys
}
