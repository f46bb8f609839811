-- Fair shares (docs/fair-share.md): src/algo/fair_share.rs and src/backend/kit/fair_share.rs,
-- function for function (joined after gcra.lua, whose rule it decides by).
--
-- A limit's state is one hash at its own key (`<prefix>{<name>:}:f`, one slot per limit):
--   t, k            the budget's TAT and its writer's bound (a bit length)
--   e               the refresh period the counts below were counted in (numbered from 1)
--   w0 w1 m0 m1 n0 n1  weights, minimums and ids seen in it, and in the period before only
--   h0 h1 h2        the units admitted to ids asking below their share in it, in the period
--                   before and in the one before that (missing: 0)
--   p               the last period an id seen before was refused in (missing: 0)
--   f               the units admitted to, or held for, ids first seen in period e (missing: 0)
--   q               the waiters, "<id>\t<until>\t<cost>\n" each (an id has no control character)
--   c               the sweep's cursor (ended members are deleted 64 fields a call once the
--                   hash holds more than twice the ids a limit counts)
--   x               the latest time a member ends
--   m:<id>          a member: "<tat> <period> <weight> <min> <b0> <b1> <b2> <b period> <since>":
--                   the units it was admitted below its share in <b period> and the two before
--                   (the four may be missing: none), the period it was first counted in since
--                   it was last forgotten (missing: 0, an id seen before)
-- Anything else there (another type, a field that is not one of ours) is foreign: the pool is
-- read as the budget drained and no one counted, and replaced.

local KIND_FAIR_SHARE = 7

