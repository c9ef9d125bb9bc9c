package bench

import (
	"bytes"
	"image/png"
	"testing"
)

func TestSweepMarkdown(t *testing.T) {
	s := Sweep{Rows: []SweepRow{
		{Router: "vllm-router", Mode: "READ", Concurrency: 16, Failed: 0, RequestThroughput: 1.0249,
			TTFTP50: 261.964, TTFTP99: 997.72, TPOTP50: 15.27, TPOTP99: 15.46, ITLP50: 15.2, ITLP99: 16.34},
		{Router: "toy proxy", Mode: "WRITE", Concurrency: 256, Failed: 33, RequestThroughput: 6.81,
			TTFTP50: 1354.28, TTFTP99: 61913.8, TPOTP50: 24.99, TPOTP99: 25.78, ITLP50: 24.46, ITLP99: 65.69},
	}}
	var b bytes.Buffer
	if err := s.WriteMarkdown(&b); err != nil {
		t.Fatal(err)
	}
	want := "| Router | Mode | C | Failed | Req/s | TTFT P50 / P99 ms | TPOT P50 / P99 ms | ITL P50 / P99 ms |\n" +
		"|---|---|---|---|---|---|---|---|\n" +
		"| vllm-router | READ | 16 | 0 | 1.02 | 261.96 / 997.72 | 15.27 / 15.46 | 15.20 / 16.34 |\n" +
		"| toy proxy | WRITE | 256 | 33 | 6.81 | 1354.28 / 61913.80 | 24.99 / 25.78 | 24.46 / 65.69 |\n"
	if b.String() != want {
		t.Errorf("markdown\n got:\n%s\nwant:\n%s", b.String(), want)
	}
}

func TestSweepPlotPNG(t *testing.T) {
	var s Sweep
	s.Title = "Input 1000 / output 1000"
	for i, c := range []int{16, 32, 64, 128, 256} {
		f := float64(i + 1)
		s.Rows = append(s.Rows,
			SweepRow{Router: "switchyard", Mode: "WRITE", Concurrency: c, TTFTP50: 200 * f, TTFTP99: 900 * f, TPOTP50: 15 + f, TPOTP99: 16 + 2*f},
			SweepRow{Router: "switchyard", Mode: "READ", Concurrency: c, TTFTP50: 260 * f, TTFTP99: 1000 * f, TPOTP50: 15 + 3*f, TPOTP99: 17 + 3*f})
	}
	var b bytes.Buffer
	if err := s.WritePlot(&b); err != nil {
		t.Fatal(err)
	}
	img, err := png.Decode(&b)
	if err != nil {
		t.Fatal(err)
	}
	if img.Bounds().Dx() != 1200 || img.Bounds().Dy() != 520 {
		t.Errorf("size %v", img.Bounds())
	}
	colored := 0
	for y := 0; y < img.Bounds().Dy(); y += 2 {
		for x := 0; x < img.Bounds().Dx(); x += 2 {
			r, g, bb, _ := img.At(x, y).RGBA()
			if r != g || g != bb {
				colored++
			}
		}
	}
	if colored < 500 {
		t.Errorf("only %d coloured pixels: series not drawn", colored)
	}
	// An empty sweep still renders.
	b.Reset()
	if err := (&Sweep{}).WritePlot(&b); err != nil {
		t.Fatal(err)
	}
}
