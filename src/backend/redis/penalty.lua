-- Penalty ladders (src/algo/penalty.rs, docs/penalties.md), function for function: a key's
-- ladder state decided on the server in the call that decides its request (joined after
-- general.lua: a penalty's companion record, KIND_PENALTY below; src/backend/redis/tests.rs
-- also runs the rule beside the Rust one).
--
-- A ladder l: {after, within, base, factor, max, forget, jitter} (microseconds, jitter in
-- thousandths). A state s: {level, since, until, et, eu (the window's counted units: times,
-- oldest first, and units), rid, rat, ru (the requests in flight: lease ids, as decimal text,
-- admission times and units reserved)}. Stored as one MessagePack array (P.encode). Every
-- number is a whole number below 2^53, so the doubles hold them exactly; a lease id is text.

local function penalty_rule()
  local P = {}
  local PRIME = 2147483647

  -- floor(a / b) for whole a >= 0, b > 0, corrected for the rounding of the division.
  local function div(a, b)
    local q = math.floor(a / b)
    if q * b > a then
      q = q - 1
    elseif (q + 1) * b <= a then
      q = q + 1
    end
    return q
  end

  function P.ban(l, level)
    local ban = l.base
    for _ = 2, level do
      if ban >= l.max or l.factor == 1 then break end
      ban = ban * l.factor
    end
    if ban > l.max then ban = l.max end
    return ban
  end

  function P.decayed(l, level, since, t)
    if level == 0 or t <= since then return level, since end
    local down = div(t - since, l.forget)
    if down > level then down = level end
    return level - down, since + down * l.forget
  end

  function P.jitter(keytext, level, start, ban, permille)
    local span = div(ban, 1000) * permille + div((ban - div(ban, 1000) * 1000) * permille, 1000)
    if span == 0 then return 0 end
    local h = 7
    local function mix(b) h = (h * 131 + b) % PRIME end
    for i = 1, #keytext do mix(string.byte(keytext, i)) end
    mix(level % PRIME)
    local digits = string.format('%.0f', start)
    for i = 1, #digits do mix(string.byte(digits, i)) end
    return h % (span + 1)
  end

  function P.fresh()
    return {level = 0, since = 0, ['until'] = 0, et = {}, eu = {}, rid = {}, rat = {}, ru = {}}
  end

  local function free(l, s, t)
    if t < s['until'] then return false end
    s.level, s.since = P.decayed(l, s.level, s.since, t)
    return true
  end

  local function drop_old(l, s, t)
    local start = t - l.within
    if start < 0 then return end
    local et, eu = {}, {}
    for j = 1, #s.et do
      if s.et[j] > start then et[#et + 1], eu[#eu + 1] = s.et[j], s.eu[j] end
    end
    s.et, s.eu = et, eu
    local rid, rat, ru = {}, {}, {}
    for j = 1, #s.rid do
      if s.rat[j] > start then
        rid[#rid + 1], rat[#rat + 1], ru[#ru + 1] = s.rid[j], s.rat[j], s.ru[j]
      end
    end
    s.rid, s.rat, s.ru = rid, rat, ru
  end

  -- Adds u units counted at t, in time order (merged with units of the same time).
  local function add(s, t, u)
    local j = #s.et
    while j >= 1 and s.et[j] > t do j = j - 1 end
    if j >= 1 and s.et[j] == t then
      s.eu[j] = s.eu[j] + u
      return
    end
    table.insert(s.et, j + 1, t)
    table.insert(s.eu, j + 1, u)
  end

  local function units(s)
    local u = 0
    for j = 1, #s.eu do u = u + s.eu[j] end
    return u
  end
  P.units = units
  P.drop_old = drop_old

  -- Tally replies: {3, units} counted, {4, until, level} banned, {5} ignored.
  local function tally(l, s, keytext, t)
    local total = units(s)
    if total < l.after then return {3, total} end
    s.level = s.level + 1
    local ban = P.ban(l, s.level)
    ban = ban + P.jitter(keytext, s.level, t, ban, l.jitter)
    if ban > l.max then ban = l.max end
    s['until'] = t + ban
    s.since = s['until']
    s.et, s.eu, s.rid, s.rat, s.ru = {}, {}, {}, {}, {}
    return {4, s['until'], s.level}
  end

  -- When the window holding `held` units has room again: its oldest units gone.
  local function room_at(l, s, held)
    local all = {}
    for j = 1, #s.et do all[#all + 1] = {s.et[j], s.eu[j]} end
    for j = 1, #s.rat do all[#all + 1] = {s.rat[j], s.ru[j]} end
    table.sort(all, function(x, y)
      if x[1] ~= y[1] then return x[1] < y[1] end
      return x[2] < y[2]
    end)
    for _, e in ipairs(all) do
      held = held - e[2]
      if held < l.after then return e[1] + l.within end
    end
    return 0
  end

  -- Admission of the request `id` (a lease id's decimal text) reserving up to `reserve`:
  -- {0} admitted, {1, until, level} banned, {2, until} full.
  function P.admit(l, s, id, reserve, t)
    if not free(l, s, t) then return {1, s['until'], s.level} end
    drop_old(l, s, t)
    local held = units(s)
    for j = 1, #s.ru do held = held + s.ru[j] end
    if held >= l.after then return {2, room_at(l, s, held)} end
    if reserve > l.after then reserve = l.after end
    if reserve > 0 then
      local j = #s.rid + 1
      s.rid[j], s.rat[j], s.ru[j] = id, t, reserve
    end
    return {0}
  end

  function P.settle(l, s, keytext, id, counted, t)
    local banned = not free(l, s, t)
    drop_old(l, s, t)
    local j = 1
    while j <= #s.rid and s.rid[j] ~= id do j = j + 1 end
    if j > #s.rid then return {5} end
    local at, u = s.rat[j], s.ru[j]
    table.remove(s.rid, j)
    table.remove(s.rat, j)
    table.remove(s.ru, j)
    if counted > u then counted = u end
    if banned then return {5} end
    if counted == 0 then return {3, units(s)} end
    add(s, at, counted)
    return tally(l, s, keytext, t)
  end

  function P.count(l, s, keytext, n, t)
    if not free(l, s, t) then return {5} end
    drop_old(l, s, t)
    if n > l.after then n = l.after end
    if n == 0 then return {3, units(s)} end
    add(s, t, n)
    return tally(l, s, keytext, t)
  end

  -- {1, level, since, until, n, n pairs (time, units), m, m triples (id, time, units)}.
  function P.encode(s)
    local v = {1, s.level, s.since, s['until'], #s.et}
    for j = 1, #s.et do v[#v + 1], v[#v + 2] = s.et[j], s.eu[j] end
    v[#v + 1] = #s.rid
    for j = 1, #s.rid do v[#v + 1], v[#v + 2], v[#v + 3] = s.rid[j], s.rat[j], s.ru[j] end
    return cmsgpack.pack(v)
  end

  -- A stored state, or nil and why it is not one (a foreign value: read as no state). At
  -- most MAX_AFTER (src/algo/penalty.rs) entries of each list, whatever the ladder now says:
  -- a ladder edited to a smaller `after` still reads its keys' bans.
  function P.decode(raw)
    local ok, v = pcall(cmsgpack.unpack, raw)
    if not ok or type(v) ~= 'table' or v[1] ~= 1 then return nil, 'not a penalty state' end
    local function whole(x)
      return type(x) == 'number' and x == math.floor(x) and x >= 0 and x < 2^53
    end
    local n = v[5]
    if not (whole(v[2]) and whole(v[3]) and whole(v[4]) and whole(n)) or n > 1000 then
      return nil, 'the penalty state is out of range'
    end
    local s = P.fresh()
    s.level, s.since, s['until'] = v[2], v[3], v[4]
    local b = 6
    for j = 1, n do
      if not (whole(v[b]) and whole(v[b + 1])) then
        return nil, 'the penalty state has a malformed entry'
      end
      s.et[j], s.eu[j] = v[b], v[b + 1]
      b = b + 2
    end
    local m = v[b]
    if not whole(m) or m > 1000 then return nil, 'the penalty state is out of range' end
    b = b + 1
    for j = 1, m do
      if type(v[b]) ~= 'string' or not (whole(v[b + 1]) and whole(v[b + 2])) then
        return nil, 'the penalty state has a malformed reservation'
      end
      s.rid[j], s.rat[j], s.ru[j] = v[b], v[b + 1], v[b + 2]
      b = b + 3
    end
    return s
  end

  return P
end

local KIND_PENALTY = 10

-- A penalty's companion (src/backend/kit/penalty.rs, the same decisions): the key's penalty
-- state at its own key (the limit's key and `:pen`), one MessagePack value (P.encode), kept
-- until it equals a fresh one.
SHAPES[KIND_PENALTY] = function()
  local P = penalty_rule()

  -- The record: 10, mode, cost, reservation id (decimal text; '0': the cost counts at
  -- admission), after, within, base, factor, max, forget_after, jitter, the key's canonical
  -- text.
  local function parse(a)
    local r = {mode = tonumber(ARGV[a + 1]), cost = tonumber(ARGV[a + 2]), id = ARGV[a + 3],
      l = {after = tonumber(ARGV[a + 4]), within = tonumber(ARGV[a + 5]),
        base = tonumber(ARGV[a + 6]), factor = tonumber(ARGV[a + 7]),
        max = tonumber(ARGV[a + 8]), forget = tonumber(ARGV[a + 9]),
        jitter = tonumber(ARGV[a + 10])},
      keytext = ARGV[a + 11]}
    return r, a + 12
  end
  -- A value that is not a penalty state (foreign, another version) reads as none, and the
  -- next write replaces it. r.raw: what was there, to undo a spend ('' deletes the key).
  local function read(i, r)
    local raw = redis.pcall('GET', KEYS[i])
    r.raw = type(raw) == 'string' and raw or ''
    local s = type(raw) == 'string' and P.decode(raw) or nil
    return s or P.fresh()
  end
  -- When the state equals a fresh one: its ban over, its level decayed, its window empty.
  local function fresh_at(l, s)
    local at = s['until']
    if s.level > 0 then at = math.max(at, s.since + s.level * l.forget) end
    for j = 1, #s.et do at = math.max(at, s.et[j] + l.within) end
    for j = 1, #s.rat do at = math.max(at, s.rat[j] + l.within) end
    return at
  end
  local function write(i, r, s)
    local at = fresh_at(r.l, s)
    if at <= now then
      redis.call('DEL', KEYS[i])
      return ''
    end
    local raw = P.encode(s)
    redis.call('SET', KEYS[i], raw, expire_args(at))
    return raw
  end
  -- The numbers every record answers, then whether the key is banned (1: a denial of a ban,
  -- not of a full window), then the level of a ban this call started (0: none).
  local function reply(allowed, left, retry, reset, banned, level)
    if left < 0 then left = 0 end
    return {allowed, left, retry, reset, 0, banned or 0, level or 0}
  end
  local function decide(i, r, s)
    local l = r.l
    if now < s['until'] then
      local w = s['until'] - now
      return reply(0, 0, w, w, 1)
    end
    if not spends(r.mode) or r.cost == 0 then
      -- A read: what left the window is dropped from this copy only (nothing is written).
      P.drop_old(l, s, now)
      return reply(1, l.after - P.units(s), 0, 0)
    end
    if r.id ~= '0' then
      local a = P.admit(l, s, r.id, r.cost, now)
      if a[1] ~= 0 then
        local w = math.max(a[2] - now, 0)
        return reply(0, 0, w, w, a[1] == 1 and 1 or 0)
      end
      local held = P.units(s)
      for j = 1, #s.ru do held = held + s.ru[j] end
      return reply(1, l.after - held, 0, 0), s
    end
    local t = P.count(l, s, r.keytext, r.cost, now)
    if t[1] == 3 then return reply(1, l.after - t[2], 0, 0), s end
    if t[1] == 4 then return reply(1, 0, 0, t[2] - now, 0, t[3]), s end
    return reply(1, 0, 0, 0), s
  end
  local function finish(i, r, s, o, allowed, w)
    local after = r.raw
    if allowed and w then
      if want_raw then r.ttl = redis.call('PTTL', KEYS[i]) end
      after = write(i, r, w)
    end
    if want_raw then
      o[#o + 1] = r.raw
      o[#o + 1] = after
      o[#o + 1] = r.ttl or -1
    end
  end
  -- A refund settles the reservation r.id, counting r.cost of it.
  local function refund(i, r, s)
    local t = P.settle(r.l, s, r.keytext, r.id, r.cost, now)
    if t[1] == 5 then return reply(1, 0, 0, 0) end
    write(i, r, s)
    if t[1] == 3 then return reply(1, r.l.after - t[2], 0, 0) end
    return reply(1, 0, 0, t[2] - now, 0, t[3])
  end
  return {parse = parse, read = read, decide = decide, finish = finish, refund = refund}
end
