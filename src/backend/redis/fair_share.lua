-- Fair shares (docs/fair-share.md): src/algo/fair_share.rs and src/backend/kit/fair_share.rs,
-- function for function. (src/backend/redis/script.rs joins this file between the general
-- path's two.)
--
-- A limit's state is one hash at its own key (`<prefix>{<name>:}:f`, one slot per limit):
--   t, k            the budget's TAT and its writer's bound (a bit length)
--   e               the refresh period the counts below were counted in (numbered from 1)
--   w0 w1 m0 m1 n0 n1  weights, minimums and ids seen in it, and in the period before only
--   q               the waiters, "<id>\t<until>\t<cost>\n" each (an id has no control character)
--   c               the sweep's cursor (ended members are deleted 64 fields a call once the
--                   hash holds more than twice the ids a limit counts)
--   x               the latest time a member ends
--   m:<id>          a member: "<tat> <period> <weight> <min>"
-- Anything else there (another type, a field that is not one of ours) is foreign: the pool is
-- read as the budget drained and no one counted, and replaced.

local MAX_WAITERS, MAX_MEMBERS, MAX_MEMBER_TAT = 64, 1024, 4503599627370496
local FAIR_NUMBERS = {'t', 'k', 'e', 'w0', 'w1', 'm0', 'm1', 'n0', 'n1', 'x'}

local function fair_number(raw)
  if raw == false or raw == nil then return 0 end
  local v = tonumber(raw)
  if v == nil or v < 0 or v % 1 ~= 0 or v > LIMIT then return nil end
  return v
end

-- ceil(x / d) for whole x < 2^53 and d >= 1: the exact floor (general_read.lua `tokens`),
-- one more when d does not divide x.
local function ceil_div(x, d)
  local q = tokens(x, d)
  if q * d < x then q = q + 1 end
  return q
end

-- The emission interval of an id's own bucket at share num/den: rounded up, at most 2^52.
local function share_interval(r, num, den)
  local x = r.ei * den
  if x >= MAX_MEMBER_TAT then return MAX_MEMBER_TAT end
  local v = ceil_div(x, math.max(num, 1))
  if v > MAX_MEMBER_TAT then v = MAX_MEMBER_TAT end
  return v
end

local function member_fresh_at(r, m)
  return math.max(m.tat, (m.e + 1) * r.refresh)
end

