-- Adaptive concurrency keys (src/algo/adaptive.rs, src/backend/kit/adaptive.rs), joined after
-- general_read.lua (its concurrency rule and leases) and before general_decide.lua.
--
-- The key is one sorted set: each lease's id scored by its deadline (above 0), as a
-- concurrency key's, and the key's state in members scored below 0, field f as '~f' scored
-- -(value + 1): c the number in thousandths of a slot (0: none yet), g the best recent
-- latency, n f s m the window's completions, failures, latencies' sum and most in flight, w
-- when the window started, t the last time a slot was taken or given back. It lives until its
-- last lease ends and the key has been idle for idle_reset.
local ADAPTIVE_FIELDS = {'c', 'g', 'n', 'f', 's', 'm', 'w', 't'}
local ADAPTIVE_DRIFT = 500

local function clamp(v, lo, hi)
  if v < lo then return lo end
  if v > hi then return hi end
  return v
end

-- Key i read under record r: its live leases (ended ones dropped, foreign deadlines cut to one
-- lease) and its state, back at the start when it was idle, no lease live
-- (src/algo/adaptive.rs `rolled`). A
-- value that is not a sorted set is not ours: deleted, read as a fresh key.
local function adaptive_read(i, r)
  local st = {c = 0, g = 0, n = 0, f = 0, s = 0, m = 0, w = 0, t = 0}
  -- The fields as stored (missing or not ours: nil), so a write touches only what changed.
  local was = {}
  local live = 0
  local trimmed = redis.pcall('ZREMRANGEBYSCORE', KEYS[i], 0, now)
  if type(trimmed) == 'table' then
    redis.call('DEL', KEYS[i])
  else
    local far = redis.call('ZRANGEBYSCORE', KEYS[i], now + r.lease + SLACK + 1, '+inf')
    for _, id in ipairs(far) do redis.call('ZADD', KEYS[i], now + r.lease, id) end
    r.cut = #far > 0
    live = redis.call('ZCOUNT', KEYS[i], '(0', '+inf')
    local raw = redis.call('ZRANGEBYSCORE', KEYS[i], '-inf', '(0', 'WITHSCORES')
    for j = 1, #raw, 2 do
      local f = string.match(raw[j], '^~(%a)$')
      local v = -tonumber(raw[j + 1]) - 1
      if f and st[f] ~= nil and v >= 0 and v < LIMIT and v == math.floor(v) then
        st[f] = v
        was[f] = v
      end
    end
  end
  if (live == 0 and now - st.t >= r.idle) or st.c == 0 then
    st = {c = r.initial * 1000, g = 0, n = 0, f = 0, s = 0, m = 0, w = now, t = now}
  end
  r.st = st
  r.was = was
  -- The key's number now: its slots (src/algo/adaptive.rs `slots`).
  r.max = clamp(math.floor(st.c / 1000), r.amin, r.amax)
  return live
end

-- The number after a window (src/algo/adaptive.rs `update`).
local function adaptive_update(r, st)
  if st.n == 0 then return end
  local lo, hi = r.amin * 1000, r.amax * 1000
  local limit = clamp(st.c, lo, hi)
  local whole = math.floor(limit / 1000)
  if r.algo == 1 then
    -- AIMD: p1 the backoff in thousandths, p2 the increase.
    local nxt = limit
    if st.f > 0 then
      nxt = whole * r.p1
    elseif st.m >= whole then
      nxt = limit + r.p2 * 1000
    end
    st.c = clamp(nxt, lo, hi)
    return
  end
  -- The gradient: p1 the smoothing, p2 the tolerance, in thousandths.
  local short = math.max(math.floor(st.s / st.n), 1)
  local long = short
  if st.g > 0 then long = math.min(short, st.g + math.max(math.floor(st.g / ADAPTIVE_DRIFT), 1)) end
  long = math.max(long, 1)
  st.g = long
  if st.m * 2000 < limit then
    st.c = limit
    return
  end
  local gradient = clamp(math.floor(r.p2 * long / short), 500, 1000)
  local queue = math.max(math.floor(math.sqrt(whole)), 1) * 1000
  local target = whole * gradient + queue
  st.c = clamp(math.floor((limit * (1000 - r.p1) + target * r.p1) / 1000), lo, hi)
