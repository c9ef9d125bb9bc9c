package chart

import (
	"bytes"
	"image/color"
	"image/png"
	"math"
	"testing"
)

func TestGlyphsWellFormed(t *testing.T) {
	for r, g := range glyphs {
		for _, row := range g {
			if len(row) != glyphW {
				t.Errorf("glyph %q has a row of width %d", r, len(row))
			}
		}
	}
}

func TestRenderDegenerateInputs(t *testing.T) {
	red := color.RGBA{255, 0, 0, 255}
	panels := []Panel{
		{Title: "empty"},
		{Title: "one point", LogX: true, Series: []Series{{Name: "a", X: []float64{16}, Y: []float64{5}, Color: red}}},
		{Title: "nan and zero", Series: []Series{{Name: "b", X: []float64{0, 1, math.NaN(), 3}, Y: []float64{0, math.Inf(1), 2, 0}, Color: red, Dashed: true}}},
		{Title: "mismatched", Series: []Series{{X: []float64{1, 2, 3}, Y: []float64{1}}}},
	}
	var b bytes.Buffer
	if err := WritePNG(&b, Options{Title: "t"}, panels...); err != nil {
		t.Fatal(err)
	}
	img, err := png.Decode(&b)
	if err != nil {
		t.Fatal(err)
	}
	if img.Bounds().Dx() != 2400 {
		t.Errorf("width %d", img.Bounds().Dx())
	}
}

func TestTextWidth(t *testing.T) {
	if TextWidth("AB", 2) != (2*advanceX-1)*2 || TextWidth("", 1) != 0 {
		t.Error("TextWidth")
	}
}

func TestNiceStep(t *testing.T) {
	for raw, want := range map[float64]float64{0.7: 1, 1.5: 2, 3: 5, 7: 10, 130: 200, 0: 1} {
		if got := niceStep(raw); math.Abs(got-want) > 1e-12 {
			t.Errorf("niceStep(%v) = %v, want %v", raw, got, want)
		}
	}
}

func TestFormatTickRoundsFloatNoise(t *testing.T) {
	for v, want := range map[float64]string{0.1 + 0.2: "0.3", 3 * 0.2: "0.6", 0.05: "0.05", 2: "2", 1.5: "1.5"} {
		if got := formatTick(v); got != want {
			t.Errorf("formatTick(%v) = %q, want %q", v, got, want)
		}
	}
}
