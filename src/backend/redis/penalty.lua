-- Penalty ladders (src/algo/penalty.rs, docs/penalties.md), function for function: a key's
-- ladder state decided on the server in the call that decides its request (issue 81: not yet
-- joined into the script; src/backend/redis/tests.rs runs it beside the Rust rule).
--
-- A ladder l: {after, within, base, factor, max, forget, jitter} (microseconds, jitter in
-- thousandths). A state s: {level, since, until, at = {}, counted = {}, pending = {}} (the
-- window's entries by admission time, oldest first). Stored as one MessagePack array:
-- {1, level, since, until, n, then n triples (at, counted, pending)}. Every number is a whole
-- number below 2^53, so the doubles hold them exactly.

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

  function P.fresh() return {level = 0, since = 0, ['until'] = 0, at = {}, counted = {}, pending = {}} end

  local function free(l, s, t)
    if t < s['until'] then return false end
    s.level, s.since = P.decayed(l, s.level, s.since, t)
    return true
  end

  local function drop_old(l, s, t)
    local start = t - l.within
    if start < 0 then return end
    local keep = 1
    while keep <= #s.at and s.at[keep] <= start do keep = keep + 1 end
    if keep == 1 then return end
    local at, c, p = {}, {}, {}
    for j = keep, #s.at do
      at[#at + 1], c[#c + 1], p[#p + 1] = s.at[j], s.counted[j], s.pending[j]
    end
    s.at, s.counted, s.pending = at, c, p
  end

  -- The index of the entry at t, made in time order when there is none.
  local function entry_at(s, t)
    local j = #s.at
    while j >= 1 and s.at[j] > t do j = j - 1 end
    if j >= 1 and s.at[j] == t then return j end
    table.insert(s.at, j + 1, t)
    table.insert(s.counted, j + 1, 0)
    table.insert(s.pending, j + 1, 0)
    return j + 1
  end

  local function units(s)
    local u = 0
    for j = 1, #s.at do u = u + s.counted[j] end
    return u
  end

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
    s.at, s.counted, s.pending = {}, {}, {}
    return {4, s['until'], s.level}
  end

  -- Admission replies: {0} admitted, {1, until, level} banned, {2, until} full.
  function P.admit(l, s, reserve, t)
    if not free(l, s, t) then return {1, s['until'], s.level} end
    drop_old(l, s, t)
    local held = 0
    for j = 1, #s.at do held = held + s.counted[j] + s.pending[j] end
    if held >= l.after then
      for j = 1, #s.at do
        held = held - s.counted[j] - s.pending[j]
        if held < l.after then return {2, s.at[j] + l.within} end
      end
      return {2, 0}
    end
    if reserve > l.after then reserve = l.after end
    if reserve > 0 then
      local j = entry_at(s, t)
      s.pending[j] = s.pending[j] + reserve
    end
    return {0}
  end

  function P.settle(l, s, keytext, at, reserved, counted, t)
    local banned = not free(l, s, t)
    drop_old(l, s, t)
    local j = #s.at
    while j >= 1 and s.at[j] ~= at do j = j - 1 end
    if j == 0 then return {5} end
    if reserved > l.after then reserved = l.after end
    if reserved > s.pending[j] then reserved = s.pending[j] end
    s.pending[j] = s.pending[j] - reserved
    if counted > reserved then counted = reserved end
    if banned or counted == 0 then
      if s.pending[j] == 0 and s.counted[j] == 0 then
        table.remove(s.at, j)
        table.remove(s.counted, j)
        table.remove(s.pending, j)
      end
      if banned then return {5} end
      return {3, units(s)}
    end
    s.counted[j] = s.counted[j] + counted
    return tally(l, s, keytext, t)
  end

  function P.count(l, s, keytext, n, t)
    if not free(l, s, t) then return {5} end
    drop_old(l, s, t)
    if n > l.after then n = l.after end
    if n == 0 then return {3, units(s)} end
    local j = entry_at(s, t)
    s.counted[j] = s.counted[j] + n
    return tally(l, s, keytext, t)
  end

  function P.encode(s)
    local v = {1, s.level, s.since, s['until'], #s.at}
    for j = 1, #s.at do
      v[#v + 1], v[#v + 2], v[#v + 3] = s.at[j], s.counted[j], s.pending[j]
    end
    return cmsgpack.pack(v)
  end

  -- A stored state, or nil and why it is not one (a foreign value: read as no state).
  function P.decode(raw)
    local ok, v = pcall(cmsgpack.unpack, raw)
    if not ok or type(v) ~= 'table' or v[1] ~= 1 then return nil, 'not a penalty state' end
    local function whole(x) return type(x) == 'number' and x == math.floor(x) and x >= 0 and x < 2^53 end
    local n = v[5]
    -- At most 2 * MAX_AFTER entries (src/algo/penalty.rs), whatever the ladder now says: a
    -- ladder edited to a smaller `after` still reads its keys' bans.
    if not (whole(v[2]) and whole(v[3]) and whole(v[4]) and whole(n)) or n > 2000 then
      return nil, 'the penalty state is out of range'
    end
    local s = P.fresh()
    s.level, s.since, s['until'] = v[2], v[3], v[4]
    for j = 1, n do
      local b = 5 + (j - 1) * 3
      if not (whole(v[b + 1]) and whole(v[b + 2]) and whole(v[b + 3])) then
        return nil, 'the penalty state has a malformed entry'
      end
      s.at[j], s.counted[j], s.pending[j] = v[b + 1], v[b + 2], v[b + 3]
    end
    return s
  end

  return P
end