end

-- A release's completion recorded in the window; a window that is over moves the number
-- (src/algo/adaptive.rs `complete`).
local function adaptive_complete(r, st, in_flight)
  if st.n == 0 then st.w = now end
  st.n = st.n + 1
  if r.failed == 1 then st.f = st.f + 1 end
  -- Capped where Rust caps it (MAX_LATENCY_SUM_US): below LIMIT, kept exactly.
  st.s = math.min(st.s + r.lat, LIMIT - 1)
  st.m = math.max(st.m, in_flight)
  st.t = math.max(st.t, now)
  if (r.wc > 0 and st.n >= r.wc) or now - st.w >= r.window then
    adaptive_update(r, st)
    st.n, st.f, st.s, st.m, st.w = 0, 0, 0, 0, now
  end
end

-- Writes key i's state (the fields that differ from what was read), and keeps the key until
-- its last lease ends and it has been idle long enough to start again
-- (src/backend/kit/adaptive.rs `adaptive_fresh_at`).
local function adaptive_write(i, r, st)
  local args = {KEYS[i]}
  for _, f in ipairs(ADAPTIVE_FIELDS) do
    if st[f] ~= r.was[f] then
      args[#args + 1] = -(st[f] + 1)
      args[#args + 1] = '~' .. f
      r.was[f] = st[f]
    end
  end
  if #args > 1 then redis.call('ZADD', unpack(args)) end
  local until_at = st.t + r.idle
  local last = tonumber(redis.call('ZRANGE', KEYS[i], -1, -1, 'WITHSCORES')[2])
  if last and last > until_at then until_at = last end
  expire_at(KEYS[i], until_at)
end

-- A spend, check, charge or renewal: the concurrency rule against the key's number now. The
-- reply: allowed, remaining, retry, reset, 0, (a renewal: the leases renewed,) the number.
local function adaptive_decide(i, r)
  local live = adaptive_read(i, r)
  if r.mode == MODE_RENEW then
    r.held = held_leases(i, r)
    local any = 0
    if #r.held > 0 then any = 1 end
    return {any, math.max(r.max - live, 0), 0, 0, 0, #r.held, r.max}
  end
  local ok, rem, retry = concurrency(r, live)
  return {ok, rem, retry, retry, 0, r.max}
end

-- What an allowed batch writes: the lease taken (and the key's activity) or renewed, with the
-- state as read; a cut lease writes the state whatever the batch decides.
local function adaptive_finish(i, r, allowed)
  local st = r.st
  local ok = allowed
  if ok and r.mode == MODE_RENEW and #r.held > 0 then
    renew_lease(i, r)
    adaptive_write(i, r, st)
  elseif ok and r.mode ~= MODE_RENEW and spends(r.mode) and r.cost == 1 and r.id ~= '0' then
    stored[i] = 0
    take_lease(i, r)
    st.t = math.max(st.t, now)
    adaptive_write(i, r, st)
  elseif r.cut then
    adaptive_write(i, r, st)
  end
end

-- A release: the lease leaves the set, its completion (if any) goes into the window, and the
-- state is written. The reply: released, remaining, 0, 0, 0, the number.
local function adaptive_refund(i, r)
  local live = adaptive_read(i, r)
  local released = 0
  if r.id ~= '0' then released = redis.call('ZREM', KEYS[i], r.id) end
  live = live - released
  if released == 1 and r.lat >= 0 then adaptive_complete(r, r.st, live + 1) end
  r.max = clamp(math.floor(r.st.c / 1000), r.amin, r.amax)
  adaptive_write(i, r, r.st)
  return {released, math.max(r.max - live, 0), 0, 0, 0, r.max}
end
