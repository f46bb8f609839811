-- tower-ratelimits: a batch of buckets in one slot, decided and written atomically.
-- GCRA buckets mirror src/algo/gcra.rs (one function here: `gcra`), tiered keys mirror
-- src/algo/tiers.rs. The protocol below is encoded and decoded by src/backend/redis/script.rs.
-- Every value is an integer number of microseconds (or units) below 2^53, so Lua's doubles
-- hold them exactly.
--
-- KEYS[i]   the keys (one slot).
-- ARGV[1]   'G' (a spend whose keys are all GCRA: the lean path below), 'C' (one calendar
--           key alone, checked and spent: its own path, below the lean one; 'c' with the
--           defaults, no head), 'spend', 'refund'
--           or 'restore', then the head ARGV[2..4]; or, with exactly two arguments per key and
--           no op (the lean spend with the defaults: the server's clock, keys expiring when
--           fresh, every key check-and-spend; every other call has more), the records alone,
--           from ARGV[1]. Called 'g' below. Each argument costs the server about 2,000
--           instructions, so the most frequent call sends none it can do without. 'M'
--           (coalesced 'g' calls of several requests) has its own head, described at the lean
--           path below.
-- ARGV[2]   now in microseconds, or -1 to read the server's clock (TIME).
-- ARGV[3]   -1: expire keys when their state equals a fresh one, on the server's clock (PXAT);
--           m >= 0: that long after now plus m milliseconds (PX), for caller time, which the
--           server's clock cannot follow.
-- ARGV[4]   1: return, for tiered keys, the value before and after (to undo a spend of a
--           denied cross-slot batch with 'restore'); 0: do not.
-- then, per key, a record:
--   lean    (op 'G') increment (emission interval * cost), burst offset, mode; ('g') the
--           same without the mode
--   GCRA    0, emission interval, burst offset, burst, cost, mode, debt offset (emission
--           interval * max_debt); or for a partial grant (min..cost) 2, the same fields, then
--           min (the least units acceptable); or for a charge (mode 4: a settle's overrun,
--           never denied, may go into debt) 4, the same fields
--   tiered  1, mode, min, max, tier count n, then per tier: limit, window, active, cooldown
--   concurrency  3, mode, cost (0 probes, 1 takes a slot), max in flight, lease time, retry
--           hint, lease id (text; '0': none; a renewal: every lease it renews, separated by
--           spaces). The key is a sorted set of lease ids scored by their deadlines
--           (src/algo/concurrency.rs); a refund releases the lease
--   calendar  5, mode, min, max, count, the end of the period in force on the caller's clock,
--           the end of the one after it (the script counts in the first while its clock is
--           before that end, else in the second: src/algo/calendar.rs). The key holds
--           "<period end> <units used>" and expires at the period's end
--   restore (op 'restore' only) the value the spend wrote, the value before ('' for none),
--           and the milliseconds the value before had to live (-1: none)
--   (mode 0 check-and-spend, 1 check-only, 2 spend-only, 3 observe, 4 charge, 5 renew: a
--   concurrency key's lease id gets the deadline now + lease when it still holds its slot;
--   it never takes one)
--
-- 'g' and 'G' return a flat list: now, then each key's stored TAT before the call (0: none); the
-- caller computes the decisions from them with the same rule (src/algo/gcra.rs `check`, and
-- the batch rule), so nothing is formatted or divided here. The other ops return, per key, a
-- list: allowed (0/1), remaining, retry_after, reset_after, then for GCRA
-- the TAT stored afterwards (0: none) and, for a spend of a range (min < cost) or a charge,
-- the units granted; for concurrency keys 0 (and, for a renewal, the leases renewed); for
-- tiered keys 0, granted, the serving tier, burst (0/1),
-- the units of each tier and, when ARGV[4] is 1, the value before, the value after and the
-- milliseconds the value before had to live.
--
-- What the crate wrote, and what it did not (docs/gcra.md, "Changing a limit" and "Foreign
-- values"). A GCRA key records with its TAT the bound of the limit that wrote it (how far ahead
-- of its writing that limit sets a TAT: burst offset + debt offset), as a bit length k: the
-- key expires k milliseconds after its TAT's millisecond (PXAT), read back with PEXPIRETIME
-- (Redis 7; before it, and with caller time (PX), nothing is known of the writer).
-- A TAT further ahead of now than the larger of the limit's own bound and 2^k, plus SLACK
-- (src/algo/gcra.rs `FOREIGN_SLACK_US`), and any value that is not a TAT (another type, not a
-- whole number, out of range), is foreign: it is read as the bucket drained under the limit in
-- force (now + burst offset) and replaced by that, whatever the batch decides. A lease
-- deadline beyond now + lease + SLACK is cut to now + lease. A tier state that is not ours
-- (or a time in it more than SLACK ahead) is a fresh state, replaced by the first write. The
-- lean path carries only limits whose debt offset is their burst offset (the default), so its
-- own bound is 2 * burst offset.
--
-- A tiered state is one MessagePack array: {1, base, n, then per tier: entry - base (-1: none),
-- grant count k, then k pairs (time - base, units)}.

-- 2^52: stored times and now stay below it; SLACK: how far beyond what the crate writes a
-- stored time may run before it is foreign (src/algo/gcra.rs FOREIGN_SLACK_US).
local LIMIT, SLACK = 4503599627370496, 60000000

-- The protocol's codes, from the one table in src/backend/redis/script.rs (`PROTOCOL`); a
-- test there holds these lines to it, and no code compares a kind, a mode or an op with a bare
-- literal. Those the lean path reads are here; the rest follow it (each local costs every call
-- that declares it about 50 server instructions).
local OP_LEAN_DEFAULTS, OP_LEAN, OP_COALESCED = 'g', 'G', 'M'
local OP_CALENDAR, OP_CALENDAR_DEFAULTS = 'C', 'c'
local MODE_CHECK_AND_SPEND, MODE_CHECK_ONLY, MODE_SPEND_ONLY = 0, 1, 2

