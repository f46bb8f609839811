-- The script's general path, second part (after ratelimit.lua and general_read.lua, joined by
-- src/backend/redis/script.rs): burst tiers, concurrency keys, and the decision.

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

if op == OP_SHARE_REQUEST then
  -- The rebalancer's request for a region's shares (src/algo/regions.rs `RegionKey::request`):
  -- per key its number (after the last one, at least the store's now, so a store that lost
  -- the record numbers on from its clock), the grant applied and the part in use (its rate
  -- and burst while its lease runs); then now, when it left.
  for i = 1, n do
    local r = rec[i]
    r.last = math.max(r.last + 1, now)
    write_share(i, rec[i], stored[i])
    local rate, burst = 0, 0
    if now < r.lease_end then rate, burst = r.prate, r.pburst end
    out[i] = {r.last, r.applied, rate, burst}
  end
  out[n + 1] = now
  return out
elseif op == OP_SHARE_GRANT then
  -- A grant applied (src/algo/regions.rs `RegionKey::on_grant`) if it answers a later request
  -- than the applied grant's (a late or repeated one changes nothing): the part and its lease,
  -- the bucket's tokens kept under the new limit from now. Per key 1 when applied.
  for i = 1, n do
    local r = rec[i]
    local applied = 0
    if r.gseq > r.applied then
      local wei, wburst = r.ei, r.burst
      r.applied, r.prate, r.pburst, r.lease_end = r.gseq, r.gprate, r.gpburst, r.glease_end
      share_in_force(r)
      stored[i] = share_change(r, stored[i], wei, wburst, now)
      applied = 1
    end
    if applied == 1 or r.fix then write_share(i, r, stored[i]) end
    out[i] = {applied}
  end
  out[n + 1] = now
  return out
elseif op == OP_SPEND then
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
    elseif r.kind == KIND_FAIR_SHARE then
      out[i], writes[i] = fair_decide(i, r)
      if out[i][1] == 0 and counts(r.mode) then batch_allowed = false end
    elseif r.kind == KIND_ADAPTIVE and r.cap then
      out[i] = pool_decide(i, r)
      if out[i][1] == 0 and counts(r.mode) then batch_allowed = false end
    elseif r.kind == KIND_ADAPTIVE then
      out[i] = adaptive_decide(i, r)
      if out[i][1] == 0 and counts(r.mode) then batch_allowed = false end
    elseif r.kind == KIND_CONCURRENCY and r.mode == MODE_RENEW then
      -- Held: the ids among the live leases (ended ones were removed, foreign ones cut), each
      -- renewed below; the answer counts them.
      local held = {}
      if stored[i] >= 0 then held = held_leases(i, r) end
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
      if r.share and writes[i] then
        write_share(i, r, writes[i])
        r.written = true
        out[i][5] = writes[i]
      elseif r.kind == KIND_GCRA and writes[i] then
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
    if r.kind == KIND_ADAPTIVE and r.cap then
      pool_finish(i, r, batch_allowed and out[i][1] == 1)
    elseif r.kind == KIND_ADAPTIVE then
      adaptive_finish(i, r, batch_allowed and out[i][1] == 1)
    end
    if r.kind == KIND_FAIR_SHARE then
      -- What it saw (the id active, a wait) is written whatever the batch decides.
      local spent = nil
      if batch_allowed then spent = writes[i] end
      fair_finish(i, r, spent)
    end
  end
elseif op == OP_REFUND then
  for i = 1, n do
    local r = rec[i]
    if r.kind == KIND_FAIR_SHARE then
      out[i] = fair_refund(i, r)
    elseif r.kind == KIND_ADAPTIVE and r.cap then
      out[i] = pool_refund(i, r)
    elseif r.kind == KIND_ADAPTIVE then
      out[i] = adaptive_refund(i, r)
    elseif r.kind == KIND_GCRA then
      local s = stored[i]
      local ok, rem, reset, new_tat = gcra_refund(s, r.ei, r.bo, r.burst, r.cost)
      out[i] = {ok, rem, 0, reset, s}
      if new_tat and r.share then
        write_share(i, r, new_tat)
        r.written = true
        out[i][5] = new_tat
      elseif new_tat then
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
-- as; a share bucket whose limit changed, by its tokens kept under the new one.
for i = 1, n do
  local r = rec[i]
  if r.share and r.fix and not r.written then
    write_share(i, r, stored[i])
  elseif r.kind == KIND_GCRA and r.fix and out[i][5] == stored[i] then
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