SHAPES[KIND_FAIR_SHARE] = function()
  local MAX_WAITERS, MAX_MEMBERS, MAX_MEMBER_TAT = 64, 1024, 4503599627370496
  local FAIR_NUMBERS = {'t', 'k', 'e', 'w0', 'w1', 'm0', 'm1', 'n0', 'n1', 'x', 'h0', 'h1', 'h2',
    'p', 'f'}

  local function fair_number(raw)
    if raw == false or raw == nil then return 0 end
    local v = tonumber(raw)
    if v == nil or v < 0 or v % 1 ~= 0 or v > LIMIT then return nil end
    return v
  end

  -- ceil(x / d) for whole x < 2^53 and d >= 1: the exact floor (general.lua `tokens`),
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

  -- `units_fresh_at`: when units by period, the latest of them in period `at`, are forgotten.
  local function units_fresh_at(b0, b1, b2, at, refresh)
    if b0 > 0 then return (at + 2) * refresh end
    if b1 > 0 then return (at + 1) * refresh end
    if b2 > 0 then return at * refresh end
    return 0
  end

  -- `rolled_units`: units by period rolled from period `at` to `e`.
  local function rolled_units(b0, b1, b2, at, e)
    local d = e - at
    if d <= 0 then return b0, b1, b2 end
    if d == 1 then return 0, b0, b1 end
    if d == 2 then return 0, 0, b0 end
    return 0, 0, 0
  end

  local function no_member()
    return {tat = 0, e = 0, w = 0, m = 0, b0 = 0, b1 = 0, b2 = 0, ba = 0, s = 0}
  end

  local function member_fresh_at(r, m)
    return math.max(m.tat, (m.e + 1) * r.refresh, units_fresh_at(m.b0, m.b1, m.b2, m.ba, r.refresh))
  end

  -- The pool and the member of record r, rolled to now (`Pool::rolled`).
  local function fair_read(i, r)
    local p = {t = 0, k = 0, e = 0, w0 = 0, w1 = 0, m0 = 0, m1 = 0, n0 = 0, n1 = 0, x = 0,
      h0 = 0, h1 = 0, h2 = 0, p = 0, f = 0, c = '0', q = {}}
    local m = no_member()
    local raw = redis.pcall('HMGET', KEYS[i], 't', 'k', 'e', 'w0', 'w1', 'm0', 'm1', 'n0', 'n1',
      'x', 'h0', 'h1', 'h2', 'p', 'f', 'q', 'c', 'm:' .. r.id)
    local foreign = raw.err ~= nil
    if not foreign then
      for j, f in ipairs(FAIR_NUMBERS) do
        local v = fair_number(raw[j])
        if v == nil then foreign = true else p[f] = v end
      end
      if type(raw[16]) == 'string' then
        for id, until_at, cost in string.gmatch(raw[16], '([^\t\n]+)\t(%d+)\t(%d+)\n') do
          p.q[#p.q + 1] = {id = id, u = tonumber(until_at), c = tonumber(cost)}
        end
        if #p.q > MAX_WAITERS then foreign = true end
      end
      -- A bound no limit of the crate writes (52 bits hold 100 years): the budget's own.
      if p.k < 1 or p.k > 52 then p.k = 0 end
      if type(raw[17]) == 'string' then p.c = raw[17] end
      if type(raw[18]) == 'string' then
        local f = {}
        for v in string.gmatch(raw[18], '[^ ]+') do f[#f + 1] = fair_number(v) end
        if #f == 4 then f[5], f[6], f[7], f[8] = 0, 0, 0, 0 end
        if #f == 8 then f[9] = 0 end
        local ok = #f == 9
        for j = 1, #f do ok = ok and f[j] ~= nil end
        if ok then
          m = {tat = f[1], e = f[2], w = f[3], m = f[4], b0 = f[5], b1 = f[6], b2 = f[7], ba = f[8],
            s = f[9]}
        end
      end
    end
    if foreign then
      -- Read as the budget drained, and replaced (r.fix: the hash is deleted first).
      p = {t = now + r.bo, k = bound_length(r), e = 0, w0 = 0, w1 = 0, m0 = 0, m1 = 0, n0 = 0,
        n1 = 0, x = 0, h0 = 0, h1 = 0, h2 = 0, p = 0, f = 0, c = '0', q = {}}
      m = no_member()
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
      p.h0, p.h1, p.h2 = rolled_units(p.h0, p.h1, p.h2, p.e, e)
      p.w0, p.m0, p.n0, p.f, p.e = 0, 0, 0, 0, e
    end
    local live = {}
    for _, w in ipairs(p.q) do
      if w.u >= now then live[#live + 1] = w end
    end
    p.q = live
    if member_fresh_at(r, m) <= now then m = no_member() end
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
    if m.e == 0 then m.s = p.e end
    m.e, m.w, m.m = p.e, r.weight, r.wmin
  end

  -- `Member::newcomer`: not kept before this period, or first counted in it.
  local function fair_newcomer(p, m)
    return m.e == 0 or m.s == p.e
  end

  -- `Pool::gates_newcomers`: an id seen before refused in this period or the one before, and the
  -- new ids' part of this one taken.
  local function fair_gates(r, p)
    return p.p ~= 0 and p.p + 1 >= p.e and p.f >= r.newcap
  end

  -- `Pool::share_of`: weight over the weights of the ids seen in this period, or the minimum over
  -- the larger of the count and their minimums, whichever is larger (every product below 2^52).
  local function fair_share_of(r, p)
    local num, den = r.weight, math.max(p.w0, r.weight)
    if r.wmin > 0 then
      local mden = math.max(r.count, p.m0)
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

  -- `member_owed`: its own bucket at most a burst, or the request at its share, ahead.
  local function fair_owed(r, num, den, tat, cost)
    local most = math.max(share_interval(r, num, den) * cost, r.bo)
    if tat - now > most then return now + most end
    return tat
  end

  -- `below_share`.
  local function fair_below(r, tat)
    return math.max(tat - now, 0) * 2 <= r.bo
  end

  -- `Pool::hold`: units admitted to member m below its share counted, or given back.
  local function fair_hold(p, m, below, units, back)
    m.b0, m.b1, m.b2 = rolled_units(m.b0, m.b1, m.b2, m.ba, p.e)
    m.ba = p.e
    if not below then return end
    if back then
      units = math.min(units, m.b0)
      m.b0 = m.b0 - units
      p.h0 = math.max(p.h0 - units, 0)
    else
      m.b0 = m.b0 + units
      p.h0 = p.h0 + units
    end
  end

  -- `Pool::hold_refused`: at least `units` held for a member refused below its share.
  local function fair_hold_refused(p, m, units)
    m.b0, m.b1, m.b2 = rolled_units(m.b0, m.b1, m.b2, m.ba, p.e)
    m.ba = p.e
    local more = math.max(units - m.b0, 0)
    m.b0 = m.b0 + more
    p.h0 = p.h0 + more
    return more
  end

  -- `Pool::reserve_for`.
  local function fair_reserve(r, p, m, below, over)
    if below then return 0 end
    local o0, o1, o2 = rolled_units(m.b0, m.b1, m.b2, m.ba, p.e)
    local held = math.max(p.h0 - o0, p.h1 - o1, p.h2 - o2, 0)
    local waiting = 0
    if over then
      for _, w in ipairs(p.q) do
        if w.id ~= r.id then waiting = waiting + w.c end
      end
    end
    return math.min(held + waiting, math.max(r.burst - r.min, 0))
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
    if p.h0 > 0 then fresh = math.max(fresh, (p.e + 2) * r.refresh) end
    for _, w in ipairs(p.q) do
      q[#q + 1] = string.format('%s\t%d\t%d\n', w.id, w.u, w.c)
      fresh = math.max(fresh, w.u + 1)
    end
    local mkey = 'm:' .. r.id
    if counted and member_fresh_at(r, m) > now then
      redis.call('HSET', KEYS[i], mkey, string.format('%d %d %d %d %d %d %d %d %d', m.tat, m.e,
        m.w, m.m, m.b0, m.b1, m.b2, m.ba, m.s))
      p.x = math.max(p.x, member_fresh_at(r, m))
    else
      redis.call('HDEL', KEYS[i], mkey)
    end
    -- Ended members are swept only once the hash holds twice the ids a limit counts (as memory
    -- does): an HSCAN a call cost 1,060,000 server instructions at 1,000 ids.
    if redis.call('HLEN', KEYS[i]) > 2 * MAX_MEMBERS + 16 then
      local scan = redis.call('HSCAN', KEYS[i], p.c, 'MATCH', 'm:*', 'COUNT', 64)
      for j = 1, #scan[2], 2 do
        local a, b, b0, b1, b2, ba =
          string.match(scan[2][j + 1], '^(%d+) (%d+) %d+ %d+ ?(%d*) ?(%d*) ?(%d*) ?(%d*)')
        local tat, e = tonumber(a), tonumber(b)
        local fresh = 0
        if tat ~= nil then
          fresh = math.max(tat, (e + 1) * r.refresh, units_fresh_at(tonumber(b0) or 0,
            tonumber(b1) or 0, tonumber(b2) or 0, tonumber(ba) or 0, r.refresh))
        end
        if tat == nil or fresh <= now then
          redis.call('HDEL', KEYS[i], scan[2][j])
        end
      end
      p.c = scan[1]
    end
    redis.call('HSET', KEYS[i], 't', p.t, 'k', p.k, 'e', p.e, 'w0', p.w0, 'w1', p.w1, 'm0', p.m0,
      'm1', p.m1, 'n0', p.n0, 'n1', p.n1, 'x', p.x, 'h0', p.h0, 'h1', p.h1, 'h2', p.h2, 'p', p.p,
      'f', p.f, 'q', table.concat(q), 'c', p.c)
    expire_at(KEYS[i], math.max(fresh, p.x))
  end

  -- A fair-share record's decision (`fair_share_decide`): its reply, and what to write when the
  -- batch is allowed (`spent`); what it saw is written whatever the batch decides, when it spends
  -- (a check makes no id active) or replaced a foreign budget.
  local function fair_decide(i, r)
    local p, m = fair_read(i, r)
    -- A new id past the new ids' part while an id seen before is refused: refused, not counted.
    local newcomer = fair_newcomer(p, m)
    local gated = newcomer and not r.charge and fair_gates(r, p)
    local counted = m.e > 0 or m.tat > 0 or (not gated and p.n0 + p.n1 < MAX_MEMBERS)
    local active = spends(r.mode) and not gated
    if counted and active then fair_count(r, p, m) end
    local num, den = fair_share_of(r, p)
    m.tat = fair_owed(r, num, den, m.tat, r.min)
    local under = counted and not gated and fair_under(r, num, den, m.tat, r.min)
    local below = under and fair_below(r, m.tat)
    local reserve = 0
    if not r.charge then reserve = fair_reserve(r, p, m, below, not under) end
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
    if gated then
      ok, rem, granted = 0, 0, 0
      retry, reset = math.max(p.e * r.refresh - now, 1), math.max(p.t - now, 0)
    end
    if ok == 0 and not newcomer and active and counts(r.mode) then p.p = p.e end
    if ok == 0 and under and active and counts(r.mode) then
      if below then
        local more = fair_hold_refused(p, m, r.min)
        if newcomer then p.f = p.f + more end
      else
        fair_wait(r, p, now + math.max(retry, r.refresh), r.min)
      end
    end
    local out = {ok, rem, retry, reset, 0}
    if r.charge or r.min < r.cost then out[6] = granted end
    local spent = nil
    if ok == 1 and active and new_tat and gcra_writes(r.mode, new_tat, p.t) then
      spent = {t = new_tat - shift, k = bound_length(r)}
      local units = r.cost
      if r.charge or r.min < r.cost then units = granted end
      spent.tat = math.min(math.max(m.tat, now) + share_interval(r, num, den) * units,
        MAX_MEMBER_TAT)
      spent.units, spent.below, spent.new = units, below, newcomer
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
      fair_hold(p, m, spent.below, spent.units, false)
      if spent.new then p.f = p.f + spent.units end
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
      -- Below its share once refunded: the units held for it given back too.
      fair_hold(p, m, fair_under(r, num, den, tat, r.min) and fair_below(r, tat), r.cost, true)
      if fair_newcomer(p, m) then p.f = math.max(p.f - r.cost, 0) end
    end
    fair_write(i, r, p, m, m.e > 0 or m.tat > 0)
    return {ok, rem, 0, reset, 0}
  end

  -- The record: 7, mode, min, cost, the budget's emission interval, burst offset, debt offset
  -- and burst, the id's weight and minimum, the ids a limit counts, the refresh period, the
  -- id, the new ids' part. Read and decided in order (fair_decide reads the pool), its state
  -- the limit's.
  local function parse(a)
    local r = {mode = tonumber(ARGV[a + 1]), min = tonumber(ARGV[a + 2]),
      cost = tonumber(ARGV[a + 3]), ei = tonumber(ARGV[a + 4]), bo = tonumber(ARGV[a + 5]),
      debt = tonumber(ARGV[a + 6]), burst = tonumber(ARGV[a + 7]),
      weight = tonumber(ARGV[a + 8]), wmin = tonumber(ARGV[a + 9]),
      count = tonumber(ARGV[a + 10]), refresh = tonumber(ARGV[a + 11]), id = ARGV[a + 12],
      newcap = tonumber(ARGV[a + 13])}
    r.charge = r.mode == MODE_CHARGE
    return r, a + 14
  end
  local function read()
    return 0
  end
  -- What it saw (the id active, a wait) is written whatever the batch decides.
  local function finish(i, r, s, o, allowed, w)
    local spent = nil
    if allowed then spent = w end
    fair_finish(i, r, spent)
  end
  return {parse = parse, read = read, decide = fair_decide, finish = finish,
    refund = fair_refund}
end
