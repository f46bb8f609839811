//! The penalty rule in the script (`penalty.lua`) against the Rust rule it mirrors
//! (`src/algo/penalty.rs`), on a real `redis-server`: random ladders and random interleavings
//! of admissions, outcomes and counted events, every reply and the state after each step
//! (read back through its stored form) the same.

use super::*;
use crate::algo::penalty::{Admission, Ladder, PenaltyState, Tally};
use fred::prelude::{Client, ClientLike, Config, LuaInterface};

/// Runs `ops` on a fresh state in the script, the state encoded and decoded after each op:
/// each op's reply, then the final state (level, since, until, then each entry's three).
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
    reply = P.admit(l, s, tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]))
    a = a + 3
  elseif op == 's' then
    reply = P.settle(l, s, keytext, tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]),
      tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]))
    a = a + 5
  else
    reply = P.count(l, s, keytext, tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]))
    a = a + 3
  end
  for _, v in ipairs(reply) do out[#out + 1] = v end
  local err
  s, err = P.decode(P.encode(s))
  if not s then return redis.error_reply(err) end
end
out[#out + 1] = s.level
out[#out + 1] = s.since
out[#out + 1] = s['until']
for j = 1, #s.at do
  out[#out + 1] = s.at[j]
  out[#out + 1] = s.counted[j]
  out[#out + 1] = s.pending[j]
end
return out
"#;

fn admission(a: Admission) -> Vec<i64> {
    match a {
        Admission::Admitted => vec![0],
        Admission::Banned { until, level } => vec![1, until as i64, i64::from(level)],
        Admission::Full { until } => vec![2, until as i64],
    }
}

fn tally(t: Tally) -> Vec<i64> {
    match t {
        Tally::Counted(u) => vec![3, u as i64],
        Tally::Banned { until, level } => vec![4, until as i64, i64::from(level)],
        Tally::Ignored => vec![5],
    }
}

#[tokio::test]
async fn the_script_decides_every_step_as_the_rust_rule() {
    let server = redis();
    let client = Client::new(Config::from_url(&server.url).unwrap(), None, None, None);
    client.init().await.unwrap();
    let script = format!("{}\n{DRIVER}", include_str!("../penalty.lua"));
    let mut rng = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    const T0: u64 = 1_700_000_000_000_000;
    for case in 0..60 {
        // Small ladders (bans, decay, jitter all reached), and a few at the bounds.
        let big = case % 10 == 9;
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
        let key = format!("Login:user{case}");
        let mut s = PenaltyState::default();
        let mut args: Vec<String> = [after, within, base, factor, max, forget, jitter]
            .iter()
            .map(u64::to_string)
            .collect();
        args.push(key.clone());
        let mut expect: Vec<i64> = Vec::new();
        let mut open: Vec<(u64, u64)> = Vec::new();
        let mut now = T0;
        for _ in 0..120 {
            now += next(3) * next(8);
            match next(3) {
                0 => {
                    let reserve = next(4);
                    let got = s.admit(&l, reserve, now);
                    if got == Admission::Admitted {
                        open.push((now, reserve));
                    }
                    expect.extend(admission(got));
                    args.extend(["a".into(), reserve.to_string(), now.to_string()]);
                }
                1 if !open.is_empty() => {
                    let (at, reserved) = open.remove(next(open.len() as u64) as usize);
                    let counted = next(reserved + 2);
                    expect.extend(tally(s.settle(
                        &l,
                        key.as_bytes(),
                        (at, reserved),
                        counted,
                        now,
                    )));
                    args.extend(
                        ["s".into(), at.to_string(), reserved.to_string()]
                            .into_iter()
                            .chain([counted.to_string(), now.to_string()]),
                    );
                }
                _ => {
                    let units = next(3);
                    expect.extend(tally(s.count(&l, key.as_bytes(), units, now)));
                    args.extend(["c".into(), units.to_string(), now.to_string()]);
                }
            }
        }
        expect.extend([i64::from(s.level), s.since as i64, s.banned_until as i64]);
        for e in &s.events {
            expect.extend([e.at as i64, e.counted as i64, e.pending as i64]);
        }
        let got: Vec<i64> = client
            .eval(script.as_str(), Vec::<String>::new(), args)
            .await
            .unwrap();
        assert_eq!(got, expect, "case {case}: {l:?}");
    }
}
