-- Burst tiers (src/algo/tiers.rs, docs/burst-tiers.md; joined after general.lua): a key holds
-- one MessagePack array, {1, base, n, then per tier: entry - base (-1: none), grant count k,
-- then k pairs (time - base, units)}.

local KIND_TIERED = 1

SHAPES[KIND_TIERED] = function()
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
    local rem = r.L[last] - used(r, s, last, now, phase(r, last, s.entry[last], now))
      - p.units[last]
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

  -- The values before and after a spend, and the milliseconds the one before had to live,
  -- added to the reply when the call asks (ARGV[4]: to undo a spend of a denied batch across
  -- slots with 'restore').
  local function add_raw(r, o, before, after)
    if want_raw then
      o[#o + 1] = before
      o[#o + 1] = after
      o[#o + 1] = r.ttl or -1
    end
  end

  -- The record: 1, mode, min, max, tier count n, then per tier: limit, window, active,
  -- cooldown.
  local function parse(a)
    local r = {mode = tonumber(ARGV[a + 1]), min = tonumber(ARGV[a + 2]),
      max = tonumber(ARGV[a + 3]), n = tonumber(ARGV[a + 4]), L = {}, W = {}, A = {}, C = {}}
    a = a + 5
    for j = 1, r.n do
      r.L[j], r.W[j], r.A[j], r.C[j] = tonumber(ARGV[a]), tonumber(ARGV[a + 1]),
        tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
      a = a + 4
    end
    return r, a
  end
  -- A value that is not a tier state of ours (another type, not ours, a time more than SLACK
  -- ahead) is foreign: read as the state drained under r (src/algo/tiers.rs `drained`: what a
  -- fresh key holds once a request of the whole capacity was granted), which replaces it
  -- (r.fix). Undoing a spend puts back what was there (r.raw; '' deletes the key).
  local function read(i, r)
    local raw = redis.pcall('GET', KEYS[i])
    local s = type(raw) == 'string' and decode_tiers(raw, r) or nil
    if s then
      r.raw = raw
      return s
    end
    s = {entry = {}, lt = {}, lc = {}}
    for j = 1, r.n do s.lt[j], s.lc[j] = {}, {} end
    r.raw = type(raw) == 'string' and raw or ''
    r.fix = raw ~= false
    if r.fix then
      local cap = 0
      for j = 1, r.n do cap = cap + r.L[j] end
      local p = plan(r, s, now, cap, cap)
      if p.allowed then apply(r, s, p) end
    end
    return s
  end
  local function decide(i, r, s)
    local o, p = decide_tiers(r, s)
    if o[1] == 1 then return o, p end
    return o
  end
  local function finish(i, r, s, o, allowed, p)
    local after = r.raw
    if allowed and p and spends(r.mode) then
      if want_raw then r.ttl = redis.call('PTTL', KEYS[i]) end
      apply(r, s, p)
      after = write_tiers(KEYS[i], r, s)
    end
    add_raw(r, o, r.raw, after)
  end
  -- A refund takes back up to max units, the latest grants first.
  local function refund(i, r, s)
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
    return tier_reply(r, refunded > 0 and 1 or 0, rem, 0, reset, refunded, cur, 0, taken)
  end
  -- A foreign value written as read (drained) when the call wrote nothing over it.
  local function settle(i, r, s, o)
    if r.fix and not r.written then write_tiers(KEYS[i], r, s) end
  end
  return {parse = parse, read = read, decide = decide, finish = finish, refund = refund,
    settle = settle}
end
