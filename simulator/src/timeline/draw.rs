//! The timeline drawn: the SVG document (axis, lanes, marks, curves) and the HTML page around
//! it (a summary table and a tooltip that follows the pointer).

use super::*;

const STYLE: &str = "
svg{font:12px system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;background:#fff}
.title{font-size:16px;font-weight:600}
.muted{fill:#666}
.grid{stroke:#eee}
.axis{stroke:#999}
.break{stroke:#bbb;fill:none;stroke-dasharray:3 3}
.lanebox{fill:#fafafa;stroke:#e3e3e3}
.area{fill:#cfe3f7}
.curve{fill:none;stroke:#2b6cb0;stroke-width:1.5}
.cap{stroke:#2b6cb0;stroke-dasharray:2 3;stroke-width:.8}
.renewal{stroke:#2f855a;stroke-dasharray:4 3;stroke-width:1.2}
.active{fill:#c6f0d0}
.cooldown{fill:#f8cccc}
.ban{fill:#ffd8a8}
.ok{fill:#2f9e44}
.part{fill:#f08c00}
.deny{stroke:#e03131;stroke-width:2.2}
.blocked{fill:#fff;stroke:#868e96;stroke-width:1.5}
.other{fill:#1c7ed6}
.qp{fill:#1b3f66}
.retry{stroke:#e03131;stroke-width:1;stroke-dasharray:4 2}
.reset{stroke:#adb5bd;stroke-width:1;stroke-dasharray:1 3}
.tick{fill:#e03131}
.agg rect{stroke:none}
.agg-deny{fill:#e03131}
.agg .blocked{fill:#adb5bd}
[data-line]:hover,.agg:hover{opacity:.7}
";

/// The legend's items: a mark's class and what it means.
const LEGEND: [(&str, &str); 9] = [
    ("ok", "allowed"),
    ("part", "partly granted"),
    ("deny", "denied by this limit"),
    ("blocked", "allowed here, batch refused elsewhere"),
    ("other", "refund / reset / release"),
    ("retry", "retry_after"),
    ("active", "tier active"),
    ("cooldown", "tier cooling down"),
    ("ban", "banned by its penalty ladder"),
];

/// The height of a legend's row.
const LEGEND_ROW: f64 = 18.0;

/// A legend item's width: its mark and its label (about 6.5 px a character).
fn legend_width(label: &str) -> f64 {
    24.0 + 6.5 * label.len() as f64
}

impl Timeline {
    /// The drawing as a standalone SVG document.
    pub fn svg(&self) -> String {
        let mut out = String::new();
        self.write_svg(&mut out);
        out
    }

    /// Where the lanes start: below the axis, and below a legend's second row when it wraps.
    fn top(&self) -> f64 {
        let legend: f64 = LEGEND.iter().map(|(_, label)| legend_width(label)).sum();
        if 12.0 + legend > self.axis.width - 4.0 {
            TOP + LEGEND_ROW
        } else {
            TOP
        }
    }

    fn height(&self) -> f64 {
        self.top()
            + self
                .lanes
                .iter()
                .map(|l| l.height() + LANE_GAP)
                .sum::<f64>()
            + 30.0
    }

    fn write_svg(&self, out: &mut String) {
        let width = self.axis.width;
        let height = self.height();
        let _ = write!(
            out,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height:.0}" viewBox="0 0 {width} {height:.0}" data-axis="{}" data-us-per-px="{}" data-bin-px="{BIN_PX}"><style>{STYLE}</style>"#,
            self.axis.describe(),
            self.axis.us_per_px,
        );
        let _ = write!(
            out,
            r#"<text x="12" y="24" class="title">{}</text>"#,
            esc(&self.title)
        );
        let requests: u64 = self.lanes.iter().map(|l| l.totals.count).sum();
        let _ = write!(
            out,
            r#"<text x="12" y="44" class="muted">{} trace lines, {} decisions on {} buckets{} · hover a mark for its numbers</text>"#,
            self.lines,
            requests,
            self.lanes.len(),
            if self.undrawn > 0 {
                format!(
                    " (and {} decisions on buckets past the first {MAX_LANES}, not drawn)",
                    self.undrawn
                )
            } else {
                String::new()
            }
        );
        self.write_legend(out, 12.0, 66.0);
        self.write_axis(out, height);
        let mut y = self.top();
        for lane in &self.lanes {
            self.write_lane(out, lane, y);
            y += lane.height() + LANE_GAP;
        }
        out.push_str("</svg>");
    }

    fn write_legend(&self, out: &mut String, x: f64, y: f64) {
        // Items that would pass the right edge go on a second row ([`Timeline::top`] makes
        // room for it).
        let (mut cx, mut y, mut wrapped) = (x, y, false);
        for (class, label) in LEGEND {
            let item_width = legend_width(label);
            if !wrapped && cx > x && cx + item_width > self.axis.width - 4.0 {
                (cx, y, wrapped) = (x, y + LEGEND_ROW, true);
            }
            match class {
                "deny" => {
                    let _ = write!(out, r#"<g class="deny">{}</g>"#, cross(cx + 5.0, y, 4.0));
                }
                "retry" => {
                    let _ = write!(
                        out,
                        r#"<line class="retry" x1="{cx}" x2="{}" y1="{y}" y2="{y}"/>"#,
                        cx + 12.0
                    );
                }
                "active" | "cooldown" => {
                    let _ = write!(
                        out,
                        r#"<rect class="{class}" x="{cx}" y="{}" width="12" height="10"/>"#,
                        y - 5.0
                    );
                }
                _ => {
                    let _ = write!(
                        out,
                        r#"<circle class="{class}" cx="{}" cy="{y}" r="4.5"/>"#,
                        cx + 5.0
                    );
                }
            }
            let _ = write!(
                out,
                r#"<text x="{}" y="{}">{label}</text>"#,
                cx + 16.0,
                y + 4.0
            );
            cx += item_width;
        }
    }

    fn write_axis(&self, out: &mut String, height: f64) {
        let top = self.top() - 12.0;
        let _ = write!(
            out,
            r#"<line class="axis" x1="{LEFT}" x2="{}" y1="{top}" y2="{top}"/>"#,
            self.axis.width - RIGHT
        );
        let step = self.tick_step();
        // Dated ticks fall on whole UTC instants, counted from 1970, not from the trace's start.
        let origin = if self.dated { EPOCH_US } else { 0 };
        // A label too close to the last one (across a cut) is left out.
        let mut last_label = f64::NEG_INFINITY;
        let gap = if self.dated { 110.0 } else { 60.0 };
        for (k, p) in self.axis.pieces.iter().enumerate() {
            let mut t = (origin + p.start)
                .div_ceil(step)
                .saturating_mul(step)
                .saturating_sub(origin);
            while t <= p.end {
                let x = self.axis.x(t);
                if x - last_label < gap {
                    t = match t.checked_add(step) {
                        Some(n) => n,
                        None => break,
                    };
                    continue;
                }
                last_label = x;
                let label = if self.dated {
                    date_label(EPOCH_US.saturating_add(t), step)
                } else {
                    seconds(t)
                };
                // A label that would pass the right edge ends there instead (about 6 px a
                // character at the axis's size).
                let half = 3.2 * label.len() as f64;
                let (text_x, anchor) = if x + half > self.axis.width - 2.0 {
                    (self.axis.width - 2.0, "end")
                } else {
                    (x, "middle")
                };
                let _ = write!(
                    out,
                    r#"<line class="grid" x1="{x:.1}" x2="{x:.1}" y1="{top}" y2="{:.0}"/><text x="{text_x:.1}" y="{}" text-anchor="{anchor}" class="muted" data-tick-us="{t}">{label}</text>"#,
                    height - 24.0,
                    top - 5.0,
                );
                t = match t.checked_add(step) {
                    Some(n) => n,
                    None => break,
                };
            }
            if let Some(next) = self.axis.pieces.get(k + 1) {
                let x = self.axis.piece_end_x(p) + BREAK_PX / 2.0;
                let idle = next.start - p.end;
                let _ = write!(
                    out,
                    r#"<g class="cut" data-from-us="{}" data-to-us="{}"><title>{} cut out: nothing happens and every bucket is fresh</title><path class="break" d="M{:.1} {top} V{:.0} M{:.1} {top} V{:.0}"/><text x="{x:.1}" y="{}" text-anchor="middle" class="muted">⋯ {} ⋯</text></g>"#,
                    p.end,
                    next.start,
                    seconds(idle),
                    x - 3.0,
                    height - 24.0,
                    x + 3.0,
                    height - 24.0,
                    height - 10.0,
                    seconds(idle),
                );
            }
        }
    }

    /// The axis's tick step: every 1, 2 or 5 x 10^k microseconds, at least 90 px apart; on a
    /// dated trace, every whole minute, hour or day (in UTC) that far apart, at least 130 px.
    fn tick_step(&self) -> u64 {
        let min_us = self.axis.us_per_px * if self.dated { 130.0 } else { 90.0 };
        if self.dated {
            const MIN: u64 = 60_000_000;
            return [
                1, 5, 15, 30, 60, 180, 360, 720, 1440, 2880, 10_080, 20_160, 43_200,
            ]
            .iter()
            .map(|m| m * MIN)
            .find(|&s| s as f64 >= min_us)
            .unwrap_or(86_400 * 365 * 1_000_000);
        }
        for exp in 0..19u32 {
            for m in [1u64, 2, 5] {
                let s = m.saturating_mul(10u64.saturating_pow(exp));
                if s as f64 >= min_us {
                    return s;
                }
            }
        }
        1
    }

    fn write_lane(&self, out: &mut String, lane: &Lane, y: f64) {
        let _ = write!(
            out,
            r#"<g class="lane" data-key="{}" data-kind="{}"{}><rect class="lanebox" x="4" y="{:.1}" width="{:.1}" height="{:.1}" rx="4"/><text x="12" y="{:.1}" font-weight="600">{}</text><text x="{LEFT}" y="{:.1}" class="muted">{}</text>"#,
            esc(&lane.label),
            match lane.quota.as_ref().map(Quota::shape_ref) {
                None => "unlimited",
                Some(ShapeRef::Gcra(_)) => "gcra",
                Some(ShapeRef::Tiered(_)) => "tiered",
                Some(ShapeRef::Concurrency(_)) => "concurrency",
                Some(ShapeRef::Calendar(_)) => "calendar",
                Some(ShapeRef::FairShare(_)) => "fair_share",
                Some(ShapeRef::Adaptive(_)) => "adaptive",
            },
            if lane.penalty.is_some() {
                r#" data-penalty="true""#
            } else {
                ""
            },
            y,
            self.axis.width - 8.0,
            lane.height(),
            y + 15.0,
            esc(&lane.label),
            y + 15.0,
            esc(&lane.quota_text())
        );
        self.write_renewals(out, lane, y);
        let mut row_y = y + HEAD_H;
        for (i, series) in lane.series.iter().enumerate() {
            self.write_series(out, lane, i, series, row_y);
            row_y += ROW_H;
        }
        self.write_requests(out, lane, row_y);
        out.push_str("</g>");
    }

    /// A calendar quota's renewals, across the lane: the count is whole again from each.
    fn write_renewals(&self, out: &mut String, lane: &Lane, y: f64) {
        for piece in &self.axis.pieces {
            for t in lane.renewals(piece.start, piece.end) {
                let x = self.axis.x(t);
                let _ = write!(
                    out,
                    r#"<line class="renewal" data-renewal-us="{t}" x1="{x:.1}" x2="{x:.1}" y1="{:.1}" y2="{:.1}"><title>renews {}</title></line>"#,
                    y + HEAD_H,
                    y + lane.height() - 4.0,
                    tower_ratelimits::__private::instant_text(EPOCH_US.saturating_add(t))
                );
            }
        }
    }

    /// A key's bans, in the row at `row_y` of its ladder's level.
    fn write_bans(&self, out: &mut String, bans: &[Ban], row_y: f64) {
        for ban in bans {
            let a = self.axis.x(ban.start);
            let b = self.axis.x(ban.end);
            let _ = write!(
                out,
                r#"<rect class="ban" x="{a:.1}" y="{:.1}" width="{:.1}" height="{:.1}" data-ban-start-us="{}" data-ban-end-us="{}" data-level="{}"><title>banned (level {}) from {} to {}</title></rect>"#,
                row_y + 2.0,
                (b - a).max(0.8),
                ROW_H - 6.0,
                ban.start,
                ban.end,
                ban.level,
                ban.level,
                seconds(ban.start),
                seconds(ban.end)
            );
        }
    }

    /// Series `i` of a lane, in its row at `row_y`: its tiers' activations behind the curve,
    /// the curve, and the exact value just after each request drawn on its own.
    fn write_series(&self, out: &mut String, lane: &Lane, i: usize, series: &Series, row_y: f64) {
        let right = self.axis.width - RIGHT;
        let base = row_y + ROW_H - 6.0;
        let scale = (ROW_H - 14.0) / series.max.max(1) as f64;
        // Tier activations behind the curve.
        for band in lane.bands.iter().filter(|b| b.tier == i) {
            let a = self.axis.x(band.entry);
            let b = self.axis.x(band.entry.saturating_add(band.active));
            let c = self
                .axis
                .x(band.entry.saturating_add(band.active + band.cooldown));
            let _ = write!(
                out,
                r#"<rect class="active" x="{a:.1}" y="{:.1}" width="{:.1}" height="{:.1}" data-tier="{}" data-entry-us="{}"><title>T{} active {} to {}</title></rect>"#,
                row_y + 2.0,
                (b - a).max(0.8),
                ROW_H - 6.0,
                i + 1,
                band.entry,
                i + 1,
                seconds(band.entry),
                seconds(band.entry + band.active)
            );
            if band.cooldown > 0 {
                let _ = write!(
                    out,
                    r#"<rect class="cooldown" x="{b:.1}" y="{:.1}" width="{:.1}" height="{:.1}"><title>T{} cooling down until {}</title></rect>"#,
                    row_y + 2.0,
                    (c - b).max(0.8),
                    ROW_H - 6.0,
                    i + 1,
                    seconds(band.entry + band.active + band.cooldown)
                );
            }
        }
        // A penalty ladder's bans behind its level.
        if lane.penalty.is_some() && i + 1 == lane.series.len() {
            self.write_bans(out, &lane.bans, row_y);
        }
        let _ = write!(
            out,
            r#"<g class="series" data-series="{i}" data-y0="{base:.3}" data-px-per-unit="{scale}" data-max="{}"><text x="{}" y="{:.1}" text-anchor="end" class="muted">{} (0..{})</text><line class="cap" x1="{LEFT}" x2="{right}" y1="{:.1}" y2="{:.1}"/>"#,
            series.max,
            LEFT - 8.0,
            row_y + ROW_H / 2.0 + 4.0,
            esc(&series.label),
            series.max,
            base - series.max as f64 * scale,
            base - series.max as f64 * scale,
        );
        let d = step_path(&series.columns, base, scale);
        if let (Some(first), Some(last)) = (series.columns.first(), series.columns.last()) {
            let (first_x, last_x) = (first.x, last.x);
            let _ = write!(
                out,
                r#"<path class="area" d="{d} H{:.1} V{base:.1} H{first_x:.1} Z"/><path class="curve" d="{d} H{:.1}"/>"#,
                right.max(last_x),
                right.max(last_x),
            );
        }
        // The exact value just after each request drawn on its own.
        for group in lane.all_groups() {
            for m in group.marks() {
                if let Some(&v) = m.after.get(i) {
                    let _ = write!(
                        out,
                        r#"<circle class="qp" data-line="{}" data-series="{i}" data-value="{v}" cx="{:.2}" cy="{:.2}" r="1.8"><title>line {}: {} {v} after the request</title></circle>"#,
                        m.line,
                        self.axis.x(m.at),
                        base - v as f64 * scale,
                        m.line,
                        esc(&series.label)
                    );
                }
            }
        }
        out.push_str("</g>");
    }

    /// A lane's row of requests at `row_y`: each drawn on its own, or counted where they are
    /// too many.
    fn write_requests(&self, out: &mut String, lane: &Lane, row_y: f64) {
        let mid = row_y + MARKS_H / 2.0;
        let _ = write!(
            out,
            r#"<text x="{}" y="{:.1}" text-anchor="end" class="muted">requests</text>"#,
            LEFT - 8.0,
            mid + 4.0
        );
        for group in lane.all_groups() {
            match group {
                Group::Aggregate(counts) => self.write_aggregate(out, counts, mid),
                Group::Marks(marks) => {
                    for (k, m) in marks.iter().enumerate() {
                        let offset = (k as f64 - (marks.len() - 1) as f64 / 2.0) * 10.0;
                        self.write_mark(out, lane, m, mid + offset);
                    }
                }
            }
        }
    }

    fn write_mark(&self, out: &mut String, lane: &Lane, m: &Mark, mid: f64) {
        let x = self.axis.x(m.at);
        let (attrs, title) = mark_labels(lane, m);
        let _ = write!(out, r#"<g {attrs}><title>{}</title>"#, esc(&title));
        self.write_glyph(out, m, x, mid);
        out.push_str("</g>");
    }

    /// A request's glyph at `x`: a denial's cross with where its retry_after and reset_after
    /// point, a check's square, another operation's bar, else a circle sized by its cost.
    fn write_glyph(&self, out: &mut String, m: &Mark, x: f64, mid: f64) {
        let r = 3.5 + (m.cost.max(1) as f64).log2().min(5.0);
        match (m.class, m.op) {
            (Class::Denied, _) => {
                // Where retry_after and reset_after point.
                if m.retry_us > 0 {
                    let rx = self.axis.x(m.at.saturating_add(m.retry_us));
                    let _ = write!(
                        out,
                        r#"<line class="retry" data-at-us="{}" x1="{x:.2}" x2="{rx:.2}" y1="{mid:.1}" y2="{mid:.1}"/><path class="tick" d="M{rx:.2} {:.1} l-3 -5 h6 z"/>"#,
                        m.at.saturating_add(m.retry_us),
                        mid - 2.0
                    );
                }
                if m.reset_us > 0 {
                    let sx = self.axis.x(m.at.saturating_add(m.reset_us));
                    let _ = write!(
                        out,
                        r#"<line class="reset" data-at-us="{}" x1="{x:.2}" x2="{sx:.2}" y1="{:.1}" y2="{:.1}"/>"#,
                        m.at.saturating_add(m.reset_us),
                        mid + 5.0,
                        mid + 5.0
                    );
                }
                let _ = write!(out, r#"<g class="deny">{}</g>"#, cross(x, mid, r));
            }
            (_, "check") => {
                let _ = write!(
                    out,
                    r#"<rect class="{}" x="{:.2}" y="{:.2}" width="{:.2}" height="{:.2}"/>"#,
                    m.class.css(),
                    x - r,
                    mid - r,
                    2.0 * r,
                    2.0 * r
                );
            }
            (Class::Other, _) => {
                let _ = write!(
                    out,
                    r#"<rect class="other" x="{:.2}" y="{:.1}" width="3" height="{:.1}"/>"#,
                    x - 1.5,
                    mid - 9.0,
                    18.0
                );
            }
            _ => {
                let _ = write!(
                    out,
                    r#"<circle class="{}" cx="{x:.2}" cy="{mid:.1}" r="{r:.2}"/>"#,
                    m.class.css()
                );
            }
        }
    }

    fn write_aggregate(&self, out: &mut String, c: &Counts, mid: f64) {
        let counts = [
            (Class::Allowed, c.allowed),
            (Class::Partial, c.partial),
            (Class::Denied, c.denied),
            (Class::Blocked, c.blocked),
            (Class::Other, c.other),
        ];
        let x = self.axis.x(c.from);
        let h = MARKS_H - 8.0;
        let _ = write!(
            out,
            r#"<g class="agg" data-count="{}" data-allowed="{}" data-partial="{}" data-denied="{}" data-blocked="{}" data-other="{}" data-from-us="{}" data-to-us="{}" data-first-line="{}" data-last-line="{}"><title>{} decisions, lines {} to {}, {} to {}&#10;allowed {}, partly granted {}, denied {}, refused by the batch {}, other {}&#10;units granted {}</title>"#,
            c.count,
            c.allowed,
            c.partial,
            c.denied,
            c.blocked,
            c.other,
            c.from,
            c.to,
            c.first_line,
            c.last_line,
            c.count,
            c.first_line,
            c.last_line,
            seconds(c.from),
            seconds(c.to),
            c.allowed,
            c.partial,
            c.denied,
            c.blocked,
            c.other,
            c.granted
        );
        let mut top = mid - h / 2.0;
        for (class, n) in counts {
            if n == 0 {
                continue;
            }
            let part = h * n as f64 / c.count as f64;
            let css = match class {
                Class::Denied => "agg-deny",
                c => c.css(),
            };
            let _ = write!(
                out,
                r#"<rect class="{css}" x="{:.2}" y="{top:.2}" width="{:.2}" height="{part:.2}"/>"#,
                x - 1.0,
                (BIN_PX - 1.0).max(2.0)
            );
            top += part;
        }
        out.push_str("</g>");
    }

    /// The drawing inside a self-contained HTML page: the SVG, a summary table per bucket, and
    /// a panel that shows a hovered mark's numbers. No network fetch, no external script or font.
    pub fn html(&self) -> String {
        let mut out = String::new();
        let _ = write!(
            out,
            "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><meta name=\"viewport\" content=\"width=device-width\"><title>{}</title><style>{PAGE_STYLE}</style></head><body><div class=\"scroll\">",
            esc(&self.title)
        );
        self.write_svg(&mut out);
        out.push_str(r#"</div><table class="summary"><thead><tr><th>bucket</th><th>limit</th><th>decisions</th><th>allowed</th><th>partly</th><th>denied</th><th>refused by the batch</th><th>units granted</th></tr></thead><tbody>"#);
        for lane in &self.lanes {
            let t = &lane.totals;
            let _ = write!(
                out,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                esc(&lane.label),
                esc(&lane.quota_text()),
                t.count,
                t.allowed,
                t.partial,
                t.denied,
                t.blocked,
                t.granted
            );
        }
        out.push_str("</tbody></table>");
        out.push_str(r#"<pre id="tip" hidden></pre><script>"#);
        out.push_str(PAGE_SCRIPT);
        out.push_str("</script></body></html>\n");
        out
    }
}

const PAGE_STYLE: &str = "
body{font:14px system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:16px;color:#222}
table.summary{border-collapse:collapse;margin-top:12px}
table.summary td,table.summary th{border:1px solid #ddd;padding:3px 8px;text-align:right}
table.summary td:first-child,table.summary td:nth-child(2),table.summary th{text-align:left}
.scroll{overflow-x:auto}
#tip{position:fixed;pointer-events:none;background:#222;color:#fff;padding:6px 8px;border-radius:4px;font:12px ui-monospace,monospace;margin:0;max-width:480px;white-space:pre-wrap}
";

/// Shows the hovered mark's `<title>` in a panel that follows the pointer (the title is also
/// the browser's own tooltip, so the page works without it).
const PAGE_SCRIPT: &str = r#"
(function () {
  var tip = document.getElementById('tip');
  var svg = document.querySelector('svg');
  if (!tip || !svg) { return; }
  svg.addEventListener('mousemove', function (e) {
    var el = e.target.closest('[data-line], .agg, .cut, rect[data-entry-us]');
    var title = el && el.querySelector('title');
    if (!title) { tip.hidden = true; return; }
    tip.textContent = title.textContent;
    tip.hidden = false;
    var x = Math.min(e.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
    tip.style.left = Math.max(0, x) + 'px';
    tip.style.top = (e.clientY + 14) + 'px';
  });
  svg.addEventListener('mouseleave', function () { tip.hidden = true; });
})();
"#;

/// A step line through a series' columns: each value holds until the next column; a column
/// with several values draws its first, lowest, highest and last.
fn step_path(columns: &[Column], base: f64, scale: f64) -> String {
    let y = |v: u64| base - v as f64 * scale;
    let mut d = String::new();
    for c in columns {
        if d.is_empty() {
            let _ = write!(d, "M{:.1} {:.1}", c.x, y(c.first));
        } else {
            let _ = write!(d, " H{:.1} V{:.1}", c.x, y(c.first));
        }
        if (c.low, c.high, c.last) != (c.first, c.first, c.first) {
            let _ = write!(d, " V{:.1} V{:.1} V{:.1}", y(c.low), y(c.high), y(c.last));
        }
    }
    d
}

/// An x of half-size `r` at (`x`, `y`).
fn cross(x: f64, y: f64, r: f64) -> String {
    format!(
        r#"<path d="M{:.2} {:.2} L{:.2} {:.2} M{:.2} {:.2} L{:.2} {:.2}"/>"#,
        x - r,
        y - r,
        x + r,
        y + r,
        x - r,
        y + r,
        x + r,
        y - r
    )
}

/// A request's attributes (what the page's script reads) and its tooltip.
fn mark_labels(lane: &Lane, m: &Mark) -> (String, String) {
    let mut attrs = format!(
        r#"data-line="{}" data-op="{}" data-limit="{}" data-id="{}" data-at-us="{}" data-class="{}""#,
        m.line,
        m.op,
        esc(lane.key.name().as_str()),
        esc(&lane.key.id().to_string()),
        m.at,
        m.class.css()
    );
    let mut title = format!(
        "line {} at {}: {} {}",
        m.line,
        seconds(m.at),
        m.op,
        lane.label
    );
    if m.class != Class::Other || m.op == "refund" {
        let _ = write!(
            attrs,
            r#" data-allowed="{}" data-batch-allowed="{}" data-cost="{}" data-granted="{}" data-remaining="{}" data-retry-after-us="{}" data-reset-after-us="{}""#,
            m.allowed, m.batch_allowed, m.cost, m.granted, m.remaining, m.retry_us, m.reset_us
        );
        let cost = if m.min_cost == m.cost {
            format!("cost {}", m.cost)
        } else {
            format!("cost {}..{}", m.min_cost, m.cost)
        };
        let _ = write!(
            title,
            "\n{cost}: {}\ngranted {}, remaining {}\nretry_after {}, reset_after {}",
            match m.class {
                Class::Allowed => "allowed",
                Class::Partial => "partly granted",
                Class::Denied => "denied by this limit",
                Class::Blocked => "allowed here, refused by the batch",
                Class::Other => "done",
            },
            m.granted,
            m.remaining,
            seconds(m.retry_us),
            seconds(m.reset_us)
        );
    }
    if let Some(by) = &m.refused_by {
        let by = by.as_str();
        let _ = write!(attrs, r#" data-refused-by="{}""#, esc(by));
        let _ = write!(title, "\nthe batch was refused by {by}");
    }
    if let Some(t) = &m.tiers {
        let units: Vec<String> = t.units().iter().map(u64::to_string).collect();
        let _ = write!(
            attrs,
            r#" data-tiers="{}" data-tier="{}" data-burst="{}""#,
            units.join(","),
            t.tier,
            t.burst
        );
        let _ = write!(
            title,
            "\nper tier [{}], tier {}{}",
            units.join(", "),
            t.tier,
            if t.burst { ", burst" } else { "" }
        );
    }
    if m.skipped {
        attrs.push_str(r#" data-skipped="true""#);
        title.push_str("\nskipped (another rule already denied)");
    }
    if m.lease {
        attrs.push_str(r#" data-lease="true""#);
        title.push_str("\ntook a slot");
    }
    (attrs, title)
}
