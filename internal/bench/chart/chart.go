// Package chart draws simple line charts to PNG with the standard library
// only: axes, ticks, grid lines, solid or dashed series with point markers,
// a legend, and labels in a built-in 5x7 bitmap font. It exists so sybench
// can plot TTFT/TPOT against concurrency without a plotting dependency.
package chart

import (
	"image"
	"image/color"
	"image/draw"
	"image/png"
	"io"
	"math"
	"strconv"
)

// Series is one line of a panel.
type Series struct {
	Name   string
	X, Y   []float64
	Color  color.RGBA
	Dashed bool
}

// Panel is one set of axes.
type Panel struct {
	Title          string
	XLabel, YLabel string
	// LogX uses a log2 x axis with ticks at the data's x values (suits
	// concurrency sweeps 16, 32, 64, ...).
	LogX   bool
	Series []Series
	// XMin and XMax, when XMax > XMin, fix the x range (e.g. the same time
	// axis on every panel of a dashboard) instead of fitting the data.
	XMin, XMax float64
}

// Options sizes the image.
type Options struct {
	Width, Height int
	Title         string
}

// Palette is a set of distinguishable line colours.
var Palette = []color.RGBA{
	{31, 119, 180, 255},
	{214, 39, 40, 255},
	{44, 160, 44, 255},
	{255, 127, 14, 255},
	{148, 103, 189, 255},
	{140, 86, 75, 255},
	{227, 119, 194, 255},
	{23, 190, 207, 255},
}

var (
	black = color.RGBA{0, 0, 0, 255}
	grey  = color.RGBA{110, 110, 110, 255}
	grid  = color.RGBA{225, 225, 225, 255}
)

// WritePNG renders the panels side by side and encodes them as PNG.
func WritePNG(w io.Writer, opts Options, panels ...Panel) error {
	return png.Encode(w, Render(opts, panels...))
}

type legendEntry struct {
	name   string
	color  color.RGBA
	dashed bool
}

// Render draws the panels side by side on a white image.
func Render(opts Options, panels ...Panel) *image.RGBA {
	if opts.Width <= 0 {
		opts.Width = 600 * max(1, len(panels))
	}
	if opts.Height <= 0 {
		opts.Height = 480
	}
	img := image.NewRGBA(image.Rect(0, 0, opts.Width, opts.Height))
	draw.Draw(img, img.Bounds(), image.NewUniform(color.White), image.Point{}, draw.Src)

	top := 10
	if opts.Title != "" {
		DrawText(img, (opts.Width-TextWidth(opts.Title, 2))/2, top, opts.Title, black, 2)
		top += TextHeight(2) + 12
	}

	var legend []legendEntry
	seen := map[string]bool{}
	for _, p := range panels {
		for _, s := range p.Series {
			if s.Name != "" && !seen[s.Name] {
				seen[s.Name] = true
				legend = append(legend, legendEntry{s.Name, s.Color, s.Dashed})
			}
		}
	}
	const entryW, entryH = 230, 14
	perRow := max(1, (opts.Width-20)/entryW)
	rows := (len(legend) + perRow - 1) / perRow
	legendH := rows*entryH + 10
	for i, e := range legend {
		x := 20 + (i%perRow)*entryW
		y := opts.Height - legendH + (i/perRow)*entryH + 2
		drawLine(img, x, y+3, x+24, y+3, e.color, e.dashed, new(int))
		drawLine(img, x, y+4, x+24, y+4, e.color, e.dashed, new(int))
		DrawText(img, x+30, y, e.name, black, 1)
	}

	if len(panels) == 0 {
		return img
	}
	pw := opts.Width / len(panels)
	for i, p := range panels {
		r := image.Rect(i*pw, top, (i+1)*pw, opts.Height-legendH)
		drawPanel(img, r, p)
	}
	return img
}

