//! The charge-back's arithmetic, and a model check of the protocol between two instances and
//! their store: every sequence of requests, outages, returns, charges and renewals of a small
//! size, through the layer's road.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;

use super::Units;
use crate::layer::outcome::{Road, road};
use crate::time::Clock;
use crate::{
    Backend, BackendError, BucketKey, BucketTx, FailurePolicy, Header, Id, Limiter, Limits,
    ManualClock, MemoryBackend, Outcomes, RateLimitLayer, Rule, Spend,
};

#[test]
fn a_calendar_quotas_units_weigh_until_their_period_ends() {
    // Periods of a day (the shortest a calendar quota has).
    const DAY: u64 = 86_400_000_000;
    let mut units = Units {
        units: 0,
        until_us: 0,
        every_us: 0,
        within_us: 0,
        bare: false,
    };
    units.add(2, DAY, 10);
    units.add(1, DAY, 20);
    assert_eq!(units.at(DAY - 1), 3);
    assert_eq!(units.at(DAY), 0, "its period has ended");
    // A grant of the next period replaces the ended one's; one of an earlier period is not
    // added to a later one.
    units.add(1, 2 * DAY, DAY);
    units.add(5, DAY, DAY + 1);
    assert_eq!(units.at(DAY + DAY / 2), 1);
    let taken = units;
    units.add(1, 2 * DAY, DAY + DAY / 2 + 100);
    units.sub(&taken, 1);
    assert_eq!(
        units.at(DAY + DAY / 2 + 200),
        1,
        "the grant made during the charge is still owed"
    );
}

/// On a real clock each grant's period end is read as its decision's time plus its
/// `reset_after`, a few microseconds apart for one period: the grants add up (compared
/// exactly, each replaced the last: 3 granted during an outage, 1 charged back).
#[test]
fn grants_whose_period_end_reads_apart_by_microseconds_add_up() {
    const END: u64 = 1_796_083_200_000_000;
    let mut units = Units {
        units: 0,
        until_us: 0,
        every_us: 0,
        within_us: 0,
        bare: false,
    };
    units.add(1, END - 3, 1_000);
    units.add(1, END + 2, 2_000);
    units.add(1, END - 1, 3_000);
    assert_eq!(units.at(END - 10), 3);
    let taken = units;
    units.sub(&taken, 3);
    assert_eq!(units.at(END - 10), 0);
}

#[test]
fn a_gcra_limits_units_are_repaid_by_time_and_rounded_up() {
    // One unit an hour.
    let hour = 3_600_000_000;
    let mut units = Units {
        units: 0,
        until_us: 0,
        every_us: hour,
        within_us: 0,
        bare: false,
    };
    units.add(2, 0, 0);
    assert_eq!(units.at(0), 2);
    assert_eq!(units.at(1), 2, "a unit not fully repaid is still owed");
    assert_eq!(units.at(hour), 1);
    assert_eq!(units.at(2 * hour), 0);
    // A grant after the debt was repaid starts from then.
    units.add(1, 0, 5 * hour);
    assert_eq!(units.at(5 * hour), 1);
    let taken = units;
    units.sub(&taken, 1);
    assert_eq!(units.at(5 * hour), 0);
}

/// The store of the model: memory on a manual clock, which can be down.
#[derive(Clone)]
struct Store {
    memory: MemoryBackend,
    down: Arc<AtomicBool>,
}

