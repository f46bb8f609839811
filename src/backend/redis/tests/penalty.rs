//! The penalty rule in the script (`penalty.lua`) against the Rust rule it mirrors
//! (`src/algo/penalty.rs`), on a real `redis-server`: random ladders and random interleavings
//! of admissions, outcomes and counted events, every reply and the state after each step
//! (read back through its stored form) the same.

use super::*;
use crate::algo::penalty::{Admission, Ladder, PenaltyState, Tally};
use fred::prelude::{Client, ClientLike, Config, LuaInterface};

/// Runs `ops` on a fresh state in the script, the state encoded and decoded after each op:
/// each op's reply, then the final state (level, since, until, each counted entry's time and
/// units, each reservation's id, time and units), every number as its decimal text.
const DRIVER: &str = r#"
local P = penalty_rule()
local l = {after = tonumber(ARGV[1]), within = tonumber(ARGV[2]), base = tonumber(ARGV[3]),
  factor = tonumber(ARGV[4]), max = tonumber(ARGV[5]), forget = tonumber(ARGV[6]),
  jitter = tonumber(ARGV[7])}
local keytext = ARGV[8]
local s = P.fresh()
local out = {}
local a = 9
while a <= #ARGV do
  local op = ARGV[a]
  local reply
  if op == 'a' then
    reply = P.admit(l, s, ARGV[a + 1], tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]))
    a = a + 4
  elseif op == 's' then
    reply = P.settle(l, s, keytext, ARGV[a + 1], tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]))
    a = a + 4
  else
    reply = P.count(l, s, keytext, tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]))
    a = a + 3
  end
  for _, v in ipairs(reply) do out[#out + 1] = v end
  local err
  s, err = P.decode(P.encode(s))
  if not s then return redis.error_reply(err) end
end
for _, v in ipairs({s.level, s.since, s['until']}) do out[#out + 1] = v end
for j = 1, #s.et do out[#out + 1], out[#out + 2] = s.et[j], s.eu[j] end
for j = 1, #s.rid do out[#out + 1], out[#out + 2], out[#out + 3] = s.rid[j], s.rat[j], s.ru[j] end
for j = 1, #out do
  if type(out[j]) == 'number' then out[j] = string.format('%.0f', out[j]) end
end
return out
"#;

fn admission(a: Admission) -> Vec<u64> {
    match a {
        Admission::Admitted => vec![0],
        Admission::Banned { until, level } => vec![1, until, u64::from(level)],
        Admission::Full { until } => vec![2, until],
    }
}

fn tally(t: Tally) -> Vec<u64> {
    match t {
        Tally::Counted(u) => vec![3, u],
        Tally::Banned { until, level } => vec![4, until, u64::from(level)],
        Tally::Ignored => vec![5],
    }
}

fn text(list: Vec<u64>) -> impl Iterator<Item = String> {
    list.into_iter().map(|n| n.to_string())
}

/// A random ladder (small: bans, decay and jitter all reached; or at the bounds when `big`)
/// and its arguments for the driver.
fn random_ladder(big: bool, next: &mut impl FnMut(u64) -> u64) -> (Ladder, Vec<String>) {
    let (after, within, base) = if big {
        (1_000, 8_640_000_000_000, 86_400_000_000)
    } else {
        (1 + next(6), 1 + next(40), 1 + next(30))
    };
    let factor = if big { 1_000 } else { 1 + next(4) };
    let max = if big {
        8_640_000_000_000
    } else {
        base * (1 + next(30))
    };
    let forget = 1 + next(60);
    let jitter = [0, 1, 250, 1_000][next(4) as usize];
    let l = Ladder::new(after, within, base, factor, max)
        .and_then(|l| l.forget_after(forget))
        .and_then(|l| l.jitter(jitter))
        .unwrap();
    let args = text(vec![after, within, base, factor, max, forget, jitter]).collect();
    (l, args)
}

/// 120 random steps on `l` for `key` in the Rust rule: the driver's arguments for them, and
/// what the Rust rule answered and holds at the end, as the driver returns it.
fn random_steps(
    l: &Ladder,
    key: &str,
    next: &mut impl FnMut(u64) -> u64,
) -> (Vec<String>, Vec<String>) {
    const T0: u64 = 1_700_000_000_000_000;
    let (mut s, mut now) = (PenaltyState::default(), T0);
    let (mut args, mut expect, mut open) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..120 {
        now += next(3) * next(8);
        match next(3) {
            0 => {
                // Lease ids are any u64: the script keeps them as text.
                let (id, reserve) = (next(u64::MAX), next(4));
                let got = s.admit(l, (id, reserve), now);
                if got == Admission::Admitted {
                    open.push(id);
                }
                expect.extend(text(admission(got)));
                args.push("a".to_owned());
                args.extend(text(vec![id, reserve, now]));
            }
            1 if !open.is_empty() => {
                let id = open.remove(next(open.len() as u64) as usize);
                let counted = next(5);
                expect.extend(text(tally(s.settle(l, key.as_bytes(), id, counted, now))));
                args.push("s".to_owned());
                args.extend(text(vec![id, counted, now]));
            }
            _ => {
                let units = next(3);
                expect.extend(text(tally(s.count(l, key.as_bytes(), units, now))));
                args.push("c".to_owned());
                args.extend(text(vec![units, now]));
            }
        }
    }
    expect.extend(text(vec![u64::from(s.level), s.since, s.banned_until]));
    for &(at, units) in &s.events {
        expect.extend(text(vec![at, units]));
    }
    for r in &s.reservations {
        expect.extend(text(vec![r.id, r.at, r.units]));
    }
    (args, expect)
}

#[tokio::test]
async fn the_script_decides_every_step_as_the_rust_rule() {
    let server = redis();
    let client = Client::new(Config::from_url(&server.url).unwrap(), None, None, None);
    client.init().await.unwrap();
    // The rule alone: the companion's handler after it needs the whole script's head.
    let lua = include_str!("../penalty.lua");
    let rule = lua.split("\nlocal KIND_PENALTY").next().unwrap_or(lua);
    let script = format!("{rule}\n{DRIVER}");
    let mut rng = crate::algo::Rng(0x9e37_79b9_7f4a_7c15);
    let mut next = |n: u64| rng.below(n);
    for case in 0..60 {
        let (l, mut args) = random_ladder(case % 10 == 9, &mut next);
        let key = format!("Login:user{case}");
        args.push(key.clone());
        let (steps, expect) = random_steps(&l, &key, &mut next);
        args.extend(steps);
        let got: Vec<String> = client
            .eval(script.as_str(), Vec::<String>::new(), args)
            .await
            .unwrap();
        assert_eq!(got, expect, "case {case}: {l:?}");
    }
}

/// A clock skew of 30 s between each instance and the store: the store's clock decides a
/// key's penalty, so two instances on one store, one 30 s ahead and one 30 s behind, count
/// into one window, see the ban they start last exactly its length (told to wait 10 s, not
/// 40 s or none), and the ban's state outlives the ban on the store.
#[tokio::test]
async fn a_ban_lasts_its_length_by_the_store_s_clock_whatever_an_instance_s() {
    use crate::{Id, Limit, Limiter, Limits, Transaction};
    const S: u64 = 1_000_000;
    let server = redis();
    let real = SystemClock.now_us();
    let prefix = format!("t:skew-ban:{}:{real}:", std::process::id());
    let limits = || {
        let ladder = Ladder::new(3, 60 * S, 10 * S, 2, 60 * S).unwrap();
        Limits::builder()
            .limit("Login", Limit::from_micros(1_000, 1_000, S).unwrap())
            .penalty("Login", ladder)
            .build()
            .unwrap()
    };
    let mut instances = Vec::new();
    for at in [real + 30 * S, real - 30 * S] {
        let backend = RedisBackend::from_url(&server.url)
            .prefix(&prefix)
            .skewed_clock(ManualClock::new(at))
            .connect()
            .await
            .unwrap();
        instances.push(Limiter::new(limits(), backend));
    }
    let [ahead, behind] = [&instances[0], &instances[1]];
    let tx = Transaction::new(ahead.key("Login", Id::from(7u64)).unwrap());
    for (i, limiter) in [ahead, behind, ahead].into_iter().enumerate() {
        let d = limiter.spend(std::slice::from_ref(&tx)).await.unwrap();
        assert!(d.allowed(), "the event that bans is let through");
        let reset = d.decisions()[0].reset_after();
        if i < 2 {
            assert_eq!(d.decisions()[0].remaining(), 2 - i as u64, "one window");
        } else {
            let ban = Duration::from_secs(10);
            assert!(
                reset <= ban && reset > ban - Duration::from_secs(2),
                "{reset:?}"
            );
        }
    }
    for limiter in [ahead, behind] {
        let d = limiter.spend(std::slice::from_ref(&tx)).await.unwrap();
        assert!(
            !d.allowed() && d.decisions()[0].banned,
            "banned on every instance"
        );
        let wait = d.decisions()[0].retry_after();
        let ban = Duration::from_secs(10);
        assert!(
            wait <= ban && wait > ban - Duration::from_secs(2),
            "{wait:?}"
        );
    }
    let client = Client::new(Config::from_url(&server.url).unwrap(), None, None, None);
    client.init().await.unwrap();
    let ttl: i64 = fred::prelude::KeysInterface::pttl(&client, format!("{prefix}{{Login:7}}:pen"))
        .await
        .unwrap();
    assert!(
        ttl > 9_000,
        "the state outlives the ban on the store: {ttl} ms"
    );
}