func drawPanel(img *image.RGBA, r image.Rectangle, p Panel) {
	if p.Title != "" {
		DrawText(img, r.Min.X+(r.Dx()-TextWidth(p.Title, 1))/2, r.Min.Y, p.Title, black, 1)
	}
	plot := image.Rect(r.Min.X+70, r.Min.Y+18, r.Max.X-20, r.Max.Y-40)
	if plot.Dx() < 10 || plot.Dy() < 10 {
		return
	}

	// Data ranges.
	xmin, xmax := math.Inf(1), math.Inf(-1)
	ymax := 0.0
	var xs []float64
	for _, s := range p.Series {
		for k := range s.X {
			if k >= len(s.Y) || !finite(s.X[k]) || !finite(s.Y[k]) || (p.LogX && s.X[k] <= 0) {
				continue
			}
			xmin, xmax = math.Min(xmin, s.X[k]), math.Max(xmax, s.X[k])
			ymax = math.Max(ymax, s.Y[k])
			xs = appendUnique(xs, s.X[k])
		}
	}
	if math.IsInf(xmin, 1) {
		xmin, xmax = 1, 2
	}
	if p.XMax > p.XMin && (!p.LogX || p.XMin > 0) {
		xmin, xmax = p.XMin, p.XMax
	}
	tx := func(v float64) float64 { return v }
	if p.LogX {
		tx = math.Log2
	}
	lo, hi := tx(xmin), tx(xmax)
	if hi == lo {
		lo, hi = lo-1, hi+1
	}
	pad := (hi - lo) * 0.04
	lo, hi = lo-pad, hi+pad
	ystep := niceStep(ymax / 5)
	ytop := math.Ceil(ymax/ystep) * ystep
	if ytop <= 0 {
		ytop = ystep
	}
	px := func(v float64) int {
		return plot.Min.X + int(math.Round((tx(v)-lo)/(hi-lo)*float64(plot.Dx())))
	}
	py := func(v float64) int {
		return plot.Max.Y - int(math.Round(v/ytop*float64(plot.Dy())))
	}

	// Grid and y ticks.
	for v := 0.0; v <= ytop*1.0000001; v += ystep {
		y := py(v)
		drawLine(img, plot.Min.X, y, plot.Max.X, y, grid, false, new(int))
		lbl := formatTick(v)
		DrawText(img, plot.Min.X-6-TextWidth(lbl, 1), y-3, lbl, black, 1)
	}
	// X ticks.
	ticks := xs
	if !p.LogX || len(ticks) > 12 {
		ticks = nil
		step := niceStep((xmax - xmin) / 5)
		if p.LogX {
			for v := math.Exp2(math.Ceil(math.Log2(xmin))); v <= xmax; v *= 2 {
				ticks = append(ticks, v)
			}
		} else if step > 0 {
			for v := math.Ceil(xmin/step) * step; v <= xmax*1.0000001; v += step {
				ticks = append(ticks, v)
			}
		}
	}
	for _, v := range ticks {
		x := px(v)
		drawLine(img, x, plot.Max.Y, x, plot.Max.Y+4, black, false, new(int))
		lbl := formatTick(v)
		DrawText(img, x-TextWidth(lbl, 1)/2, plot.Max.Y+8, lbl, black, 1)
	}
	// Axes.
	drawLine(img, plot.Min.X, plot.Max.Y, plot.Max.X, plot.Max.Y, black, false, new(int))
	drawLine(img, plot.Min.X, plot.Min.Y, plot.Min.X, plot.Max.Y, black, false, new(int))
	if p.XLabel != "" {
		DrawText(img, plot.Min.X+(plot.Dx()-TextWidth(p.XLabel, 1))/2, plot.Max.Y+22, p.XLabel, grey, 1)
	}
	if p.YLabel != "" {
		DrawTextVertical(img, r.Min.X+6, plot.Min.Y+(plot.Dy()+TextWidth(p.YLabel, 1))/2, p.YLabel, grey, 1)
	}

	// Series.
	for _, s := range p.Series {
		phase := 0
		prevOK := false
		var x0, y0 int
		for k := range s.X {
			if k >= len(s.Y) || !finite(s.X[k]) || !finite(s.Y[k]) || (p.LogX && s.X[k] <= 0) {
				prevOK = false
				continue
			}
			x, y := px(s.X[k]), py(s.Y[k])
			if prevOK {
				drawLine(img, x0, y0, x, y, s.Color, s.Dashed, &phase)
				drawLine(img, x0, y0+1, x, y+1, s.Color, s.Dashed, new(int))
			}
			fillRect(img, x-2, y-2, x+2, y+2, s.Color)
			x0, y0, prevOK = x, y, true
		}
	}
}

func finite(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }

func appendUnique(xs []float64, v float64) []float64 {
	for _, x := range xs {
		if x == v {
			return xs
		}
	}
	return append(xs, v)
}

// niceStep rounds a raw tick step up to 1, 2 or 5 times a power of ten.
func niceStep(raw float64) float64 {
	if !(raw > 0) || !finite(raw) {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(raw)))
	for _, m := range []float64{1, 2, 5, 10} {
		if raw <= m*p {
			return m * p
		}
	}
	return 10 * p
}

func formatTick(v float64) string {
	if math.Abs(v-math.Round(v)) < 1e-9 {
		return strconv.FormatFloat(math.Round(v), 'f', -1, 64)
	}
	// tick = k·step accumulates float error (0.6000000000000001): round it
	// away before printing the shortest representation
	return strconv.FormatFloat(math.Round(v*1e9)/1e9, 'f', -1, 64)
}

func fillRect(img *image.RGBA, x0, y0, x1, y1 int, c color.RGBA) {
	for y := y0; y <= y1; y++ {
		for x := x0; x <= x1; x++ {
			img.SetRGBA(x, y, c)
		}
	}
}

// drawLine draws a 1-pixel Bresenham line; when dashed, *phase carries the
// dash pattern across consecutive segments.
func drawLine(img *image.RGBA, x0, y0, x1, y1 int, c color.RGBA, dashed bool, phase *int) {
	dx, dy := abs(x1-x0), -abs(y1-y0)
	sx, sy := 1, 1
	if x0 > x1 {
		sx = -1
	}
	if y0 > y1 {
		sy = -1
	}
	e := dx + dy
	for {
		if !dashed || (*phase%10) < 6 {
			img.SetRGBA(x0, y0, c)
		}
		*phase++
		if x0 == x1 && y0 == y1 {
			return
		}
		e2 := 2 * e
		if e2 >= dy {
			e += dy
			x0 += sx
		}
		if e2 <= dx {
			e += dx
			y0 += sy
		}
	}
}

func abs(v int) int {
	if v < 0 {
		return -v
	}
	return v
}