-- The pool and the member of record r, rolled to now (`Pool::rolled`).
local function fair_read(i, r)
  local p = {t = 0, k = 0, e = 0, w0 = 0, w1 = 0, m0 = 0, m1 = 0, n0 = 0, n1 = 0, x = 0,
    c = '0', q = {}}
  local m = {tat = 0, e = 0, w = 0, m = 0}
  local raw = redis.pcall('HMGET', KEYS[i], 't', 'k', 'e', 'w0', 'w1', 'm0', 'm1', 'n0', 'n1', 'x',
    'q', 'c', 'm:' .. r.id)
  local foreign = raw.err ~= nil
  if not foreign then
    for j, f in ipairs(FAIR_NUMBERS) do
      local v = fair_number(raw[j])
      if v == nil then foreign = true else p[f] = v end
    end
    if type(raw[11]) == 'string' then
      for id, until_at, cost in string.gmatch(raw[11], '([^\t\n]+)\t(%d+)\t(%d+)\n') do
        p.q[#p.q + 1] = {id = id, u = tonumber(until_at), c = tonumber(cost)}
      end
      if #p.q > MAX_WAITERS then foreign = true end
    end
    -- A bound no limit of the crate writes (52 bits hold 100 years): the budget's own.
    if p.k < 1 or p.k > 52 then p.k = 0 end
    if type(raw[12]) == 'string' then p.c = raw[12] end
    if type(raw[13]) == 'string' then
      local a, b, c, d = string.match(raw[13], '^(%d+) (%d+) (%d+) (%d+)$')
      a, b, c, d = fair_number(a), fair_number(b), fair_number(c), fair_number(d)
      if a and b and c and d then m = {tat = a, e = b, w = c, m = d} end
    end
  end
  if foreign then
    -- Read as the budget drained, and replaced (r.fix: the hash is deleted first).
    p = {t = now + r.bo, k = bound_length(r), e = 0, w0 = 0, w1 = 0, m0 = 0, m1 = 0, n0 = 0,
      n1 = 0, x = 0, c = '0', q = {}}
    m = {tat = 0, e = 0, w = 0, m = 0}
    r.fix, r.repaired = true, true
  elseif p.t - now > r.bo + r.debt + SLACK and p.t - now > 2 ^ p.k + SLACK then
    -- A TAT further ahead than the crate writes: the budget drained, and replaced.
    p.t, p.k, r.repaired = now + r.bo, bound_length(r), true
  end
  -- Rolled to the period holding now; a clock behind counts in the stored one.
  local e = tokens(now, r.refresh) + 1
  if e > p.e then
    if e == p.e + 1 then
      p.w1, p.m1, p.n1 = p.w0, p.m0, p.n0
    else
      p.w1, p.m1, p.n1 = 0, 0, 0
    end
    p.w0, p.m0, p.n0, p.e = 0, 0, 0, e
  end
  local live = {}
  for _, w in ipairs(p.q) do
    if w.u >= now then live[#live + 1] = w end
  end
  p.q = live
  if member_fresh_at(r, m) <= now then m = {tat = 0, e = 0, w = 0, m = 0} end
  return p, m
end

-- `Pool::count`: the member counted once per period with its weight and minimum.
local function fair_count(r, p, m)
  if m.e == p.e then
    p.w0 = math.max(p.w0 - m.w, 0)
    p.m0 = math.max(p.m0 - m.m, 0)
  else
    if m.e + 1 == p.e then
      p.w1 = math.max(p.w1 - m.w, 0)
      p.m1 = math.max(p.m1 - m.m, 0)
      p.n1 = math.max(p.n1 - 1, 0)
    end
    p.n0 = p.n0 + 1
  end
  p.w0 = p.w0 + r.weight
  p.m0 = p.m0 + r.wmin
  m.e, m.w, m.m = p.e, r.weight, r.wmin
end

-- `Pool::share_of`: weight over the active weights, or the minimum over the larger of the
-- count and the active minimums, whichever is larger (every product below 2^52).
local function fair_share_of(r, p)
  local num, den = r.weight, math.max(p.w0 + p.w1, r.weight)
  if r.wmin > 0 then
    local mden = math.max(r.count, p.m0 + p.m1)
    if r.wmin * den > num * mden then num, den = r.wmin, mden end
  end
  return num, den
end

-- `under_share`.
local function fair_under(r, num, den, tat, cost)
  local need = share_interval(r, num, den) * cost
  local ahead = math.max(tat - now, 0)
  if need >= r.bo then return ahead == 0 end
  return ahead + need <= r.bo
end

local function fair_reserve(r, p)
  local sum = 0
  for _, w in ipairs(p.q) do
    if w.id ~= r.id then sum = sum + w.c end
  end
  return math.min(sum, r.burst)
end

local function fair_wait(r, p, until_at, cost)
  local kept = {}
  for _, w in ipairs(p.q) do
    if w.id ~= r.id then kept[#kept + 1] = w end
  end
  if #kept < MAX_WAITERS then kept[#kept + 1] = {id = r.id, u = until_at, c = cost} end
  p.q = kept
end

local function fair_served(r, p)
  local kept = {}
  for _, w in ipairs(p.q) do
    if w.id ~= r.id then kept[#kept + 1] = w end
  end
  p.q = kept
end

-- Writes the pool and the member (kept when counted and not yet fresh), sweeps a few ended
-- members, and keeps the hash until the last of it ends.
local function fair_write(i, r, p, m, counted)
  if r.fix then redis.call('DEL', KEYS[i]) end
  local q = {}
  local fresh = math.max(p.t, (p.e + 1) * r.refresh)
  for _, w in ipairs(p.q) do
    q[#q + 1] = string.format('%s\t%d\t%d\n', w.id, w.u, w.c)
    fresh = math.max(fresh, w.u + 1)
  end
  local mkey = 'm:' .. r.id
  if counted and member_fresh_at(r, m) > now then
    redis.call('HSET', KEYS[i], mkey, string.format('%d %d %d %d', m.tat, m.e, m.w, m.m))
    p.x = math.max(p.x, member_fresh_at(r, m))
  else
    redis.call('HDEL', KEYS[i], mkey)
  end
  -- Ended members are swept only once the hash holds twice the ids a limit counts (as memory
  -- does): an HSCAN a call cost 1,060,000 server instructions at 1,000 ids.
  if redis.call('HLEN', KEYS[i]) > 2 * MAX_MEMBERS + 16 then
    local scan = redis.call('HSCAN', KEYS[i], p.c, 'MATCH', 'm:*', 'COUNT', 64)
    for j = 1, #scan[2], 2 do
      local a, b = string.match(scan[2][j + 1], '^(%d+) (%d+)')
      local tat, e = tonumber(a), tonumber(b)
      if tat == nil or math.max(tat, (e + 1) * r.refresh) <= now then
        redis.call('HDEL', KEYS[i], scan[2][j])
      end
    end
    p.c = scan[1]
  end
  redis.call('HSET', KEYS[i], 't', p.t, 'k', p.k, 'e', p.e, 'w0', p.w0, 'w1', p.w1, 'm0', p.m0,
    'm1', p.m1, 'n0', p.n0, 'n1', p.n1, 'x', p.x, 'q', table.concat(q), 'c', p.c)
  expire_at(KEYS[i], math.max(fresh, p.x))
end

-- A fair-share record's decision (`fair_share_decide`): its reply, and what to write when the
-- batch is allowed (`spent`); what it saw is written whatever the batch decides, when it spends
-- (a check makes no id active) or replaced a foreign budget.
local function fair_decide(i, r)
  local p, m = fair_read(i, r)
  local counted = m.e > 0 or m.tat > 0 or p.n0 + p.n1 < MAX_MEMBERS
  local active = spends(r.mode)
  if counted and active then fair_count(r, p, m) end
  local num, den = fair_share_of(r, p)
  local under = counted and fair_under(r, num, den, m.tat, r.min)
  local reserve = 0
  if not under and not r.charge then reserve = fair_reserve(r, p) end
  local cost, min = r.cost + reserve, r.min + reserve
  local ok, rem, retry, reset, new_tat, granted
  if r.charge then
    ok, rem, retry, reset, new_tat, granted = gcra_charge(p.t, r.ei, r.bo, r.debt, cost)
  else
    local k = cost
    if min < cost then k = gcra_grant(p.t, r.ei, r.bo, min, cost) end
    ok, rem, retry, reset, new_tat = gcra(p.t, r.ei, r.bo, k)
    granted = ok * k
  end
  local shift = r.ei * reserve
  granted = math.max(granted - reserve, 0)
  if ok == 1 then
    reset = math.max(reset - shift, 0)
  else
    rem = math.max(rem - reserve, 0)
  end
  if ok == 0 and under and active and counts(r.mode) then
    fair_wait(r, p, now + math.max(retry, r.refresh), r.min)
  end
  local out = {ok, rem, retry, reset, 0}
  if r.charge or r.min < r.cost then out[6] = granted end
  local spent = nil
  if ok == 1 and new_tat and gcra_writes(r.mode, new_tat, p.t) then
    spent = {t = new_tat - shift, k = bound_length(r)}
    local units = r.cost
    if r.charge or r.min < r.cost then units = granted end
    spent.tat = math.min(math.max(m.tat, now) + share_interval(r, num, den) * units,
      MAX_MEMBER_TAT)
  end
  r.pool, r.member, r.counted, r.active, r.under = p, m, counted, active, under
  return out, spent
end

-- Writes what record r's decision leaves: `spent` when its batch was allowed and it spent,
-- else what it saw.
local function fair_finish(i, r, spent)
  local p, m = r.pool, r.member
  if spent then
    p.t, p.k = spent.t, spent.k
    if not r.under then fair_served(r, p) end
    m.tat = spent.tat
  elseif not r.active and not r.repaired then
    return
  end
  fair_write(i, r, p, m, r.counted)
end

-- A refund (`fair_share_refund`): the budget given back, the id's own bucket moved back.
local function fair_refund(i, r)
  local p, m = fair_read(i, r)
  local ok, rem, reset, new_tat = gcra_refund(p.t, r.ei, r.bo, r.burst, r.cost)
  if new_tat then p.t, p.k = new_tat, math.max(bound_length(r), p.k) end
  local num, den = fair_share_of(r, p)
  if m.e > 0 or m.tat > 0 then
    local tat = m.tat - share_interval(r, num, den) * r.cost
    if tat <= now then tat = 0 end
    m.tat = tat
  end
  fair_write(i, r, p, m, m.e > 0 or m.tat > 0)
  return {ok, rem, 0, reset, 0}
end
