//! `plan --html`: the counts, a row per limit (each policy's, what it denied and flipped, the
//! headroom, the suggestion), and the most-flipped keys drawn side by side, each under the
//! current and the candidate limit (the simulator's timeline, `timeline/`), in one
//! self-contained page.
//!
//! A second pass over the logs finds the drawn keys' requests (`Replay::each`: the buckets
//! each request was decided against); each key's requests then run as a trace through its
//! limit alone, under each policy's limits. A batch's other limits are not drawn: a request
//! the drawing shows allowed may have been refused by another limit of its batch (the plan's
//! counts say so). A concurrency limit's keys are listed, not drawn (a trace holds its slots
//! until a `release` line, which a log of durations does not map onto one limit).

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::rc::Rc;

use tower_ratelimits::__private::ShapeRef;
use tower_ratelimits::{
    LimitPlan, Limiter, Limits, LogReader, ManualClock, MemoryBackend, Plan, Quota, Replay, RuleSet,
};

use crate::timeline::{self, Axis, Timeline};
use crate::trace::{self, EPOCH_US};

/// How many keys a page draws.
pub(crate) const DRAWN_KEYS: usize = 6;
/// The most requests drawn per key (the rest are counted, not drawn).
const MAX_DRAWN_REQUESTS: usize = 20_000;
/// Each timeline's width, in pixels (two side by side).
const WIDTH: u32 = 760;

/// What the page needs of the run.
pub(crate) struct Inputs<'a> {
    pub(crate) current: &'a Limits,
    pub(crate) candidate: &'a Limits,
    pub(crate) rules: &'a RuleSet,
    pub(crate) candidate_rules: &'a RuleSet,
    pub(crate) reader: LogReader,
    pub(crate) title: String,
}

/// One drawn key's requests: their times and logged costs.
type Arrivals = Vec<(u64, Option<u64>)>;

/// The page for `plan`.
pub(crate) fn page(plan: &Plan, inputs: Inputs<'_>) -> Result<String, String> {
    let keys: Vec<(String, String)> = plan
        .top_keys
        .iter()
        .take(DRAWN_KEYS)
        .map(|k| (k.limit.clone(), k.id.clone()))
        .collect();
    let arrivals = second_pass(
        &keys,
        inputs.current,
        inputs.candidate,
        inputs.rules,
        inputs.candidate_rules,
        inputs.reader,
    )?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("starting the runtime: {e}"))?;
    let mut out = String::new();
    let _ = write!(
        out,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title><style>{STYLE}</style></head><body><h1>{}</h1>",
        esc(&inputs.title),
        esc(&inputs.title)
    );
    let _ = write!(
        out,
        "<table class=\"counts\"><tr><th></th><th>requests</th><th>allowed</th><th>denied</th><th>rejected</th><th>exempt</th></tr>{}{}</table><p>{} requests ({} bad lines); allowed today, denied by the candidate: <b>{}</b>; denied today, allowed by the candidate: <b>{}</b>.</p>",
        counts_row("current", &plan.current),
        counts_row("candidate", &plan.candidate),
        plan.requests,
        plan.bad_lines,
        plan.allow_to_deny,
        plan.deny_to_allow
    );
    if let Some(streams) = &plan.streams {
        out.push_str(&streams_table(streams));
    }
    out.push_str(&limits_table(plan, inputs.current, inputs.candidate));
    if keys.is_empty() {
        out.push_str("<p>No request changes its answer: nothing to draw.</p>");
    }
    for (i, (limit, id)) in keys.iter().enumerate() {
        let flips = &plan.top_keys[i];
        let _ = write!(
            out,
            "<section class=\"key\"><h2>{} = {}</h2><p>{} allowed today, denied by the candidate; {} denied today, allowed by the candidate.</p><div class=\"pair\">",
            esc(limit),
            esc(id),
            flips.allow_to_deny,
            flips.deny_to_allow
        );
        let requests = arrivals
            .get(&(limit.clone(), id.clone()))
            .cloned()
            .unwrap_or_default();
        for (policy, limits) in [("current", inputs.current), ("candidate", inputs.candidate)] {
            let _ = write!(out, "<figure><figcaption>{policy}</figcaption>");
            match draw(&runtime, limits, limit, id, &requests, policy) {
                Ok(svg) => out.push_str(&svg),
                Err(why) => {
                    let _ = write!(out, "<p class=\"none\">{}</p>", esc(&why));
                }
            }
            out.push_str("</figure>");
        }
        if requests.len() >= MAX_DRAWN_REQUESTS {
            let _ = write!(
                out,
                "<p>The first {MAX_DRAWN_REQUESTS} of its requests are drawn.</p>"
            );
        }
        out.push_str("</div></section>");
    }
    out.push_str("</body></html>\n");
    Ok(out)
}