local n = #KEYS
-- 'g' (the lean spend with the defaults) has no op and no head: two arguments per key.
local op, now, margin, want_raw = OP_LEAN_DEFAULTS, -1, -1, false
if #ARGV ~= 2 * n then
  op = ARGV[1]
  if op ~= OP_COALESCED and op ~= OP_CALENDAR_DEFAULTS then
    now = tonumber(ARGV[2])
    margin = tonumber(ARGV[3])
    want_raw = ARGV[4] == '1'
  end
end
if now < 0 then
  -- TIME's two fields are always numbers: Lua's own coercion reads them, about 900 server
  -- instructions cheaper each than a call of the global `tonumber`.
  local t = redis.call('TIME')
  now = t[1] * 1000000 + t[2]
end

-- The lean path: a spend whose keys are all GCRA (every request of a GCRA-only
-- configuration). Per key: increment, burst offset (and mode for 'G'); the answer is now and
-- the TATs read. It runs before anything below is defined and calls no function of this
-- script: in Lua 5.1 each `local function` is a closure allocated on every call, and that cost
-- the lean path 14,000 server instructions per call (benches/redis_instructions.sh). So the
-- GCRA rule (`gcra_fits`), the stored-value check (`read_tat`), the modes (`counts`,
-- `gcra_writes`) and the expiry (`expire_args`) are written out here once more;
-- tests/redis_keys.rs (`the_scripts_fast_path_decides_gcra_exactly_as_its_general_path`, the 2^52
-- and expiry tests) holds the two writings to each other.
--
-- 'M' (coalesced: several requests' lean spends with the defaults in one call, each its own
-- batch, all or nothing alone) has no head: ARGV[2] is the number of batches b, ARGV[3..2+b]
-- their key counts (in KEYS order), then two fields per key as in 'g'. Batches are decided in
-- order, each written before the next is read, as if they had been separate calls; the answer
-- is one list, now then every key's TAT read (a request whose write failed: the error's text
-- in place of each of its TATs; the others are decided as usual).
if op == OP_LEAN_DEFAULTS or op == OP_LEAN or op == OP_COALESCED then
  local first, per, batches, sizes = 5, 3, 1, 0
  if op == OP_LEAN_DEFAULTS then
    first, per = 1, 2
  elseif op == OP_COALESCED then
    batches = tonumber(ARGV[2])
    first, per, sizes = 3 + batches, 2, 2
  end
  -- out: now and the TATs read (the answer), then the TATs to write (false: none), then each
  -- key's burst offset read as a number (a string is converted on every use: about 500
  -- server instructions each), all cut off before answering: one table, sized for up to two
  -- keys. fix: the drained TATs that replace foreign values, by key (false until one is met).
  local out, done, fix = {now, 0, 0, 0, 0, 0, 0}, 0, false
  for b = 1, batches do
    local last, allowed = n, true
    if sizes > 0 then last = done + tonumber(ARGV[sizes + b]) end
    for i = done + 1, last do
      local a = first + (i - 1) * per
      local bo = ARGV[a + 1] + 0
      out[2 * n + 1 + i] = bo
      local raw = redis.pcall('GET', KEYS[i])
      local s = 0
      if raw then
        s = tonumber(raw)
        if s == nil or s < 0 or s >= LIMIT or s % 1 ~= 0 then
          s = -1
        elseif s - now > SLACK and s - now > 2 * bo + SLACK then
          -- Beyond this limit's bound: the crate's if its writer's bound, the key's expiry
          -- past the TAT's millisecond, reaches it.
          local up, k = s + 999, -1
          if margin < 0 then
            k = redis.pcall('PEXPIRETIME', KEYS[i])
            if type(k) ~= 'number' then k = 0 end
            k = k - (up - up % 1000) / 1000
            if k < 1 or k > 52 then k = -1 end
          end
          if s - now > 2 ^ k + SLACK then s = -1 end
        end
        if s < 0 then
          s = now + bo
          if not fix then fix = {} end
          fix[i] = s
        end
      end
      local mode = MODE_CHECK_AND_SPEND
      if per == 3 then mode = tonumber(ARGV[a + 2]) end
      local tat = s
      if tat < now then tat = now end
      local new_tat = tat + ARGV[a]
      out[i + 1] = s
      out[n + 1 + i] = false
      if new_tat - bo > now then
        if mode == MODE_CHECK_AND_SPEND or mode == MODE_CHECK_ONLY then allowed = false end
      elseif (mode == MODE_CHECK_AND_SPEND or mode == MODE_SPEND_ONLY) and new_tat > now
        and new_tat ~= s then
        out[n + 1 + i] = new_tat
      end
    end
    for i = done + 1, last do
      local t = out[n + 1 + i]
      if not allowed then t = false end
      if fix and not t then t = fix[i] end
      if t then
        -- Whole milliseconds, rounded up, without a call: t + 999 - (t + 999) % 1000 is
        -- exact below 2^53; then k more, the bit length of this limit's bound (2 * burst
        -- offset).
        local up, r = t + 999, nil
        if margin < 0 then
          local _, k = math.frexp(2 * out[2 * n + 1 + i])
          r = redis.pcall('SET', KEYS[i], t, 'PXAT', (up - up % 1000) / 1000 + k)
        else
          up = up - now
          r = redis.pcall('SET', KEYS[i], t, 'PX', (up - up % 1000) / 1000 + margin)
        end
        if r.err then
          -- A write refused (out of memory): alone, the call's error; coalesced, this
          -- request's answer is the error text in place of its TATs, and the next goes on.
          if batches == 1 then return r end
          for j = done + 1, last do out[j + 1] = r.err end
          break
        end
      end
    end
    done, fix = last, false
  end
  out[n + 2] = nil
  return out
end

