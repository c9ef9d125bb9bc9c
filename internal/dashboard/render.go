package dashboard

import (
	"image"
	"image/color"
	"image/draw"
	"strings"

	"github.com/switchyard-llm/switchyard/internal/bench/chart"
)

// RenderOptions sizes the snapshot.
type RenderOptions struct {
	Title         string
	Subtitle      string
	Columns       int // panels per line (default 3)
	PanelWidth    int // default 640
	PanelHeight   int // default 400
	Window        int // rate window in snapshots (default 5)
	OnlySnapshots bool
}

var unitLabel = map[string]string{"s": "seconds", "reqps": "requests/s", "ops": "per second", "short": "count"}

// Render draws the dashboard's snapshot panels (all panels when
// OnlySnapshots is false) from scraped samples, in a grid.
func Render(snaps []Snapshot, o RenderOptions) *image.RGBA {
	if o.Columns <= 0 {
		o.Columns = 3
	}
	if o.PanelWidth <= 0 {
		o.PanelWidth = 640
	}
	if o.PanelHeight <= 0 {
		o.PanelHeight = 400
	}
	if o.Window <= 0 {
		o.Window = 5
	}
	type titled struct {
		row string
		p   Panel
	}
	var panels []titled
	for _, r := range Rows() {
		for _, p := range r.Panels {
			if p.Snapshot || !o.OnlySnapshots {
				panels = append(panels, titled{r.Title, p})
			}
		}
	}
	header := 16
	if o.Title != "" {
		header += chart.TextHeight(3) + 10
	}
	if o.Subtitle != "" {
		header += chart.TextHeight(1) + 10
	}
	lines := (len(panels) + o.Columns - 1) / o.Columns
	img := image.NewRGBA(image.Rect(0, 0, o.Columns*o.PanelWidth, header+lines*o.PanelHeight))
	draw.Draw(img, img.Bounds(), image.NewUniform(color.White), image.Point{}, draw.Src)
	y := 10
	if o.Title != "" {
		chart.DrawText(img, 20, y, o.Title, color.Black, 3)
		y += chart.TextHeight(3) + 10
	}
	if o.Subtitle != "" {
		chart.DrawText(img, 20, y, o.Subtitle, color.RGBA{90, 90, 90, 255}, 1)
	}
	span := 0.0 // every panel shares the run's time axis
	if len(snaps) > 1 {
		span = snaps[len(snaps)-1].At.Sub(snaps[0].At).Seconds()
	}
	for i, tp := range panels {
		cp := chart.Panel{Title: tp.row + ": " + tp.p.Title, XLabel: "time (s)", YLabel: unitLabel[tp.p.Unit],
			XMin: 0, XMax: span}
		n := 0
		for _, q := range tp.p.Queries {
			for _, l := range Eval(q, snaps, o.Window) {
				cp.Series = append(cp.Series, chart.Series{
					Name:   printable(l.Name),
					X:      l.X,
					Y:      l.Y,
					Color:  chart.Palette[n%len(chart.Palette)],
					Dashed: n >= len(chart.Palette),
				})
				n++
			}
		}
		if n == 0 {
			cp.Title += " (no data)"
		}
		pi := chart.Render(chart.Options{Width: o.PanelWidth, Height: o.PanelHeight}, cp)
		at := image.Pt((i%o.Columns)*o.PanelWidth, header+(i/o.Columns)*o.PanelHeight)
		draw.Draw(img, pi.Bounds().Add(at), pi, image.Point{}, draw.Src)
		// a light frame between panels
		frame := color.RGBA{200, 200, 200, 255}
		r := pi.Bounds().Add(at)
		for x := r.Min.X; x < r.Max.X; x++ {
			img.Set(x, r.Min.Y, frame)
		}
		for yy := r.Min.Y; yy < r.Max.Y; yy++ {
			img.Set(r.Min.X, yy, frame)
		}
	}
	return img
}

// printable shortens worker URLs and keeps to the chart font's characters.
func printable(s string) string {
	s = strings.ReplaceAll(s, "http://", "")
	s = strings.ReplaceAll(s, "https://", "")
	return strings.ReplaceAll(s, "@", "#")
}