/// Every limit of either policy, a row each: what it is under each policy (a limit whose
/// shape changed shows both, flips or not), what it denied and flipped, how much of it the
/// keys used, and the suggestion, or why there is none.
fn limits_table(plan: &Plan, current: &Limits, candidate: &Limits) -> String {
    let shown = |limits: &Limits, name: &str| {
        limits
            .name(name)
            .and_then(|n| limits.default_limit(n))
            .map_or_else(|| "not defined".to_string(), |q| esc(&q.to_string()))
    };
    let mut out = String::from(
        "<h2>Per limit</h2><table class=\"counts limits\"><tr><th>limit</th><th>current</th>\
         <th>candidate</th><th>denied now</th><th>denied by the candidate</th>\
         <th>allowed now, denied</th><th>denied now, allowed</th>\
         <th>headroom (p50 / p99 / max of the keys' largest use)</th><th>suggestion</th></tr>",
    );
    for (name, l) in &plan.limits {
        let mut headroom = l.headroom.as_ref().map_or_else(
            || "no key decided".to_string(),
            |h| {
                format!(
                    "{:.0}% / {:.0}% / {:.0}% of {} keys ({})",
                    h.p50 * 100.0,
                    h.p99 * 100.0,
                    h.max * 100.0,
                    h.keys,
                    h.policy
                )
            },
        );
        if l.untallied > 0 {
            let _ = write!(
                headroom,
                "; {} decisions of keys past the replay's bound of keys left out",
                l.untallied
            );
        }
        let suggestion = suggestion(l, candidate.name(name).is_some());
        let _ = write!(
            out,
            "<tr><th>{}{}</th><td class=\"text\">{}</td><td class=\"text\">{}</td><td>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td class=\"text\">{}</td>\
             <td class=\"text\">{}</td></tr>",
            esc(name),
            if l.across_regions {
                " (across regions, replayed as one)"
            } else {
                ""
            },
            shown(current, name),
            shown(candidate, name),
            l.current_denied,
            l.candidate_denied,
            l.allow_to_deny,
            l.deny_to_allow,
            headroom,
            esc(&suggestion)
        );
    }
    out.push_str("</table>");
    out.push_str(HOW_FOUND);
    out
}

/// A limit's suggestion in words, the keys it names apart, or why there is none.
fn suggestion(l: &LimitPlan, in_candidate: bool) -> String {
    if let Some(b) = &l.suggested_budget {
        let text = format!(
            "budget: {} per {} at burst {}, or burst {} at {} per {} (every id together; at \
             most {} of {} requests refused by the budget alone; the candidate: burst {}, \
             count {})",
            grid(b.count),
            b.period,
            b.candidate_burst,
            grid(b.burst),
            b.candidate_count,
            b.period,
            pct(b.target),
            b.requests,
            b.candidate_burst,
            b.candidate_count
        );
        return with_heaviest(text, l, "asked the most");
    }
    let Some((mut text, target, keys)) = per_key_suggestion(l) else {
        return if in_candidate {
            "none: no request of the logs reached it under the candidate".into()
        } else {
            "none: the candidate does not define this limit".into()
        };
    };
    // Fewer keys than one in the target: no key may be left refused, so the suggestion is
    // what the heaviest key needed.
    if keys > 1 && (target * keys as f64) < 1.0 {
        let _ = write!(
            text,
            "; {} of {keys} keys is less than one key, so this is the heaviest key's need (a \
             larger --target leaves it out)",
            pct(target)
        );
    }
    with_heaviest(text, l, "above it")
}

fn pct(target: f64) -> String {
    format!("{:.1}%", target * 100.0)
}

fn grid(n: Option<u64>) -> String {
    n.map_or_else(|| "none of the grid".into(), |c| c.to_string())
}