-- 'C' (one calendar key alone, checked and spent: every request of a configuration whose only
-- rule is a calendar quota): the head, then count, the period in force on the caller's clock
-- (start, end), the next end and the horizon, as in the calendar record of 'spend', then min,
-- and max only when it is not min; 'c' the same with the defaults ('g''s) and no head. src/algo/calendar.rs `read` and `decide` (the general
-- path's `calendar`, below) written out once more, for the reason given at the lean path;
-- tests/redis_keys.rs (`the_scripts_calendar_path_decides_exactly_as_its_general_path`) holds
-- the two writings to each other. It answers now, the units that counted and the end of the
-- period it chose (the caller decides from them with the same rule, `decide_used`: a nested
-- reply cost 4,000 server instructions more).
if op == OP_CALENDAR or op == OP_CALENDAR_DEFAULTS then
  local a = 5
  if op == OP_CALENDAR_DEFAULTS then a = 2 end
  local count, e, min, max = ARGV[a] + 0, ARGV[a + 2] + 0, ARGV[a + 5] + 0, ARGV[a + 6]
  if max then max = max + 0 else max = min end
  if now < ARGV[a + 1] + 0 then
    e = ARGV[a + 1] + 0
  elseif now >= e then
    e = ARGV[a + 3] + 0
  end
  -- The units that count (a stored end past the period in force is cut to it and written
  -- back; a value that is not "<end> <used>", or an end beyond the horizon, is foreign: the
  -- period drained, written back).
  local raw = redis.pcall('GET', KEYS[1])
  local used, write = 0, false
  if raw then
    local se, su
    if type(raw) == 'string' then se, su = string.match(raw, '^(%d+) (%d+)$') end
    -- Digits: Lua's own coercion reads them (cheaper than `tonumber`, as for TIME above).
    if se then se, su = se + 0, su + 0 end
    if se and se < LIMIT and se <= now + ARGV[a + 4] then
      -- Units past 2^52 (charges add up to any size) read as 2^52: above every count.
      if su > LIMIT then su = LIMIT end
      if se > e then
        used, write = su, true
      elseif now < se then
        used = su
      end
    else
      used, write = count, true
    end
  end
  -- src/algo/calendar.rs `decide_used`: the most units that fit, at least min.
  local left, counted = count - used, used
  if left < 0 then left = 0 end
  local granted = max
  if left < max then granted = left end
  if granted >= min and granted > 0 then used, write = used + granted, true end
  if write then
    if used > LIMIT then used = LIMIT end
    local up = e + 999
    if margin < 0 then
      redis.call('SET', KEYS[1], string.format('%d %d', e, used), 'PXAT', (up - up % 1000) / 1000)
    else
      up = up - now
      redis.call('SET', KEYS[1], string.format('%d %d', e, used), 'PX',
        (up - up % 1000) / 1000 + margin)
    end
  end
  return {now, counted, e}
end

-- Shared by every path ------------------------------------------------------------------------

local OP_SPEND, OP_REFUND, OP_RESTORE = 'spend', 'refund', 'restore'
local KIND_GCRA, KIND_TIERED, KIND_RANGE, KIND_CONCURRENCY, KIND_CHARGE, KIND_CALENDAR = 0, 1, 2, 3, 4, 5
local MODE_OBSERVE, MODE_CHARGE, MODE_RENEW = 3, 4, 5

-- The core of the rule: the TAT after spending `incr` (emission interval * cost) on a bucket
-- whose stored TAT is `stored`, and whether it fits (new_tat - bo <= now).
local function gcra_fits(stored, incr, bo)
  local tat = stored
  if tat < now then tat = now end
  local new_tat = tat + incr
  return new_tat, new_tat - bo <= now
end

-- Whether a transaction of this mode counts toward the batch (spend-only and observe do not).
local function counts(mode) return mode == MODE_CHECK_AND_SPEND or mode == MODE_CHECK_ONLY end

-- Whether a transaction of this mode is written when allowed (check-only and observe are not).
local function spends(mode)
  return mode == MODE_CHECK_AND_SPEND or mode == MODE_SPEND_ONLY or mode == MODE_CHARGE
end

-- Whether an allowed GCRA spend writes its new TAT (never one that does not spend, never a
-- no-op).
local function gcra_writes(mode, new_tat, stored)
  return spends(mode) and new_tat > now and new_tat ~= stored
end

-- The stored TAT of GCRA key i under record r (0: none), and its writer's bound's bit length
-- (0 when it was not needed). A TAT beyond the larger of r's bound and its writer's (plus
-- SLACK), and a value that is not a TAT of ours (another type, not a number, not a whole
-- number, out of range: another program's data, or a future format), is foreign: read as the
-- bucket drained under r, which replaces it (r.fix; SET replaces a value of any type).
-- `tonumber` yields nil for another type (an error table) and text that is not a number.
local function read_tat(i, r)
  local raw = redis.pcall('GET', KEYS[i])
  if not raw then return 0, 0 end
  local v = tonumber(raw)
  local k = 0
  if v == nil or v < 0 or v >= LIMIT or v % 1 ~= 0 then
    v = -1
  elseif v - now > r.bo + r.debt + SLACK then
    k = -1
    if margin < 0 then
      local up = v + 999
      k = redis.pcall('PEXPIRETIME', KEYS[i])
      if type(k) ~= 'number' then k = 0 end
      k = k - (up - up % 1000) / 1000
      if k < 1 or k > 52 then k = -1 end
    end
    if v - now > 2 ^ k + SLACK then v = -1 end
  end
  if v < 0 then
    r.fix = true
    return now + r.bo, 0
  end
  return v, k
end

-- Numbers are passed to commands as they are: Redis 7 writes a whole double below 2^53 as
-- its exact decimal digits (`tests/redis_keys.rs` holds it to that). On the server's clock a
-- GCRA key expires k milliseconds after its TAT: k records the writer's bound (above).
local function expire_args(at, k)
  if margin < 0 then
    return 'PXAT', math.floor((at + 999) / 1000) + (k or 0)
  end
  return 'PX', math.floor((at - now + 999) / 1000) + margin
end

-- Writes GCRA key i's TAT under a bound of bit length k.
local function write_tat(key, tat, k)
  if tat <= now then
    redis.call('DEL', key)
  else
    redis.call('SET', key, tat, expire_args(tat, k))
  end
end

-- Keeps key i until its last lease ends.
local function keep_until_last(i)
  local last = tonumber(redis.call('ZRANGE', KEYS[i], -1, -1, 'WITHSCORES')[2])
  local how, ms = expire_args(last)
  if how == 'PXAT' then
    redis.call('PEXPIREAT', KEYS[i], ms)
  else
    redis.call('PEXPIRE', KEYS[i], ms)
  end
end

-- The bit length of record r's bound (burst offset + debt offset): what its writes record.
local function bound_length(r)
  local _, k = math.frexp(r.bo + r.debt)
  return k
end

-- The rest: refunds, restores, tiered keys and mixed batches --------------------------------

-- floor(v / ei) for v > 0 (0 otherwise), corrected for the rounding of the division.
local function tokens(v, ei)
  if v <= 0 then return 0 end
  local q = math.floor(v / ei)
  if q * ei > v then
    q = q - 1
  elseif (q + 1) * ei <= v then
    q = q + 1
  end
  return q
end

-- The GCRA rule (docs/gcra.md "spend"; src/algo/gcra.rs `check`): the decision for `cost` on a
-- bucket whose stored TAT is `stored` (0: none). Returns allowed (0/1), remaining,
-- retry_after, reset_after and the TAT a spend stores (nil on a denial).
local function gcra(stored, ei, bo, cost)
  local incr = ei * cost
  local new_tat, fits = gcra_fits(stored, incr, bo)
  local tat = new_tat - incr
  local difference = now - (new_tat - bo)
  if not fits then
    return 0, tokens(now - (tat - bo), ei), -difference, tat - now, nil
  end
  local retry = 0
  if difference < incr then retry = incr - difference end
  return 1, tokens(difference, ei), retry, new_tat - now, new_tat
end

-- The units a GCRA spend of min..max takes (docs/gcra.md "partial grants"; src/algo/gcra.rs
-- `check_range`): the most whole units that fit now, at most max; min when fewer fit (then
-- `gcra` denies it, with the wait before min units fit).
local function gcra_grant(stored, ei, bo, min, max)
  local tat = stored
  if tat < now then tat = now end
  local k = tokens(bo - (tat - now), ei)
  if k > max then k = max end
  if k < min then k = min end
  return k
end

-- A charge (docs/gcra.md "charge"; src/algo/gcra.rs `charge`): the most whole units, at most
-- cost, that fit before the debt bound (bo + debt ahead of now); never denied. Returns 1,
-- remaining, retry_after (the wait before one unit fits), reset_after, the TAT to store (nil:
-- none) and the units charged.
local function gcra_charge(stored, ei, bo, debt, cost)
  local tat = stored
  if tat < now then tat = now end
  local k = tokens(bo + debt - (tat - now), ei)
  if k > cost then k = cost end
  local after = tat - now + ei * k
  local retry = after + ei - bo
  if retry < 0 then retry = 0 end
  local new_tat = nil
  if k > 0 then new_tat = now + after end
  return 1, tokens(bo - after, ei), retry, after, new_tat, k
end

-- The GCRA refund (docs/gcra.md "refund"): allowed (0/1), remaining, reset_after, and the TAT
-- to store (nil: unchanged).
local function gcra_refund(stored, ei, bo, burst, cost)
  if stored == 0 or stored < now then return 0, burst, 0, nil end
  local new_tat = math.max(stored - ei * cost, now)
  if new_tat == stored then
    return 0, tokens(now - (new_tat - bo), ei), new_tat - now, nil
  end
  return 1, tokens(now - (new_tat - bo), ei), new_tat - now, new_tat
end

if op == OP_RESTORE then
  for i = 1, n do
    local b = 4 + (i - 1) * 3
    local written, before, ttl = ARGV[b + 1], ARGV[b + 2], tonumber(ARGV[b + 3])
    local cur = redis.pcall('GET', KEYS[i])
    if cur == written then
      if before == '' then
        redis.call('DEL', KEYS[i])
      elseif ttl > 0 then
        redis.call('SET', KEYS[i], before, 'PX', ttl)
      else
        redis.call('SET', KEYS[i], before)
      end
    end
  end
  return {now}
end

-- Parse the records.
local rec = {}
local a = 5
for i = 1, n do
  local kind = tonumber(ARGV[a])
  if kind == KIND_GCRA or kind == KIND_RANGE or kind == KIND_CHARGE then
    local cost = tonumber(ARGV[a + 4])
    rec[i] = {kind = KIND_GCRA, ei = tonumber(ARGV[a + 1]), bo = tonumber(ARGV[a + 2]),
      burst = tonumber(ARGV[a + 3]), cost = cost, mode = tonumber(ARGV[a + 5]), min = cost,
      debt = tonumber(ARGV[a + 6]), charge = kind == KIND_CHARGE}
    a = a + 7
    if kind == KIND_RANGE then
      rec[i].min = tonumber(ARGV[a])
      a = a + 1
    end
  elseif kind == KIND_CALENDAR then
    -- The period that holds this server's clock, of the three the instance sends (its own
    -- period's start and end, and the next end): the store's clock decides, so an instance
    -- whose clock runs ahead or behind spends in the store's period (before `s`, the period
    -- ending at `s`).
    local s, e = tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6])
    if now < s then
      e = s
    elseif now >= e then
      e = tonumber(ARGV[a + 7])
    end
    rec[i] = {kind = KIND_CALENDAR, mode = tonumber(ARGV[a + 1]), min = tonumber(ARGV[a + 2]),
      max = tonumber(ARGV[a + 3]), count = tonumber(ARGV[a + 4]), e = e,
      h = tonumber(ARGV[a + 8])}
    a = a + 9
  elseif kind == KIND_CONCURRENCY then
    rec[i] = {kind = KIND_CONCURRENCY, mode = tonumber(ARGV[a + 1]), cost = tonumber(ARGV[a + 2]),
      max = tonumber(ARGV[a + 3]), lease = tonumber(ARGV[a + 4]), retry = tonumber(ARGV[a + 5]),
      id = ARGV[a + 6]}
    a = a + 7
  else
    local r = {kind = KIND_TIERED, mode = tonumber(ARGV[a + 1]), min = tonumber(ARGV[a + 2]),
      max = tonumber(ARGV[a + 3]), n = tonumber(ARGV[a + 4]), L = {}, W = {}, A = {}, C = {}}
    a = a + 5
    for j = 1, r.n do
      r.L[j], r.W[j], r.A[j], r.C[j] = tonumber(ARGV[a]), tonumber(ARGV[a + 1]),
        tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
      a = a + 4
    end
    rec[i] = r
  end
