-- The script's general path, first part (src/backend/redis/script.rs joins ratelimit.lua, this
-- file and general_decide.lua into the one script Redis runs): what every path shares, the
-- records parsed, the stored values read.

-- Shared by every path ------------------------------------------------------------------------

local OP_SPEND, OP_REFUND, OP_RESTORE = 'spend', 'refund', 'restore'
local OP_SHARE_REQUEST, OP_SHARE_GRANT = 'share_request', 'share_grant'
local KIND_GCRA, KIND_TIERED, KIND_RANGE, KIND_CONCURRENCY, KIND_CHARGE, KIND_CALENDAR = 0, 1, 2, 3, 4, 5
local KIND_SHARE, KIND_FAIR_SHARE, KIND_ADAPTIVE, KIND_ADAPTIVE_POOL = 6, 7, 8, 9
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

-- Keeps `key` (a set or a hash, whatever it holds) until `at`, as expire_args says.
local function expire_at(key, at)
  local how, ms = expire_args(at)
  if how == 'PXAT' then
    redis.call('PEXPIREAT', key, ms)
  else
    redis.call('PEXPIRE', key, ms)
  end
end

-- Keeps key i until its last lease ends.
local function keep_until_last(i)
  expire_at(KEYS[i], tonumber(redis.call('ZRANGE', KEYS[i], -1, -1, 'WITHSCORES')[2]))
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
local shares = false
for i = 1, n do
  local kind = tonumber(ARGV[a])
  if kind == KIND_SHARE then
    -- A region's share bucket (docs/regions.md): a GCRA record whose limit the read below
    -- finds (the floor, and the region's part while its lease runs).
    local sub, cost = tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5])
    rec[i] = {kind = KIND_GCRA, share = true, frate = tonumber(ARGV[a + 1]),
      fburst = tonumber(ARGV[a + 2]), period = tonumber(ARGV[a + 3]), cost = cost,
      mode = tonumber(ARGV[a + 6]), min = cost, charge = sub == KIND_CHARGE,
      since = tonumber(ARGV[a + 7])}
    a = a + 8
    if sub == KIND_RANGE then
      rec[i].min = tonumber(ARGV[a])
      a = a + 1
    end
    if op == OP_SHARE_GRANT then
      -- A grant for the key: its request's number, the part, the lease's end.
      local r = rec[i]
      r.gseq, r.gprate, r.gpburst, r.glease_end = tonumber(ARGV[a]), tonumber(ARGV[a + 1]),
        tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
      a = a + 4
    end
    shares = true
  elseif kind == KIND_GCRA or kind == KIND_RANGE or kind == KIND_CHARGE then
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
  elseif kind == KIND_FAIR_SHARE then
    -- A fair share (fair_share.lua): read and decided in order, its state the limit's.
    rec[i] = {kind = KIND_FAIR_SHARE, mode = tonumber(ARGV[a + 1]), min = tonumber(ARGV[a + 2]),
      cost = tonumber(ARGV[a + 3]), ei = tonumber(ARGV[a + 4]), bo = tonumber(ARGV[a + 5]),
      debt = tonumber(ARGV[a + 6]), burst = tonumber(ARGV[a + 7]),
      weight = tonumber(ARGV[a + 8]), wmin = tonumber(ARGV[a + 9]),
      count = tonumber(ARGV[a + 10]), refresh = tonumber(ARGV[a + 11]), id = ARGV[a + 12],
      newcap = tonumber(ARGV[a + 13])}
    rec[i].charge = rec[i].mode == MODE_CHARGE
    a = a + 14
  elseif kind == KIND_ADAPTIVE or kind == KIND_ADAPTIVE_POOL then
    -- An adaptive concurrency key (adaptive.lua): a concurrency record, its number read from
    -- the key, and a release's completion (latency -1: none); a pool's (its keys share a
    -- capacity) adds the capacity, the key's id and the capacity's headroom.
    rec[i] = {kind = KIND_ADAPTIVE, mode = tonumber(ARGV[a + 1]), cost = tonumber(ARGV[a + 2]),
      lease = tonumber(ARGV[a + 3]), retry = tonumber(ARGV[a + 4]), id = ARGV[a + 5],
      amin = tonumber(ARGV[a + 6]), initial = tonumber(ARGV[a + 7]),
      amax = tonumber(ARGV[a + 8]), algo = tonumber(ARGV[a + 9]), p1 = tonumber(ARGV[a + 10]),
      p2 = tonumber(ARGV[a + 11]), window = tonumber(ARGV[a + 12]),
      wc = tonumber(ARGV[a + 13]), idle = tonumber(ARGV[a + 14]),
      lat = tonumber(ARGV[a + 15]), failed = tonumber(ARGV[a + 16])}
    a = a + 17
    if kind == KIND_ADAPTIVE_POOL then
      rec[i].cap, rec[i].key, rec[i].head = tonumber(ARGV[a]), ARGV[a + 1], tonumber(ARGV[a + 2])
      a = a + 3
    end
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