#[async_trait]
impl Backend for Store {
    fn spend(&self, batch: &[BucketTx<'_>]) -> Spend {
        if self.down.load(Ordering::Relaxed) {
            return Spend::Ready(Err(BackendError::Unavailable("down".into())));
        }
        self.memory.spend(batch)
    }
    async fn refund(&self, batch: &[BucketTx<'_>]) -> Result<Outcomes, BackendError> {
        self.memory.refund(batch).await
    }
    async fn reset(&self, keys: &[&BucketKey]) -> Result<(), BackendError> {
        self.memory.reset(keys).await
    }
    fn clock(&self) -> Option<Arc<dyn Clock>> {
        self.memory.clock()
    }
    fn decides_penalties(&self) -> bool {
        true
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    /// A request of the one key on instance 0 or 1.
    Request(usize),
    /// The store goes down, or comes back.
    Flip,
    /// Instance 0's or 1's task charges what it owes.
    Charge(usize),
    /// The day renews.
    Renew,
    /// An hour passes (the ladder's model).
    Hour,
}

const EVENTS: [Event; 6] = [
    Event::Request(0),
    Event::Request(1),
    Event::Flip,
    Event::Charge(0),
    Event::Charge(1),
    Event::Renew,
];

const COUNT: u64 = 4;
const DAY_US: u64 = 86_400_000_000;

/// What one run saw: per day, requests allowed, and outages begun.
#[derive(Default)]
struct Run {
    allowed: Vec<u64>,
    outages: Vec<u64>,
    instances_used: [bool; 2],
}

/// The model's deployment: a store on a manual clock (2026-11-25T12:00:00Z; a day renews at
/// midnight UTC), two instances of `limits` over it whose one rule is limit `name` per account,
/// each falling back to memory at 50%, and a request of account `a`.
struct Deployment {
    clock: ManualClock,
    store: Store,
    layers: Vec<RateLimitLayer>,
    parts: http::request::Parts,
}

impl Deployment {
    fn new(limits: &Limits, name: &str) -> Self {
        let clock = ManualClock::new(1_795_608_000_000_000);
        let store = Store {
            memory: MemoryBackend::builder()
                .clock(clock.clone())
                .sweep_interval(Duration::ZERO)
                .build(),
            down: Arc::new(AtomicBool::new(false)),
        };
        let layers = (0..2)
            .map(|_| {
                let limiter = Limiter::new(limits.clone(), store.clone());
                RateLimitLayer::builder(limiter)
                    .rule(Rule::new(name, Header::new("x-account")))
                    .on_backend_failure(FailurePolicy::FallbackToMemory { percent: 50 })
                    .backend_timeout(Duration::from_secs(1))
                    .build()
                    .unwrap()
            })
            .collect();
        let (parts, ()) = http::Request::get("/")
            .header("x-account", "a")
            .body(())
            .unwrap()
            .into_parts();
        Deployment {
            clock,
            store,
            layers,
            parts,
        }
    }
}

async fn run(limits: &Limits, events: &[Event]) -> (Run, u64) {
    let Deployment {
        clock,
        store,
        layers,
        parts,
    } = Deployment::new(limits, "Daily");
    let mut seen = Run {
        allowed: vec![0],
        outages: vec![0],
        ..Run::default()
    };
    let mut day = 0;
    for &event in events {
        match event {
            Event::Request(i) => {
                seen.instances_used[i] = true;
                let allowed = match road(&layers[i].shared, &mut parts.clone()) {
                    Road::Allowed(_) => true,
                    Road::Decided(d) => d.allowed(),
                    Road::Deciding(f) => f.await.allowed(),
                    Road::Answer(_) | Road::Call => panic!("a rule applies"),
                };
                seen.allowed[day] += u64::from(allowed);
            }
            Event::Flip => {
                let down = !store.down.load(Ordering::Relaxed);
                store.down.store(down, Ordering::Relaxed);
                seen.outages[day] += u64::from(down);
            }
            Event::Charge(i) => {
                let shared = &layers[i].shared;
                if let Some(ledger) = shared.failure.ledger() {
                    let _ = ledger.charge(&shared.limiter, &[]).await;
                }
            }
            Event::Renew => {
                let now = clock.now_us();
                clock.set(now - now % DAY_US + DAY_US);
                day += 1;
                seen.allowed.push(0);
                // An outage under way goes on in the new day.
                seen.outages
                    .push(u64::from(store.down.load(Ordering::Relaxed)));
            }
            Event::Hour => unreachable!("the calendar's model moves by the day"),
        }
    }
    // The store back, and every instance's charge made: what the store counts today.
    store.down.store(false, Ordering::Relaxed);
    for layer in &layers {
        let shared = &layer.shared;
        if let Some(ledger) = shared.failure.ledger() {
            ledger.charge(&shared.limiter, &[]).await.unwrap();
        }
    }
    let reader = Limiter::new(limits.clone(), store.clone());
    let key = reader.key("Daily", Id::new("a").unwrap()).unwrap();
    let used = COUNT - reader.inspect(&key).await.unwrap().remaining;
    (seen, used)
}

/// Every sequence of up to 6 events (46,656 of length 6): nothing granted is lost (once the
/// store is back and both instances have charged, the store counts every unit granted today,
/// up to its count); one instance never grants more than the count in a day, outages or not;
/// two grant at most the count plus each one's share (half of the count) per outage.
#[tokio::test(flavor = "current_thread")]
async fn no_sequence_of_outages_charges_and_renewals_loses_or_inflates_a_quota() {
    let yaml = format!("Daily: {{calendar: {{count: {COUNT}, period: day}}}}");
    let limits = Limits::from_yaml_str(&yaml, None).unwrap();
    let mut sequences = 0;
    for len in 1..=6u32 {
        for n in 0..EVENTS.len().pow(len) {
            let mut events = Vec::with_capacity(len as usize);
            let mut m = n;
            for _ in 0..len {
                events.push(EVENTS[m % EVENTS.len()]);
                m /= EVENTS.len();
            }
            let (seen, used) = run(&limits, &events).await;
            sequences += 1;
            let today = *seen.allowed.last().unwrap_or(&0);
            assert_eq!(used, today.min(COUNT), "{events:?}: the store lost a grant");
            for (day, (&allowed, &outages)) in seen.allowed.iter().zip(&seen.outages).enumerate() {
                let bound = if seen.instances_used[1] && seen.instances_used[0] {
                    COUNT + outages * 2 * (COUNT / 2)
                } else {
                    COUNT
                };
                assert!(
                    allowed <= bound,
                    "{events:?}: {allowed} allowed on day {day}, bound {bound}"
                );
            }
        }
    }
    assert_eq!(sequences, 55_986);
}

/// A penalty ladder's units weigh for its window after the last of them; what was charged is
/// no longer owed, and a grant made during the charge still is.
#[test]
fn a_ladders_units_weigh_for_its_window_after_the_last() {
    const WITHIN: u64 = 600_000_000;
    let mut units = Units {
        units: 0,
        until_us: 0,
        every_us: 0,
        within_us: WITHIN,
        bare: false,
    };
    units.add(1, 0, 10);
    units.add(2, 0, 20);
    assert_eq!(units.at(20 + WITHIN - 1), 3);
    assert_eq!(
        units.at(20 + WITHIN),
        0,
        "the window after the last has passed"
    );
    let taken = units;
    units.add(1, 0, 30);
    units.sub(&taken, 3);
    assert_eq!(
        units.at(40),
        1,
        "the grant made during the charge is still owed"
    );
}

/// An answer the ladder's model saw: allowed, refused, or refused by a ban ending at `until`
/// (microseconds, the store's clock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Allowed,
    Refused,
    Banned { until: u64 },
}

/// What one run of the ladder's model saw: each instance's answers in order with their times,
/// the requests allowed in all, and the time the run ended.
#[derive(Default)]
struct LadderRun {
    answers: [Vec<(u64, Answer)>; 2],
    allowed: u64,
    end: u64,
}

impl LadderRun {
    /// The latest end of a ban any instance announced.
    fn latest_ban(&self) -> u64 {
        let ends = self.answers.iter().flatten().filter_map(|(_, a)| match a {
            Answer::Banned { until } => Some(*until),
            _ => None,
        });
        ends.max().unwrap_or(0)
    }
}

/// A ban after 2 counted requests within 3 hours, 2 hours long the first time; the model moves
/// time an hour at a step, so bans end and units leave the window within a run.
const LADDER: &str = "Login: {burst: 100, count: 100, period: 1m, penalty: {after: 2, within: 3h, base: 2h, factor: 2, max: 8h}}";

const HOUR_US: u64 = 3_600_000_000;

const LADDER_EVENTS: [Event; 6] = [
    Event::Request(0),
    Event::Request(1),
    Event::Flip,
    Event::Charge(0),
    Event::Charge(1),
    Event::Hour,
];

/// One request on `layer`: its answer.
async fn answer(layer: &RateLimitLayer, parts: &http::request::Parts, now: u64) -> Answer {
    let decided = match road(&layer.shared, &mut parts.clone()) {
        Road::Decided(d) => d,
        Road::Deciding(f) => f.await,
        _ => panic!("a rule applies, and the road decides"),
    };
    let batch = decided.result.unwrap_or_else(|e| panic!("{e}"));
    match batch.decisions().iter().find(|d| d.banned()) {
        _ if batch.allowed() => Answer::Allowed,
        Some(d) => Answer::Banned {
            until: now + crate::time::duration_us(d.retry_after()),
        },
        None => Answer::Refused,
    }
}

/// Runs `events` on two instances of `limits` (each falling back to memory) over one store;
/// then the store back and both instances' charges made: whether the store bans the key.
async fn run_ladder(limits: &Limits, events: &[Event]) -> (LadderRun, bool) {
    let Deployment {
        clock,
        store,
        layers,
        parts,
    } = Deployment::new(limits, "Login");
    let mut seen = LadderRun::default();
    for &event in events {
        match event {
            Event::Request(i) => {
                let now = clock.now_us();
                let answer = answer(&layers[i], &parts, now).await;
                seen.allowed += u64::from(answer == Answer::Allowed);
                seen.answers[i].push((now, answer));
            }
            Event::Flip => store
                .down
                .store(!store.down.load(Ordering::Relaxed), Ordering::Relaxed),
            Event::Charge(i) => {
                let shared = &layers[i].shared;
                if let Some(ledger) = shared.failure.ledger() {
                    let _ = ledger.charge(&shared.limiter, &[]).await;
                }
            }
            Event::Hour => clock.advance(Duration::from_micros(HOUR_US)),
            Event::Renew => unreachable!("the ladder's model moves by the hour"),
        }
    }
    store.down.store(false, Ordering::Relaxed);
    for layer in &layers {
        let shared = &layer.shared;
        if let Some(ledger) = shared.failure.ledger() {
            ledger.charge(&shared.limiter, &[]).await.unwrap();
        }
    }
    seen.end = clock.now_us();
    let reader = Limiter::new(limits.clone(), store.clone());
    let key = reader.key("Login", Id::new("a").unwrap()).unwrap();
    let banned = reader.inspect(&key).await.unwrap().banned_for.is_some();
    (seen, banned)
}

/// Every sequence of up to 6 requests on two instances, outages, returns, charges and hours
/// passing (55,986): a ban is not forgotten (an instance that answered a request banned, by
/// the store or by its fallback, allows none before the end it announced, outages or not),
/// a count is not lost (once the store is back and both instances have charged, a ban any
/// instance announced that has not ended is the store's too), and none is made up (the store
/// bans only a key 2 requests got through for).
#[tokio::test(flavor = "current_thread")]
async fn no_sequence_of_outages_charges_and_hours_forgets_a_ban() {
    let limits = Limits::from_yaml_str(LADDER, None).unwrap();
    let mut sequences = 0;
    for len in 1..=6u32 {
        for n in 0..LADDER_EVENTS.len().pow(len) {
            let mut m = n;
            let events: Vec<Event> = (0..len)
                .map(|_| {
                    let e = LADDER_EVENTS[m % LADDER_EVENTS.len()];
                    m /= LADDER_EVENTS.len();
                    e
                })
                .collect();
            let (seen, banned) = run_ladder(&limits, &events).await;
            sequences += 1;
            for answers in &seen.answers {
                for (i, &(_, a)) in answers.iter().enumerate() {
                    let Answer::Banned { until } = a else {
                        continue;
                    };
                    assert!(
                        answers[i..]
                            .iter()
                            .all(|&(at, a)| at >= until || a != Answer::Allowed),
                        "{events:?}: {answers:?}: a request allowed before its ban's end"
                    );
                }
            }
            if seen.latest_ban() > seen.end {
                assert!(banned, "{events:?}: a ban in force the store does not hold");
            }
            if banned {
                assert!(seen.allowed >= 2, "{events:?}: a ban no 2 requests made");
            }
        }
    }
    assert_eq!(sequences, 55_986);
}

/// A monthly quota with a ladder, counted by the response (failed logins): what the fallback
/// admitted during an outage is charged to the store's quota, not to its ladder, since the
/// fallback never settled it (before, the store counted every admitted login as a failure
/// and banned the account).
#[tokio::test(flavor = "current_thread")]
async fn a_charge_back_of_an_outcome_rule_leaves_the_ladder_alone() {
    let yaml = "Logins: {calendar: {count: 5, period: month}, penalty: {after: 1, within: 1h, base: 1h, factor: 2, max: 1d}}";
    let limits = Limits::from_yaml_str(yaml, None).unwrap();
    let clock = ManualClock::new(1_795_608_000_000_000);
    let store = Store {
        memory: MemoryBackend::builder()
            .clock(clock.clone())
            .sweep_interval(Duration::ZERO)
            .build(),
        down: Arc::new(AtomicBool::new(true)),
    };
    let rule = Rule::new("Logins", Header::new("x-account"))
        .count_when(crate::CountWhen::new().status(401, 1));
    let layer = RateLimitLayer::builder(Limiter::new(limits.clone(), store.clone()))
        .rule(rule)
        .on_backend_failure(FailurePolicy::FallbackToMemory { percent: 100 })
        .backend_timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let (parts, ()) = http::Request::get("/")
        .header("x-account", "a")
        .body(())
        .unwrap()
        .into_parts();
    let decided = match road(&layer.shared, &mut parts.clone()) {
        Road::Decided(d) => d,
        Road::Deciding(f) => f.await,
        _ => panic!("a rule applies, and the road decides"),
    };
    assert!(
        decided.allowed() && decided.fell_back,
        "the fallback admitted it"
    );
    store.down.store(false, Ordering::Relaxed);
    let ledger = layer.shared.failure.ledger().unwrap();
    ledger.charge(&layer.shared.limiter, &[]).await.unwrap();
    let reader = Limiter::new(limits, store.clone());
    let key = reader.key("Logins", Id::new("a").unwrap()).unwrap();
    let used = store.memory.calendar_state(&key).map(|c| c.used);
    assert_eq!(used, Some(1), "the quota holds the login");
    let seen = reader.inspect(&key).await.unwrap();
    assert_eq!(seen.banned_for, None, "the ladder counted no failure");
}
