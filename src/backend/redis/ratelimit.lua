-- tower-ratelimits: a batch of buckets in one slot, decided and written atomically.
-- Each shape's records mirror its algorithm in src/algo/ (GCRA buckets src/algo/gcra.rs, and
-- so on). The protocol below is encoded and decoded by src/backend/redis/script.rs. The
-- script is several files, joined in order into the one script Redis runs (script.rs
-- `SCRIPT`): this one (the head and the paths of the most frequent calls, which define no
-- function), then the general path: general.lua (what every shape uses, and the table of
-- shapes), each shape's own file (gcra.lua, share.lua, calendar.lua, concurrency.lua,
-- tiers.lua, fair_share.lua, adaptive.lua: its records parsed, read, decided and written),
-- and general_run.lua (the loops that drive them, naming no shape).
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
--           (coalesced 'g' calls of several requests) and 'K' (coalesced 'c' calls) have
--           their own heads, described at the lean and calendar paths below.
-- ARGV[2]   now in microseconds, or -1 to read the server's clock (TIME).
-- ARGV[3]   -1: expire keys when their state equals a fresh one, on the server's clock (PXAT);
--           m >= 0: that long after now plus m milliseconds (PX), for caller time, which the
--           server's clock cannot follow.
-- ARGV[4]   1: return, for tiered keys, the value before and after (to undo a spend of a
--           denied cross-slot batch with 'restore'); 0: do not.
-- then, per key, a record:
--   lean    (op 'G') increment (emission interval * cost), burst offset, mode; ('g') the
--           same without the mode
--   a shape's  its kind (the table of codes in script.rs), then its fields: each shape's file
--           says them at its `parse` (gcra.lua: 0 GCRA, 2 a partial grant, 4 a charge;
--           tiers.lua 1; concurrency.lua 3; calendar.lua 5; share.lua 6, a region's share
--           bucket; fair_share.lua 7; adaptive.lua 8, and 9 under a capacity its keys share)
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
local OP_CALENDAR, OP_CALENDAR_DEFAULTS, OP_CALENDAR_COALESCED = 'C', 'c', 'K'
local MODE_CHECK_AND_SPEND, MODE_CHECK_ONLY, MODE_SPEND_ONLY = 0, 1, 2

local n = #KEYS
-- 'g' (the lean spend with the defaults) has no op and no head: two arguments per key.
local op, now, margin, want_raw = OP_LEAN_DEFAULTS, -1, -1, false
if #ARGV ~= 2 * n then
  op = ARGV[1]
  if op ~= OP_COALESCED and op ~= OP_CALENDAR_DEFAULTS and op ~= OP_CALENDAR_COALESCED then
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
-- and max only when it is not min; 'c' the same with the defaults ('g''s) and no head. 'K'
-- (coalesced 'c' calls of several requests, each with min = max) has no head: ARGV[2] is the
-- number of requests j, then each one's six fields (count, start, end, next end, horizon,
-- cost), its key KEYS[i]; decided in order, each written before the next is read, as if
-- they had been separate calls.
-- src/algo/calendar.rs `read` and `decide` (the general path's `calendar`, calendar.lua)
-- written out once more, for the reason given at the lean path;
-- tests/redis_keys.rs (`the_scripts_calendar_path_decides_exactly_as_its_general_path`) holds
-- the two writings to each other. It answers now, then per request the units that counted and
-- the end of the period it chose (the caller decides from them with the same rule,
-- `decide_used`: a nested reply cost 4,000 server instructions more); a request whose write
-- failed, coalesced: the error's text in place of both.
if op == OP_CALENDAR or op == OP_CALENDAR_DEFAULTS or op == OP_CALENDAR_COALESCED then
  local a, jobs, out = 5, 1, {now}
  if op == OP_CALENDAR_DEFAULTS then
    a = 2
  elseif op == OP_CALENDAR_COALESCED then
    a, jobs = 3, tonumber(ARGV[2])
  end
  for j = 1, jobs do
    local count, e, min = ARGV[a] + 0, ARGV[a + 2] + 0, ARGV[a + 5] + 0
    local max = min
    if jobs == 1 and ARGV[a + 6] then max = ARGV[a + 6] + 0 end
    if now < ARGV[a + 1] + 0 then
      e = ARGV[a + 1] + 0
    elseif now >= e then
      e = ARGV[a + 3] + 0
    end
    -- The units that count (a stored end past the period in force is cut to it and written
    -- back; a value that is not "<end> <used>", or an end beyond the horizon, is foreign: the
    -- period drained, written back).
    local raw = redis.pcall('GET', KEYS[j])
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
      local up, r = e + 999, nil
      if margin < 0 then
        r = redis.pcall('SET', KEYS[j], string.format('%d %d', e, used), 'PXAT',
          (up - up % 1000) / 1000)
      else
        up = up - now
        r = redis.pcall('SET', KEYS[j], string.format('%d %d', e, used), 'PX',
          (up - up % 1000) / 1000 + margin)
      end
      -- A write refused (out of memory): alone, the call's error; coalesced, this request's
      -- answer is the error text, and the next goes on.
      if r.err then
        if jobs == 1 then return r end
        counted, e = r.err, r.err
      end
    end
    out[2 * j], out[2 * j + 1] = counted, e
    a = a + 6
  end
  return out
end