end

-- Read every key before deciding anything.
local function int_ok(v, lo)
  return type(v) == 'number' and v == math.floor(v) and v >= lo and v < LIMIT
end

-- A tiered state: entry[j] (or nil), lt[j] / lc[j] the grants' times and units, for the
-- configured tiers (stored tiers beyond them are ignored, missing ones are empty).
local function decode_tiers(raw, r)
  local ok, v = pcall(cmsgpack.unpack, raw)
  if not ok or type(v) ~= 'table' or v[1] ~= 1 then
    return nil, 'the stored value is not a tier state'
  end
  local base, cnt = v[2], v[3]
  if not int_ok(base, 0) or not int_ok(cnt, 0) or cnt > 64 or base > now + SLACK then
    return nil, 'the stored tier state is out of range'
  end
  local s = {entry = {}, lt = {}, lc = {}}
  local p = 4
  for j = 1, cnt do
    local e, k = v[p], v[p + 1]
    if not int_ok(e, -1) or not int_ok(k, 0) or (e >= 0 and base + e > now + SLACK) then
      return nil, 'the stored tier state is malformed'
    end
    p = p + 2
    local lt, lc = {}, {}
    for g = 1, k do
      local t, c = v[p], v[p + 1]
      if not int_ok(t, 0) or not int_ok(c, 1) or base + t >= LIMIT or base + t > now + SLACK then
        return nil, 'the stored tier state has a malformed grant'
      end
      lt[g], lc[g] = base + t, c
      p = p + 2
    end
    if j <= r.n then
      if e >= 0 then s.entry[j] = base + e end
      s.lt[j], s.lc[j] = lt, lc
    end
  end
  for j = 1, r.n do
    if not s.lt[j] then s.lt[j], s.lc[j] = {}, {} end
  end
  return s