/// A suggestion taken over keys, in words, with its target and its keys.
fn per_key_suggestion(l: &LimitPlan) -> Option<(String, f64, u64)> {
    if let Some(s) = &l.suggested {
        let text = format!(
            "burst {} at {} per {}, or {} per {} at burst {} (at most {} of {} keys refused; \
             the candidate: burst {}, count {})",
            s.burst,
            s.candidate_count,
            s.period,
            grid(s.count),
            s.period,
            s.candidate_burst,
            pct(s.target),
            s.keys,
            s.candidate_burst,
            s.candidate_count
        );
        return Some((text, s.target, s.keys));
    }
    if let Some(c) = &l.suggested_count {
        let text = format!(
            "count {} per {} (at most {} of {} keys asked more in one period; the candidate: \
             count {})",
            c.count,
            c.period,
            pct(c.target),
            c.keys,
            c.candidate_count
        );
        return Some((text, c.target, c.keys));
    }
    if let Some(m) = &l.suggested_max {
        let text = format!(
            "{} {}{} (at most {} of {} keys had more requests in flight at once, each held \
             for its logged duration; the candidate: {})",
            if m.adaptive {
                "adaptive max"
            } else {
                "concurrency"
            },
            if m.at_least { "at least " } else { "" },
            m.max,
            pct(m.target),
            m.keys,
            m.candidate_max
        );
        return Some((text, m.target, m.keys));
    }
    let t = l.suggested_tiers.as_ref()?;
    let tiers: Vec<String> = t
        .tiers
        .iter()
        .map(|tier| {
            format!(
                "limit {} per {} (the candidate: {})",
                tier.limit, tier.window, tier.candidate_limit
            )
        })
        .collect();
    let text = format!(
        "{} (each tier as if alone: at most {} of {} keys asked more in one window)",
        tiers.join(", "),
        pct(t.target),
        t.keys
    );
    Some((text, t.target, t.keys))
}

fn with_heaviest(mut text: String, l: &LimitPlan, what: &str) -> String {
    if !l.heaviest.is_empty() {
        let named: Vec<String> = l
            .heaviest
            .iter()
            .map(|h| format!("{} ({})", h.id, h.needed))
            .collect();
        let _ = write!(text, ". Heaviest keys, {what}: {}", named.join(", "));
    }
    text
}

/// How the table's numbers are found, on the page under it.
const HOW_FOUND: &str = "<p class=\"how\"><b>How these are found.</b> <i>Denied</i>: the \
requests this limit's own decision refused (a request refused by two limits counts for both). \
<i>Allowed now, denied</i> and <i>denied now, allowed</i>: the requests whose answer changes, \
counted for the limits that refuse them (under the candidate, or today). <i>Headroom</i>: for \
each key, the largest share of the limit it held after any decision (tokens taken over the \
burst; slots held over the slots; units used over the count), then the median, the 99th \
percentile and the largest over the keys, under the current policy's limit, or the \
candidate's where only it has one. <i>Suggestion</i>, for the candidate's limit, from the log's own requests at their logged \
cost, refused ones included (what a key asked, not what it got), so that no more than the \
target share of keys (<code>--target</code>, 1% unless given) would see a refusal: the keys \
above it are what the limit exists to stop, and the heaviest of them are named. A GCRA limit: \
each key's requests through a bucket at the candidate's rate with no burst bound (the burst it \
needed), and through the candidate's burst at a grid of rates (a quarter of the candidate's to \
64 times it); the smallest burst, and the smallest rate. A calendar quota: each key's most \
units in one of its periods. A concurrency limit, and an adaptive limit's max: each key's most \
requests in flight at once, each held for its logged duration (the layer renews a lease while \
its request lives). Burst tiers: \
each tier as if alone, each key's most units in any window of the tier's length. A fair share: \
its budget, every id's requests as one stream through the same grids, so that the budget alone \
refuses no more than the target share of the requests; its heaviest are the ids that asked the \
most.</p>";

/// The log's streams: their messages under each policy, the flips, and the approximation
/// when a stream was replayed from its totals.
fn streams_table(s: &tower_ratelimits::StreamsPlan) -> String {
    let row = |name: &str, c: &tower_ratelimits::MessageCounts| {
        format!(
            "<tr><th>{name}</th><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            c.passed, c.held, c.refused, c.unopened
        )
    };
    let approximation = s.approximation.as_deref().map_or(String::new(), |a| {
        format!("<p class=\"none\">{}</p>", esc(a))
    });
    format!(
        "<h2>Streams</h2><table class=\"counts\"><tr><th></th><th>passed</th><th>held</th><th>refused</th><th>unopened</th></tr>{}{}</table><p>{} streams, {} messages ({} outside an open stream); passed today, refused by the candidate: <b>{}</b>; refused today, passed by the candidate: <b>{}</b>.</p>{approximation}",
        row("current", &s.current),
        row("candidate", &s.candidate),
        s.streams,
        s.messages,
        s.outside,
        s.pass_to_refuse,
        s.refuse_to_pass
    )
}