-- Regions' share buckets (docs/regions.md), defined only for a call that has one (each local
-- function is a closure made on every call that reaches it). A share bucket's key holds
-- "1 <TAT> <interval> <burst> <written at> <part's rate> <part's burst> <grant applied>
-- <lease end> <last request>": the TAT with the limit it was written under and when, and the
-- region's record of the key (src/algo/regions.rs `RegionKey`). Its limit (src/algo/gcra.rs
-- `Limit::share`) is the floor plus the part while the lease runs (region store's clock), the
-- interval rounded up; no rate or no burst is a closed bucket (interval one period, burst 0:
-- every cost denied). When it changes, the bucket keeps its whole tokens, capped at the new
-- burst, never its TAT (src/algo/gcra.rs `keep_tokens`), counted when the change happened: at
-- the lease's end when the lease ended after the write, else now (a grant, a reload). No
-- record is a bucket full under the floor (any part arrives empty), or empty at the store's
-- start while the store has run less than a refill of it. A value that is not such
-- a record is read as no part and the bucket drained, and replaced.
local read_share, write_share, share_change, share_in_force
if shares then
  -- floor(v / d) for any whole v, d > 0.
  local function floor_div(v, d)
    if v >= 0 then return tokens(v, d) end
    return -tokens(d - 1 - v, d)
  end
  -- The limit of a share: interval, burst, burst offset, debt offset.
  local function share_limit(rate, burst, period)
    if rate > period then rate = period end
    if rate <= 0 or burst <= 0 then return period, 0, 0, 0 end
    local ei = tokens(period + rate - 1, rate)
    local most = tokens(3153600000000000, ei)
    if burst > most then burst = most end
    local bo = ei * burst
    return ei, burst, bo, ei * math.min(burst, tokens(3153600000000000 - bo, ei))
  end
  -- Record r's limit in force at now (its floor, and its part while the lease runs).
  share_in_force = function(r)
    local rate, burst = r.frate, r.fburst
    if now < r.lease_end then rate, burst = rate + r.prate, burst + r.pburst end
    r.ei, r.burst, r.bo, r.debt = share_limit(rate, burst, r.period)
  end
  -- The TAT under r's limit in force of a bucket whose TAT was `tat` under interval `wei` and
  -- burst `wburst`, its limit having changed at `at` (at most now).
  share_change = function(r, tat, wei, wburst, at)
    if wei == r.ei and wburst == r.burst then return tat end
    local kept = math.min(floor_div(wei * wburst - math.max(tat - at, 0), wei), r.burst)
    local after = at + r.ei * (r.burst - kept)
    if after <= now then return 0 end
    return after
  end
  read_share = function(i, r)
    local raw = redis.pcall('GET', KEYS[i])
    local f = {}
    if type(raw) == 'string' then
      f = {string.match(raw,
        '^1 (%d+) (%d+) (%d+) (%d+) (%d+) (%d+) (%d+) (%d+) (%d+)$')}
    end
    local ok = #f == 9
    for j = 1, #f do
      f[j] = tonumber(f[j])
      if f[j] >= LIMIT then ok = false end
    end
    -- "1 0 0 0 0 <part and lease>": the record of the key without a bucket (a closed instance
    -- kept its grant): full under the floor, as no record.
    local no_bucket = ok and f[1] == 0 and f[2] == 0 and f[3] == 0 and f[4] == 0
    local foreign = raw and not ok or (ok and f[2] == 0 and not no_bucket)
    if not ok or foreign then f = {0, 0, 0, 0, 0, 0, 0, 0, 0} end
    local tat, wei, wburst, wat = f[1], f[2], f[3], f[4]
    r.prate, r.pburst, r.applied, r.lease_end, r.last = f[5], f[6], f[7], f[8], f[9]
    share_in_force(r)
    if r.burst == 0 then
      -- Closed in this instance (no floor yet, no part): every cost denied, and the bucket
      -- left as the instances that decide it keep it (r.kept; none: nothing or not ours).
      if wei > 0 then r.kept = {tat, wei, wburst, wat} end
      return now, 0
    end
    if foreign then
      -- Not a record of ours: drained, replaced.
      r.fix = true
      return now + r.bo, 0
    end
    if wei == 0 then
      -- Nothing stored: full under the floor, or, in a store that started less than a refill
      -- ago (it may have lost the record), empty at its start (regions/store_start.rs).
      wei, wburst = share_limit(r.frate, r.fburst, r.period)
      tat = 0
      if r.since + wei * wburst > now then tat = r.since + wei * wburst end
    end
    if math.max(tat - now, 0) > 2 * wei * wburst + SLACK then
      r.fix = true
      return now + r.bo, 0
    end
    local at = now
    if r.lease_end > wat and r.lease_end <= now then at = r.lease_end end
    local read = share_change(r, tat, wei, wburst, at)
    if read ~= tat then r.fix = true end
    return read, 0
  end
  -- Writes share bucket i's record with the TAT `tat` under r's limit in force; kept while
  -- its lease runs and for a refill of its whole burst after the write (a full bucket too:
  -- no record reads as full under the reader's floor, which an instance deciding under
  -- another floor, in a rolling deploy, would not have refilled by then). Closed in this
  -- instance, the bucket is written as it was read (r.kept; without one, the record holds no
  -- bucket: full under the floor, as none), so an instance that cannot use the floor yet
  -- never refills nor drains the bucket of one that can (docs/regions.md, "Several instances
  -- in a region").
  write_share = function(i, r, tat)
    local ei, burst, at = r.ei, r.burst, now
    if burst == 0 then
      local k = r.kept or {0, 0, 0, 0}
      tat, ei, burst, at = k[1], k[2], k[3], k[4]
    end
    if tat < now then tat = 0 end
    local until_at = math.max(tat, r.lease_end, at + ei * burst)
    if until_at <= now then
      if ei > 0 or r.lease_end > 0 then redis.call('DEL', KEYS[i]) end
      return
    end
    redis.call('SET', KEYS[i], string.format('1 %d %d %d %d %d %d %d %d %d', tat, ei, burst,
      at, r.prate, r.pburst, r.applied, r.lease_end, r.last), expire_args(until_at))
  end
end

local stored = {}
local raws = {}
local ttls = {}
local kread = {}
for i = 1, n do
  local r = rec[i]
  if r.kind == KIND_FAIR_SHARE or r.kind == KIND_ADAPTIVE then
    stored[i] = 0
  elseif r.share then
    stored[i], kread[i] = read_share(i, r)
  elseif r.kind == KIND_GCRA then
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

-- The lease ids of r.id (a renewal's, separated by spaces) that key i holds.
local function held_leases(i, r)
  local held, ids = {}, {}
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
  return held
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