end

local stored = {}
local raws = {}
local ttls = {}
local kread = {}
for i = 1, n do
  local r = rec[i]
  if r.kind == KIND_GCRA then
    stored[i], kread[i] = read_tat(i, r)
  elseif r.kind == KIND_CALENDAR then
    -- src/algo/calendar.rs `read`: units used count while the clock is before both the end
    -- they were counted to and the end of the period in force. An end past the period in
    -- force is cut to it and written back (r.fix); one more than the horizon ahead, or a
    -- value that is not "<end> <used>", is foreign: read as the period drained, and replaced.
    -- Units used past 2^52 (charges add up to any size) read as 2^52: above every count.
    local raw = redis.pcall('GET', KEYS[i])
    local e, u
    if type(raw) == 'string' then e, u = string.match(raw, '^(%d+) (%d+)$') end
    e, u = tonumber(e), tonumber(u)
    if e and u and e < LIMIT and e <= now + r.h then
      u = math.min(u, LIMIT)
      stored[i] = 0
      if e > r.e then
        stored[i], r.fix = u, true
      elseif now < e then
        stored[i] = u
      end
    elseif raw then
      stored[i], r.fix = r.count, true
    else
      stored[i] = 0
    end
  elseif r.kind == KIND_CONCURRENCY then
    -- The live leases (deadline after now): ended ones are dropped first, which changes no
    -- decision; foreign ones (a deadline further ahead than a lease runs) are cut to a lease
    -- taken now (src/algo/concurrency.rs `read`): they hold a slot for one lease time. A value
    -- that is not a sorted set is no lease at all (-1), and the first lease replaces it.
    local trimmed = redis.pcall('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
    if type(trimmed) == 'table' then
      stored[i] = -1
    else
      local far = redis.call('ZRANGEBYSCORE', KEYS[i], now + r.lease + SLACK + 1, '+inf')
      for _, id in ipairs(far) do redis.call('ZADD', KEYS[i], now + r.lease, id) end
      if #far > 0 then keep_until_last(i) end
      stored[i] = redis.call('ZCARD', KEYS[i])
    end
  else
    -- A value that is not a tier state of ours (another type, not ours, a time more than SLACK
    -- ahead) is foreign: read as the state drained under r (below, once the tier functions
    -- are defined), which replaces it (r.fix). Undoing a spend puts back what was there (''
    -- deletes the key).
    local raw = redis.pcall('GET', KEYS[i])
    local s = type(raw) == 'string' and decode_tiers(raw, r) or nil
    if s then
      stored[i] = s
      raws[i] = raw
    else
      stored[i] = {entry = {}, lt = {}, lc = {}}
      for j = 1, r.n do stored[i].lt[j], stored[i].lc[j] = {}, {} end
      raws[i] = type(raw) == 'string' and raw or ''
      r.fix = raw ~= false
    end
  end
end

-- Calendar quotas (src/algo/calendar.rs `decide`) ---------------------------------------------

-- The decision of record r on `used` units of its period: the reply, and the units used after
-- it when it is written (nil: nothing to write). A charge takes its whole cost.
local function calendar(r, used)
  local left = r.count - used
  if left < 0 then left = 0 end
  local reset = math.max(r.e - now, 0)
  local granted = math.min(r.max, left)
  if r.mode == MODE_CHARGE then granted = r.max end
  if r.mode ~= MODE_CHARGE and granted < r.min then return {0, left, reset, reset, r.e, 0} end
  local rem = r.count - used - granted
  if rem < 0 then rem = 0 end
  local after
  if spends(r.mode) and granted > 0 then after = used + granted end
  return {1, rem, 0, reset, r.e, granted}, after
end

-- Writes the units used in the period in force (at most 2^52: above every count, so an overrun
-- of any size ends with its period), until its end.
local function write_calendar(key, r, used)
  redis.call('SET', key, string.format('%d %d', r.e, math.min(used, LIMIT)), expire_args(r.e))
  r.written = true
end

-- Burst tiers ---------------------------------------------------------------------------------

-- 0 inactive, 1 active, 2 cooldown
local function phase(r, j, e, t)
  if e == nil then return 0 end
  local ae = e + r.A[j]
  if t > ae + r.C[j] then return 0 end
  if t <= ae then return 1 end
  return 2
end

local function sum_since(lt, lc, start)
  local u = 0
  for g = #lt, 1, -1 do
    if lt[g] < start then break end
    u = u + lc[g]
  end
  return u
end

local function used(r, s, j, t, ph)
  local start = t - r.W[j]
  if j > 1 then
    local e = s.entry[j]
    if ph == 0 or e == nil then return 0 end
    if e > start then start = e end
  end
  return sum_since(s.lt[j], s.lc[j], start)
end

local function current(r, s, t)
  for j = r.n, 1, -1 do
    if phase(r, j, s.entry[j], t) == 1 then return j end
  end
  return 1
end

-- The plan for min..max units: units per tier, tiers to enter, the last tier visited.
local function plan(r, s, t, min, max)
  local cur = current(r, s, t)
  local want, need = max, min
  local p = {units = {}, enter = {}, last = nil, allowed = false, cur = cur}
  for j = 1, r.n do p.units[j] = 0 end
  for j = cur, r.n do
    if want == 0 then break end
    local ph = phase(r, j, s.entry[j], t)
    if ph == 2 then break end
    local free = r.L[j] - used(r, s, j, t, ph)
    if free < 0 then free = 0 end
    local d = math.min(free, want)
    p.units[j] = d
    p.last = j
    if ph == 0 then p.enter[j] = true end
    want = want - d
    need = need - d
  end
  p.allowed = need <= 0
  return p
end

-- The first instant at which the state (with plan p recorded at now) equals a fresh one.
local function fresh_at(r, s, p)
  local at = 0
  for j = 1, r.n do
    local e = s.entry[j]
    if p and p.enter[j] then e = now end
    if e ~= nil then at = math.max(at, e + r.A[j] + r.C[j] + 1) end
  end
  local lt = s.lt[1]
  local last = lt[#lt]
  if p and p.units[1] > 0 then last = now end
  if last ~= nil then at = math.max(at, last + r.W[1] + 1) end
  return at
end

-- The exact wait until `need` units would be granted (see tiers.rs: retry_after).
local function retry_after(r, s, need)
  local events = {}
  for j = 1, r.n do
    local lt = s.lt[j]
    for g = 1, #lt do
      local ev = lt[g] + r.W[j] + 1
      if ev > now then events[#events + 1] = ev end
    end
    local e = s.entry[j]
    if e ~= nil then
      local ae = e + r.A[j] + 1
      if ae > now then events[#events + 1] = ae end
      if ae + r.C[j] > now then events[#events + 1] = ae + r.C[j] end
    end
  end
  table.sort(events)
  local first, dropped, total = {}, {}, {}
  for j = 1, r.n do
    first[j], dropped[j], total[j] = 1, 0, 0
    for g = 1, #s.lc[j] do total[j] = total[j] + s.lc[j][g] end
  end
  local prev = -1
  for _, at in ipairs(events) do
    if at ~= prev then
      prev = at
      local cur = current(r, s, at)
      local left = need
      for j = cur, r.n do
        local ph = phase(r, j, s.entry[j], at)
        if ph == 2 then break end
        local u = 0
        if not (j > 1 and ph == 0) then
          local start = at - r.W[j]
          local e = s.entry[j]
          if j > 1 and e ~= nil and e > start then start = e end
          local lt, lc = s.lt[j], s.lc[j]
          while first[j] <= #lt and lt[first[j]] < start do
            dropped[j] = dropped[j] + lc[first[j]]
            first[j] = first[j] + 1
          end
          u = total[j] - dropped[j]
        end
        local free = r.L[j] - u
        if free > 0 then left = left - free end
        if left <= 0 then return at - now end
      end
    end
  end
  local f = fresh_at(r, s, nil) - now
  if f < 0 then f = 0 end
  return f
end

-- Drops what can no longer count (see tiers.rs: normalize).
local function normalize(r, s)
  for j = 1, r.n do
    if phase(r, j, s.entry[j], now) == 0 then
      s.entry[j] = nil
      if j > 1 then s.lt[j], s.lc[j] = {}, {} end
    end
    local start = now - r.W[j]
    local e = s.entry[j]
    if j > 1 and e ~= nil and e > start then start = e end
    local lt, lc = s.lt[j], s.lc[j]
    local keep = 1
    while keep <= #lt and lt[keep] < start do keep = keep + 1 end
    if keep > 1 then
      local nt, nc = {}, {}
      for g = keep, #lt do nt[#nt + 1], nc[#nc + 1] = lt[g], lc[g] end
      s.lt[j], s.lc[j] = nt, nc
    end
  end
end

local function apply(r, s, p)
  for j = 1, r.n do
    if p.enter[j] then
      s.entry[j] = now
      if j > 1 then s.lt[j], s.lc[j] = {}, {} end
    end
    local d = p.units[j]
    if d > 0 then
      local lt, lc = s.lt[j], s.lc[j]
      if lt[#lt] == now then
        lc[#lc] = lc[#lc] + d
      else
        lt[#lt + 1], lc[#lc + 1] = now, d
      end
    end
  end
  normalize(r, s)
end

-- Writes a tiered state (deleting it when it equals a fresh one); returns the value written.
local function write_tiers(key, r, s)
  r.written = true
  local at = fresh_at(r, s, nil)
  if at <= now then
    redis.call('DEL', key)
    return ''
  end
  local base = nil
  for j = 1, r.n do
    local e = s.entry[j]
    if e ~= nil and (base == nil or e < base) then base = e end
    local t = s.lt[j][1]
    if t ~= nil and (base == nil or t < base) then base = t end
  end
  if base == nil then base = now end
  local v = {1, base, r.n}
  for j = 1, r.n do
    local e = s.entry[j]
    v[#v + 1] = e and (e - base) or -1
    local lt, lc = s.lt[j], s.lc[j]
    v[#v + 1] = #lt
    for g = 1, #lt do
      v[#v + 1] = lt[g] - base
      v[#v + 1] = lc[g]
    end
  end
  local raw = cmsgpack.pack(v)
  redis.call('SET', key, raw, expire_args(at))
  return raw
end

local function tier_reply(r, allowed, remaining, retry, reset, granted, tier, burst, units)
  local o = {allowed, remaining, retry, reset, 0, granted, tier, burst}
  for j = 1, r.n do o[8 + j] = units[j] or 0 end
  return o
end

local function decide_tiers(r, s)
  local p = plan(r, s, now, r.min, r.max)
  if not p.allowed then
    local cur = p.cur
    local rem = r.L[cur] - used(r, s, cur, now, phase(r, cur, s.entry[cur], now))
    if rem < 0 then rem = 0 end
    local reset = fresh_at(r, s, nil) - now
    if reset < 0 then reset = 0 end
    return tier_reply(r, 0, rem, retry_after(r, s, r.min), reset, 0, cur, 0, {}), p
  end
  local last = p.last or p.cur
  local rem = r.L[last] - used(r, s, last, now, phase(r, last, s.entry[last], now)) - p.units[last]
  if rem < 0 then rem = 0 end
  local granted, burst = 0, 0
  for j = 1, r.n do
    granted = granted + p.units[j]
    if j > p.cur and p.units[j] > 0 then burst = 1 end
  end
  local reset = fresh_at(r, s, p) - now
  if reset < 0 then reset = 0 end
  return tier_reply(r, 1, rem, 0, reset, granted, last, burst, p.units), p
end

-- A foreign tier state is read as the state drained under r (src/algo/tiers.rs `drained`):
-- what a fresh key holds once a request of the whole capacity was granted.
for i = 1, n do
  local r = rec[i]
  if r.kind == KIND_TIERED and r.fix then
    local cap = 0
    for j = 1, r.n do cap = cap + r.L[j] end
    local p = plan(r, stored[i], now, cap, cap)
    if p.allowed then apply(r, stored[i], p) end
  end
end

-- Concurrency keys ----------------------------------------------------------------------------

-- The rule (src/algo/concurrency.rs `decide`): a request taking a slot (cost 1) is allowed when
-- fewer than max leases are live; a probe (cost 0) always is. Returns allowed (0/1), remaining
-- and the hint (0 when allowed).
local function concurrency(r, live)
  if live < 0 then live = 0 end
  local used = live + r.cost
  -- A charge records a slot already in use: taken even beyond max.
  if used <= r.max or r.cost == 0 or r.mode == MODE_CHARGE then
    local rem = r.max - used
    if rem < 0 then rem = 0 end
    return 1, rem, 0
  end
  return 0, 0, r.retry
end

-- Records lease r.id on key i, taken now, and keeps the key until its last lease ends.
local function take_lease(i, r)
  if stored[i] < 0 then redis.call('DEL', KEYS[i]) end
  redis.call('ZADD', KEYS[i], now + r.lease, r.id)
  keep_until_last(i)
end

-- Renews the leases r.held on key i (they hold their slots: decided before): deadline now +
-- lease, set only on members that are there (XX), so a release that ran first is not undone.
local function renew_lease(i, r)
  for from = 1, #r.held, 1000 do
    local args = {KEYS[i], 'XX'}
    for j = from, math.min(from + 999, #r.held) do
      args[#args + 1] = now + r.lease
      args[#args + 1] = r.held[j]
    end
    redis.call('ZADD', unpack(args))
  end
  keep_until_last(i)
end

-- Decide -------------------------------------------------------------------------------------

local out = {}

local function add_raw(i, before, after)
  if want_raw then
    local o = out[i]
    o[#o + 1] = before
    o[#o + 1] = after
    o[#o + 1] = ttls[i] or -1
  end
end

if op == OP_SPEND then
  local batch_allowed = true
  local writes = {}
  local plans = {}
  for i = 1, n do
    local r = rec[i]
    if r.kind == KIND_GCRA and r.charge then
      local ok, rem, retry, reset, new_tat, k = gcra_charge(stored[i], r.ei, r.bo, r.debt, r.cost)
      out[i] = {ok, rem, retry, reset, stored[i], k}
      if new_tat and gcra_writes(r.mode, new_tat, stored[i]) then writes[i] = new_tat end
    elseif r.kind == KIND_GCRA then
      local s = stored[i]
      local cost = r.cost
      if r.min < cost then cost = gcra_grant(s, r.ei, r.bo, r.min, cost) end
      local ok, rem, retry, reset, new_tat = gcra(s, r.ei, r.bo, cost)
      out[i] = {ok, rem, retry, reset, s}
      if r.min < r.cost then out[i][6] = ok * cost end
      if ok == 0 then
        if counts(r.mode) then batch_allowed = false end
      elseif gcra_writes(r.mode, new_tat, s) then
        writes[i] = new_tat
      end
    elseif r.kind == KIND_CALENDAR then
      out[i], writes[i] = calendar(r, stored[i])
      if out[i][1] == 0 and counts(r.mode) then batch_allowed = false end
    elseif r.kind == KIND_CONCURRENCY and r.mode == MODE_RENEW then
      -- Held: the ids among the live leases (ended ones were removed, foreign ones cut), each
      -- renewed below; the answer counts them.
      local held = {}
      if stored[i] >= 0 then
        local ids = {}
        for id in string.gmatch(r.id, '%d+') do ids[#ids + 1] = id end
        -- ZMSCORE in chunks (a command's arguments come from one `unpack`).
        for from = 1, #ids, 1000 do
          local chunk = {}
          for j = from, math.min(from + 999, #ids) do chunk[#chunk + 1] = ids[j] end
          local scores = redis.call('ZMSCORE', KEYS[i], unpack(chunk))
          for j, score in ipairs(scores) do
            if score then held[#held + 1] = chunk[j] end
          end
        end
      end
      r.held = held
      local rem = r.max - math.max(stored[i], 0)
      if rem < 0 then rem = 0 end
      local any = 0
      if #held > 0 then any = 1 end
      out[i] = {any, rem, 0, 0, 0, #held}
    elseif r.kind == KIND_CONCURRENCY then
      local ok, rem, retry = concurrency(r, stored[i])
      out[i] = {ok, rem, retry, retry, 0}
      if ok == 0 and counts(r.mode) then batch_allowed = false end
    else
      local o, p = decide_tiers(r, stored[i])
      out[i] = o
      if o[1] == 1 then
        plans[i] = p
      elseif counts(r.mode) then
        batch_allowed = false
      end
    end
  end
  for i = 1, n do
    local r = rec[i]
    local after = raws[i]
    if batch_allowed then
      if r.kind == KIND_GCRA and writes[i] then
        write_tat(KEYS[i], writes[i], bound_length(r))
        out[i][5] = writes[i]
      elseif r.kind == KIND_CALENDAR and writes[i] then
        write_calendar(KEYS[i], r, writes[i])
      elseif r.kind == KIND_CONCURRENCY and r.mode == MODE_RENEW and out[i][1] == 1 then
        renew_lease(i, r)
      elseif r.kind == KIND_CONCURRENCY and out[i][1] == 1 and spends(r.mode) and r.cost == 1
          and r.id ~= '0' then
        take_lease(i, r)
      elseif r.kind == KIND_TIERED and plans[i] and spends(r.mode) then
        if want_raw then ttls[i] = redis.call('PTTL', KEYS[i]) end
        apply(r, stored[i], plans[i])
        after = write_tiers(KEYS[i], r, stored[i])
      end
    end
    if r.kind == KIND_TIERED then add_raw(i, raws[i], after) end
  end
elseif op == OP_REFUND then
  for i = 1, n do
    local r = rec[i]
    if r.kind == KIND_GCRA then
      local s = stored[i]
      local ok, rem, reset, new_tat = gcra_refund(s, r.ei, r.bo, r.burst, r.cost)
      out[i] = {ok, rem, 0, reset, s}
      if new_tat then
        -- What a refund leaves may still be as far ahead as its writer set it: keep its bound.
        write_tat(KEYS[i], new_tat, math.max(bound_length(r), kread[i]))
        out[i][5] = new_tat
      end
    elseif r.kind == KIND_CALENDAR then
      local back = math.min(r.max, stored[i])
      local rem = r.count - (stored[i] - back)
      if rem < 0 then rem = 0 end
      out[i] = {back > 0 and 1 or 0, rem, 0, math.max(r.e - now, 0), r.e}
      if back > 0 then write_calendar(KEYS[i], r, stored[i] - back) end
    elseif r.kind == KIND_CONCURRENCY then
      -- A release: the lease's id leaves the set (ended leases already left it).
      local released, live = 0, 0
      if stored[i] >= 0 then
        released = redis.call('ZREM', KEYS[i], r.id)
        live = redis.call('ZCARD', KEYS[i])
      end
      local rem = r.max - live
      if rem < 0 then rem = 0 end
      out[i] = {released, rem, 0, 0, 0}
    else
      local s = stored[i]
      normalize(r, s)
      local taken = {}
      for j = 1, r.n do taken[j] = 0 end
      local left = r.max
      while left > 0 do
        local best, best_t = nil, nil
        for j = r.n, 1, -1 do
          local lt = s.lt[j]
          local t = lt[#lt]
          if t ~= nil and (best_t == nil or t > best_t) then best, best_t = j, t end
        end
        if best == nil then break end
        local lt, lc = s.lt[best], s.lc[best]
        local d = math.min(lc[#lc], left)
        lc[#lc] = lc[#lc] - d
        if lc[#lc] == 0 then
          lt[#lt] = nil
          lc[#lc] = nil
        end
        taken[best] = taken[best] + d
        left = left - d
      end
      local refunded = r.max - left
      if refunded > 0 then write_tiers(KEYS[i], r, s) end
      local cur = current(r, s, now)
      local rem = r.L[cur] - used(r, s, cur, now, phase(r, cur, s.entry[cur], now))
      if rem < 0 then rem = 0 end
      local reset = fresh_at(r, s, nil) - now
      if reset < 0 then reset = 0 end
      out[i] = tier_reply(r, refunded > 0 and 1 or 0, rem, 0, reset, refunded, cur, 0, taken)
    end
  end
else
  return redis.error_reply('tower-ratelimits: unknown operation')
end

-- Foreign values the batch did not write over: replaced by the drained state they were read
-- as.
for i = 1, n do
  local r = rec[i]
  if r.kind == KIND_GCRA and r.fix and out[i][5] == stored[i] then
    write_tat(KEYS[i], stored[i], bound_length(r))
  elseif r.kind == KIND_TIERED and r.fix and not r.written then
    write_tiers(KEYS[i], r, stored[i])
  elseif r.kind == KIND_CALENDAR and r.fix and not r.written then
    write_calendar(KEYS[i], r, stored[i])
  end
end

for i = 1, n do
  if rec[i].kind == KIND_GCRA and out[i][5] <= now then out[i][5] = 0 end
end
out[n + 1] = now
return out
