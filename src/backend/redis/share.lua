-- A region's share buckets (docs/regions.md; joined after gcra.lua): GCRA records whose limit
-- the read finds, and the rebalancer's two ops on them.
--
-- Made only for a call that names one (general.lua `shape`). A share bucket's key holds
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

local OP_SHARE_REQUEST, OP_SHARE_GRANT = 'share_request', 'share_grant'
local KIND_SHARE = 6
SHAPE_OPS[OP_SHARE_REQUEST], SHAPE_OPS[OP_SHARE_GRANT] = true, true

SHAPES[KIND_SHARE] = function()
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
  local function share_in_force(r)
    local rate, burst = r.frate, r.fburst
    if now < r.lease_end then rate, burst = rate + r.prate, burst + r.pburst end
    r.ei, r.burst, r.bo, r.debt = share_limit(rate, burst, r.period)
  end
  -- The TAT under r's limit in force of a bucket whose TAT was `tat` under interval `wei` and
  -- burst `wburst`, its limit having changed at `at` (at most now).
  local function share_change(r, tat, wei, wburst, at)
    if wei == r.ei and wburst == r.burst then return tat end
    local kept = math.min(floor_div(wei * wburst - math.max(tat - at, 0), wei), r.burst)
    local after = at + r.ei * (r.burst - kept)
    if after <= now then return 0 end
    return after
  end
  local function read_share(i, r)
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
  local function write_share(i, r, tat)
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
  -- The record: 6, the floor's rate and burst, the period, the GCRA kind (0, 2 or 4), cost,
  -- mode, when the store started (0: unknown), then a range's least units; for a grant, the
  -- grant (its request's number, the part, the lease's end).
  local function parse(a)
    local sub, cost = tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5])
    local r = {share = true, frate = tonumber(ARGV[a + 1]),
      fburst = tonumber(ARGV[a + 2]), period = tonumber(ARGV[a + 3]), cost = cost,
      mode = tonumber(ARGV[a + 6]), min = cost, charge = sub == KIND_CHARGE,
      since = tonumber(ARGV[a + 7])}
    a = a + 8
    if sub == KIND_RANGE then
      r.min = tonumber(ARGV[a])
      a = a + 1
    end
    if op == OP_SHARE_GRANT then
      r.gseq, r.gprate, r.gpburst, r.glease_end = tonumber(ARGV[a]), tonumber(ARGV[a + 1]),
        tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
      a = a + 4
    end
    return r, a
  end
  local function read(i, r)
    return (read_share(i, r))
  end
  local function finish(i, r, s, o, allowed, w)
    if allowed and w then
      write_share(i, r, w)
      r.written = true
      o[5] = w
    end
  end
  local function refund(i, r, s)
    local o, new_tat = gcra_refund_reply(r, s)
    if new_tat then
      write_share(i, r, new_tat)
      r.written = true
      o[5] = new_tat
    end
    return o
  end
  -- A foreign value, or a bucket whose limit changed, written as read when the call wrote
  -- nothing over it.
  local function settle(i, r, s, o)
    if r.fix and not r.written then write_share(i, r, s) end
    gcra_final(o)
  end
  -- The rebalancer's request for a region's shares (src/algo/regions.rs `RegionKey::request`):
  -- the key's number (after the last one, at least the store's now, so a store that lost the
  -- record numbers on from its clock), the grant applied and the part in use (its rate and
  -- burst while its lease runs).
  local function request(i, r, s)
    r.last = math.max(r.last + 1, now)
    write_share(i, r, s)
    local rate, burst = 0, 0
    if now < r.lease_end then rate, burst = r.prate, r.pburst end
    return {r.last, r.applied, rate, burst}
  end
  -- A grant applied (src/algo/regions.rs `RegionKey::on_grant`) if it answers a later request
  -- than the applied grant's (a late or repeated one changes nothing): the part and its lease,
  -- the bucket's tokens kept under the new limit from now. 1 when applied.
  local function grant(i, r, s)
    local applied = 0
    if r.gseq > r.applied then
      local wei, wburst = r.ei, r.burst
      r.applied, r.prate, r.pburst, r.lease_end = r.gseq, r.gprate, r.gpburst, r.glease_end
      share_in_force(r)
      s = share_change(r, s, wei, wburst, now)
      applied = 1
    end
    if applied == 1 or r.fix then write_share(i, r, s) end
    return {applied}
  end
  return {parse = parse, read = read, decide = gcra_decide, finish = finish, refund = refund,
    settle = settle, [OP_SHARE_REQUEST] = request, [OP_SHARE_GRANT] = grant}
end
