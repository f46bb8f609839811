//! The time axis: the trace's time in pieces, idle stretches cut out as breaks, and where an
//! instant is drawn.

use super::*;

/// A piece of trace time drawn without a cut: `[start, end]` starting at pixel `x`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Piece {
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) x: f64,
}

/// The shared time axis: trace microseconds to pixels, with idle stretches cut out.
#[derive(Debug, Clone)]
pub struct Axis {
    pub(super) pieces: Vec<Piece>,
    pub(super) us_per_px: f64,
    pub(super) width: f64,
}

impl Axis {
    /// An axis for requests at `events` (trace time, sorted), each followed by a stretch during
    /// which its bucket still remembers it (`(at, remembered_until)`), drawn `width` pixels
    /// wide.
    pub fn new(events: &[(u64, u64)], width: u32) -> Axis {
        let width = f64::from(width);
        let first = events.first().map_or(0, |e| e.0);
        let last = events.last().map_or(0, |e| e.0);
        let span = last.saturating_sub(first).max(1_000_000);
        let min_cut = (span / 20).max(1_000_000);
        // Cut [remembered, next) when nothing is remembered and nothing happens for long.
        let mut cuts: Vec<(u64, u64)> = Vec::new();
        let mut remembered = 0u64;
        for pair in events.windows(2) {
            remembered = remembered.max(pair[0].1);
            let (from, to) = (remembered.max(pair[0].0), pair[1].0);
            if to > from && to - from > min_cut {
                // Keep a little of the quiet on both sides, so the refill shows.
                let keep = min_cut / 4;
                cuts.push((from + keep, to - keep));
            }
        }
        remembered = events.iter().map(|e| e.1).max().unwrap_or(0);
        let lead = (span / 50).max(1);
        let start = first.saturating_sub(lead);
        let tail = remembered
            .saturating_sub(last)
            .clamp(span / 50, (span / 8).max(1));
        let end = last.saturating_add(tail).max(start + 1);
        let mut bounds = Vec::with_capacity(cuts.len() + 1);
        let mut from = start;
        for &(a, b) in &cuts {
            bounds.push((from, a));
            from = b;
        }
        bounds.push((from, end));
        let drawn: u64 = bounds.iter().map(|(a, b)| b - a).sum();
        let plot = (width - LEFT - RIGHT - BREAK_PX * cuts.len() as f64).max(100.0);
        let us_per_px = drawn.max(1) as f64 / plot;
        let mut x = LEFT;
        let pieces = bounds
            .into_iter()
            .map(|(a, b)| {
                let p = Piece {
                    start: a,
                    end: b,
                    x,
                };
                x += (b - a) as f64 / us_per_px + BREAK_PX;
                p
            })
            .collect();
        Axis {
            pieces,
            us_per_px,
            width,
        }
    }

    /// The pixel of trace time `t` (inside a cut: the cut's middle).
    pub fn x(&self, t: u64) -> f64 {
        let i = self.pieces.partition_point(|p| p.start <= t);
        if i == 0 {
            return self.pieces[0].x;
        }
        let p = self.pieces[i - 1];
        if t <= p.end {
            p.x + (t - p.start) as f64 / self.us_per_px
        } else if i < self.pieces.len() {
            self.piece_end_x(&p) + BREAK_PX / 2.0
        } else {
            self.piece_end_x(&p)
        }
    }

    pub(super) fn piece_end_x(&self, p: &Piece) -> f64 {
        p.x + (p.end - p.start) as f64 / self.us_per_px
    }

    /// One time per pixel column, in order.
    pub(super) fn columns(&self) -> Vec<u64> {
        let mut out = Vec::new();
        for p in &self.pieces {
            let n = ((p.end - p.start) as f64 / self.us_per_px).ceil() as u64;
            out.extend((0..=n).map(|k| p.start + (k as f64 * self.us_per_px) as u64));
        }
        out.dedup();
        out
    }

    pub(super) fn start(&self) -> u64 {
        self.pieces[0].start
    }

    /// The axis as `start:end:x` pieces, for readers of the file (the tests).
    pub(super) fn describe(&self) -> String {
        let mut s = String::new();
        for p in &self.pieces {
            let _ = write!(s, "{}:{}:{:.3};", p.start, p.end, p.x);
        }
        s.pop();
        s
    }
}