fn counts_row(name: &str, c: &tower_ratelimits::Counts) -> String {
    format!(
        "<tr><th>{name}</th><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
        c.requests, c.allowed, c.denied, c.rejected, c.exempt
    )
}

/// The drawn keys' requests, from a second replay of the logs.
fn second_pass(
    keys: &[(String, String)],
    current: &Limits,
    candidate: &Limits,
    rules: &RuleSet,
    candidate_rules: &RuleSet,
    reader: LogReader,
) -> Result<HashMap<(String, String), Arrivals>, String> {
    let found: Rc<RefCell<HashMap<(String, String), Arrivals>>> = Rc::default();
    if keys.is_empty() {
        return Ok(HashMap::new());
    }
    let wanted: Vec<(String, String)> = keys.to_vec();
    let into = found.clone();
    let (rules, candidate_rules) = (rules.clone(), candidate_rules.clone());
    Replay::new(move |l| rules.layer(l), current.clone(), candidate.clone())
        .candidate_layer(move |l| candidate_rules.layer(l))
        .each(move |r| {
            let mut found = into.borrow_mut();
            for want in &wanted {
                let hit = r
                    .candidate_buckets
                    .iter()
                    .chain(r.current_buckets)
                    .any(|b| b.name().as_str() == want.0 && b.id().to_string() == want.1);
                let list = found.entry(want.clone()).or_default();
                if hit && list.len() < MAX_DRAWN_REQUESTS {
                    list.push((r.request.time_us, r.request.cost));
                }
            }
        })
        .run(reader)
        .map_err(|e| e.to_string())?;
    let mut found = std::mem::take(&mut *found.borrow_mut());
    // A request waiting to be decided again is told when it is: in time order again.
    for list in found.values_mut() {
        list.sort_by_key(|a| a.0);
    }
    Ok(found)
}

/// One key's requests through its limit under `limits`, drawn as an SVG.
fn draw(
    runtime: &tokio::runtime::Runtime,
    limits: &Limits,
    limit: &str,
    id: &str,
    requests: &[(u64, Option<u64>)],
    policy: &str,
) -> Result<String, String> {
    let name = limits
        .names()
        .find(|n| n.as_str() == limit)
        .ok_or_else(|| format!("The {policy} policy has no limit {limit}."))?;
    let quota = limits.default_limit(name);
    // Slots in flight have no curve of units to draw (a new shape says whether it has one).
    let slots = match quota.map(Quota::shape_ref) {
        Some(ShapeRef::Concurrency(_) | ShapeRef::Adaptive(_)) => true,
        None
        | Some(
            ShapeRef::Gcra(_)
            | ShapeRef::Tiered(_)
            | ShapeRef::Calendar(_)
            | ShapeRef::FairShare(_),
        ) => false,
    };
    if slots {
        return Err(format!(
            "{limit} is a concurrency limit: listed, not drawn."
        ));
    }
    let mut text = String::new();
    for &(at, cost) in requests {
        if at < EPOCH_US {
            continue;
        }
        let instant = tower_ratelimits::__private::instant_text(at);
        let _ = match cost {
            Some(c) => writeln!(text, "{instant} spend {limit}={id} cost={c}"),
            None => writeln!(text, "{instant} spend {limit}={id}"),
        };
    }
    let clock = ManualClock::new(EPOCH_US);
    let memory = MemoryBackend::builder().clock(clock.clone()).build();
    let limiter = Limiter::new(limits.clone(), memory.clone());
    let events = timeline::events(&limiter, &text);
    let axis = Axis::new(&events, WIDTH);
    let mut drawing = Timeline::new(
        axis,
        &limiter,
        memory,
        clock.clone(),
        format!("{limit}={id} · {policy}"),
    )
    .dated(true);
    runtime
        .block_on(trace::run_observed(
            &limiter,
            &clock,
            text.as_bytes(),
            std::io::sink(),
            &mut drawing,
        ))
        .map_err(|e| format!("drawing {limit}={id}: {e}"))?;
    Ok(drawing.svg())
}

fn esc(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

const STYLE: &str = "
body{font:14px system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:16px;color:#222}
table.counts{border-collapse:collapse}
table.counts td,table.counts th{border:1px solid #ddd;padding:3px 8px;text-align:right}
table.counts td.text{text-align:left;max-width:28em}
p.how{max-width:60em;color:#444}
.pair{display:flex;gap:16px;flex-wrap:wrap}
figure{margin:0;overflow-x:auto}
figcaption{font-weight:600}
.none{color:#777}
";
