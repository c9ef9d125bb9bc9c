package bench

import (
	"context"
	"io"
	"slices"
	"strings"
	"testing"
)

func TestSubcommandDispatch(t *testing.T) {
	var got []string
	RegisterSubcommand("test-sub", func(_ context.Context, args []string, stdout, _ io.Writer) error {
		got = args
		_, err := io.WriteString(stdout, "ran")
		return err
	})
	defer delete(subcommands, "test-sub")
	var out strings.Builder
	if err := Main(context.Background(), []string{"test-sub", "pd", "--quick"}, &out, io.Discard); err != nil {
		t.Fatal(err)
	}
	if out.String() != "ran" || !slices.Equal(got, []string{"pd", "--quick"}) {
		t.Fatalf("out %q args %q", out.String(), got)
	}
	// Any other first argument keeps the old behaviour: flags only.
	if err := Main(context.Background(), []string{"other"}, io.Discard, io.Discard); err == nil || !strings.Contains(err.Error(), `unexpected argument "other"`) {
		t.Fatalf("err = %v", err)
	}
}
