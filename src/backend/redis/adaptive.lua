-- Adaptive concurrency keys (src/algo/adaptive.rs, src/backend/kit/adaptive.rs), joined after
-- concurrency.lua (its rule and leases).
--
-- The key is one sorted set: each lease's id scored by its deadline (above 0), as a
-- concurrency key's, and the key's state in members scored below 0, field f as '~f' scored
-- -(value + 1): c the number in thousandths of a slot (0: none yet), g the unloaded
-- latency (the last window's held at half the number, or a lesser one since), n f s m the
-- window's completions, failures, latencies' sum and most in flight, w when the window
-- started, t the last time a slot was taken or given back. It lives until its
-- last lease ends and the key has been idle for idle_reset.

local KIND_ADAPTIVE, KIND_ADAPTIVE_POOL = 8, 9

SHAPES[KIND_ADAPTIVE] = function()
  local ADAPTIVE_FIELDS = {'c', 'g', 'n', 'f', 's', 'm', 'w', 't'}
  -- A gradient's every ADAPTIVE_PROBE_EVERY-th window is a probe (src/algo/adaptive.rs
  -- `PROBE_EVERY`).
  local ADAPTIVE_PROBE_EVERY = 10

  local function clamp(v, lo, hi)
    if v < lo then return lo end
    if v > hi then return hi end
    return v
  end

  -- Whether the window that started at `start` is a probe (src/algo/adaptive.rs `probes`).
  local function adaptive_probes(r, start)
    return r.algo == 0 and math.floor(start / r.window) % ADAPTIVE_PROBE_EVERY
      == ADAPTIVE_PROBE_EVERY - 1
  end

  -- The key's number in the window st is in: its slots, half of them in a probe
  -- (src/algo/adaptive.rs `slots_at`).
  local function adaptive_slots(r, st)
    local slots = clamp(math.floor(st.c / 1000), r.amin, r.amax)
    if adaptive_probes(r, st.w) then slots = math.max(math.floor(slots / 2), r.amin) end
    return slots
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
    -- The key's number now: its slots (src/algo/adaptive.rs `slots_at`).
    r.max = adaptive_slots(r, st)
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
    -- The gradient: p1 the smoothing, p2 the tolerance, in thousandths. Never past half the
    -- limit (a probe, or a key its number did not limit): the limit waits, and the window's
    -- latency is the unloaded one.
    local short = math.max(math.floor(st.s / st.n), 1)
    if st.m * 2000 <= limit then
      st.g = short
      st.c = limit
      return
    end
    local long = short
    if st.g > 0 then long = math.min(short, st.g) end
    st.g = long
    local gradient = clamp(math.floor(r.p2 * long / short), 500, 1000)
    local queue = math.max(math.floor(math.sqrt(whole)), 1) * 1000
    local target = math.floor(limit * gradient / 1000) + queue
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
      take_lease(i, r, 0)
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
    r.max = adaptive_slots(r, r.st)
    adaptive_write(i, r, r.st)
    return {released, math.max(r.max - live, 0), 0, 0, 0, r.max}
  end

  -- A pool: the keys of an adaptive limit that share a capacity (src/backend/kit/adaptive.rs
  -- `AdaptivePool`, src/algo/adaptive/capacity.rs the rule), one hash at the limit's own key
  -- `<prefix>{<name>:}:p` (one slot per limit). A record of a pool has r.cap, r.head and r.key (the
  -- key's id as text: it has no control character).
  --   L        every lease: "<key>\t<lease>\t<deadline>\n" each (the ended ones dropped on a write)
  --   q        the keys waiting under their share: "<key>\t<until>\n" each
  --   x        the latest time anything kept ends (the hash's expiry)
  --   c        the sweep's cursor
  --   k:<key>  a key's state: its fields c g n f s m w t, as above, separated by spaces
  -- Another type there is not ours: deleted, read as a fresh pool.
  local MAX_POOL_KEYS, MAX_POOL_WAITERS = 8192, 64
  -- The pools this call wrote: a later record of the same batch on one (the renewal of another
  -- of its keys) reads it again before it writes, so that no write undoes another.
  local pools_written = {}

  -- The pool of record r read at now: its live leases (a foreign deadline cut to one lease),
  -- each key's count, the waiters, the key's state (back at the start when idle), and what the
  -- capacity's rule reads (src/backend/kit/adaptive.rs `AdaptivePool::held`). Returns the
  -- key's own live leases.
  local function pool_read(i, r)
    local st = {c = 0, g = 0, n = 0, f = 0, s = 0, m = 0, w = 0, t = 0}
    r.leases, r.q, r.x, r.cut, r.count = {}, {}, 0, false, {}
    local raw = redis.pcall('HMGET', KEYS[i], 'L', 'q', 'x', 'k:' .. r.key)
    if raw.err then
      redis.call('DEL', KEYS[i])
      raw = {}
    end
    if type(raw[1]) == 'string' then
      for k, id, d in string.gmatch(raw[1], '([^\t\n]+)\t(%d+)\t(%d+)\n') do
        d = tonumber(d)
        if d > now then
          if d > now + r.lease + SLACK then
            d = now + r.lease
            r.cut = true
          end
          r.leases[#r.leases + 1] = {k = k, id = id, d = d}
          r.count[k] = (r.count[k] or 0) + 1
        end
      end
    end
    if type(raw[2]) == 'string' then
      for k, u in string.gmatch(raw[2], '([^\t\n]+)\t(%d+)\n') do
        u = tonumber(u)
        if u > now and #r.q < MAX_POOL_WAITERS then r.q[#r.q + 1] = {k = k, u = u} end
      end
    end
    r.x = tonumber(raw[3]) or 0
    if type(raw[4]) == 'string' then
      local v = {}
      for num in string.gmatch(raw[4], '%d+') do v[#v + 1] = tonumber(num) end
      if #v == #ADAPTIVE_FIELDS then
        for j, f in ipairs(ADAPTIVE_FIELDS) do
          if v[j] < LIMIT then st[f] = v[j] end
        end
      end
    end
    local own = r.count[r.key] or 0
    if (own == 0 and now - st.t >= r.idle) or st.c == 0 then
      st = {c = r.initial * 1000, g = 0, n = 0, f = 0, s = 0, m = 0, w = now, t = now}
    end
    r.st = st
    r.max = adaptive_slots(r, st)
    -- The capacity's rule: every live lease, the keys active (holding or waiting), the share,
    -- and what the other waiters keep back.
    local active = 1
    for k, _ in pairs(r.count) do
      if k ~= r.key then active = active + 1 end
    end
    for _, w in ipairs(r.q) do
      if w.k ~= r.key and not r.count[w.k] then active = active + 1 end
    end
    r.total, r.own = #r.leases, own
    r.share = math.max(math.floor(r.cap / active), 1)
    r.reserve = 0
    for _, w in ipairs(r.q) do
      if w.k ~= r.key then r.reserve = r.reserve + math.max(r.share - (r.count[w.k] or 0), 0) end
    end
    return own
  end

  -- What a key holding `own` slots may take with `total` held (capacity.rs `lent`): its
  -- share's part, then what lies beyond the reserve, never the headroom.
  local function pool_lent(r, own, total)
    local lendable = math.max(r.cap - total - r.head, 0)
    local under = math.min(math.max(r.share - own, 0), lendable)
    return under + math.max(lendable - under - r.reserve, 0)
  end

  -- The slots the key may still take (src/algo/adaptive/capacity.rs `room`): a key holding
  -- none its first from any free slot (the headroom too), then what `pool_lent` allows.
  local function pool_room(r)
    if r.own == 0 and r.cap - r.total > 0 then return 1 + pool_lent(r, 1, r.total + 1) end
    return pool_lent(r, r.own, r.total)
  end

  -- Writes what changed: the leases (w.leases), the waiters (w.q), the key's state (w.st); the
  -- hash kept until the latest thing it keeps ends; past MAX_POOL_KEYS keys, 64 fields swept a
  -- call (the states of keys holding no slot).
  local function pool_write(i, r, w)
    local args = {KEYS[i]}
    local x = r.x
    if w.leases then
      local parts = {}
      for _, l in ipairs(r.leases) do
        parts[#parts + 1] = l.k .. '\t' .. l.id .. '\t' .. string.format('%d', l.d) .. '\n'
        x = math.max(x, l.d)
      end
      args[#args + 1] = 'L'
      args[#args + 1] = table.concat(parts)
    end
    if w.q then
      local parts = {}
      for _, q in ipairs(r.q) do
        parts[#parts + 1] = q.k .. '\t' .. string.format('%d', q.u) .. '\n'
        x = math.max(x, q.u)
      end
      args[#args + 1] = 'q'
      args[#args + 1] = table.concat(parts)
    end
    if w.st then
      local v = {}
      for j, f in ipairs(ADAPTIVE_FIELDS) do v[j] = string.format('%d', r.st[f]) end
      args[#args + 1] = 'k:' .. r.key
      args[#args + 1] = table.concat(v, ' ')
      x = math.max(x, r.st.t + r.idle)
    end
    args[#args + 1] = 'x'
    args[#args + 1] = string.format('%d', x)
    redis.call('HSET', unpack(args))
    pools_written[KEYS[i]] = true
    expire_at(KEYS[i], x)
    if redis.call('HLEN', KEYS[i]) > MAX_POOL_KEYS + 4 then
      local cursor = redis.call('HGET', KEYS[i], 'c') or '0'
      local page = redis.call('HSCAN', KEYS[i], cursor, 'COUNT', 64)
      redis.call('HSET', KEYS[i], 'c', page[1])
      for j = 1, #page[2], 2 do
        local k = string.match(page[2][j], '^k:(.*)$')
        if k and k ~= r.key and not r.count[k] then redis.call('HDEL', KEYS[i], page[2][j]) end
      end
    end
  end

  -- The leases of the key that a renewal names (r.want), among those read.
  local function pool_held(r)
    local held = {}
    for _, l in ipairs(r.leases) do
      if l.k == r.key and r.want[l.id] then held[#held + 1] = l end
    end
    return held
  end

  -- A decision on a pool (src/backend/kit/adaptive.rs `pooled_decide`): the key's own number,
  -- then the capacity's room; a key refused by the capacity under its share waits.
  local function pool_decide(i, r)
    local live = pool_read(i, r)
    if r.mode == MODE_RENEW then
      r.want = {}
      for id in string.gmatch(r.id, '%d+') do r.want[id] = true end
      r.held = pool_held(r)
      local any = 0
      if #r.held > 0 then any = 1 end
      return {any, math.max(r.max - live, 0), 0, 0, 0, #r.held, r.max}
    end
    local ok, rem, retry = concurrency(r, live)
    local shown = r.max
    if r.mode ~= MODE_CHARGE then
      local room = pool_room(r)
      if r.cost == 1 and room == 0 then
        ok, rem, retry = concurrency(r, r.max)
      else
        rem = math.min(rem, room - r.cost)
      end
      shown = math.min(r.max, math.max(live + room, r.share))
      if ok == 0 and counts(r.mode) and spends(r.mode) and live < r.max and live < r.share then
        r.wait = now + 2 * math.max(r.retry, 1)
      end
    end
    return {ok, rem, retry, retry, 0, shown}
  end

  -- What a decision on a pool writes: an allowed batch the lease taken (the key then waits no
  -- more once it holds its share) or renewed; whatever the batch, a cut lease or a wait.
  local function pool_finish(i, r, allowed)
    if pools_written[KEYS[i]] then
      -- Another key of the pool was written by this batch: its leases as they are now.
      local st = r.st
      pool_read(i, r)
      r.st = st
      if r.want then r.held = pool_held(r) end
    end
    if allowed and r.mode == MODE_RENEW and #r.held > 0 then
      for _, l in ipairs(r.held) do l.d = now + r.lease end
      pool_write(i, r, {leases = true, st = true})
    elseif allowed and r.mode ~= MODE_RENEW and spends(r.mode) and r.cost == 1 and r.id ~= '0' then
      r.leases[#r.leases + 1] = {k = r.key, id = r.id, d = now + r.lease}
      r.st.t = math.max(r.st.t, now)
      local served = r.own + 1 >= r.share
      local q = {}
      for _, w in ipairs(r.q) do
        if not (served and w.k == r.key) then q[#q + 1] = w end
      end
      r.q = q
      pool_write(i, r, {leases = true, q = true, st = true})
    elseif r.cut or r.wait then
      if r.wait then
        local found = false
        for _, w in ipairs(r.q) do
          if w.k == r.key then
            w.u = math.max(w.u, r.wait)
            found = true
          end
        end
        if not found and #r.q < MAX_POOL_WAITERS then r.q[#r.q + 1] = {k = r.key, u = r.wait} end
      end
      pool_write(i, r, {leases = r.cut, q = r.wait ~= nil, st = r.cut})
    end
  end

  -- A release on a pool (src/backend/kit/adaptive.rs `pooled_refund`).
  local function pool_refund(i, r)
    local live = pool_read(i, r)
    local released = 0
    for j, l in ipairs(r.leases) do
      if r.id ~= '0' and l.k == r.key and l.id == r.id then
        table.remove(r.leases, j)
        released = 1
        break
      end
    end
    live = live - released
    if released == 1 and r.lat >= 0 then adaptive_complete(r, r.st, live + 1) end
    r.max = adaptive_slots(r, r.st)
    pool_write(i, r, {leases = true, st = true})
    return {released, math.max(r.max - live, 0), 0, 0, 0, r.max}
  end

  -- The record: 8, mode, cost, lease, retry hint, lease id, min, initial, max, algorithm, its
  -- two parameters, window, completions a window, idle reset, a release's latency (-1: none)
  -- and whether it failed; 9 (a pool's: its keys share a capacity) adds the capacity, the
  -- key's id and the capacity's headroom. Read and decided in order (decide reads the key).
  local function parse(a, kind)
    local r = {mode = tonumber(ARGV[a + 1]), cost = tonumber(ARGV[a + 2]),
      lease = tonumber(ARGV[a + 3]), retry = tonumber(ARGV[a + 4]), id = ARGV[a + 5],
      amin = tonumber(ARGV[a + 6]), initial = tonumber(ARGV[a + 7]),
      amax = tonumber(ARGV[a + 8]), algo = tonumber(ARGV[a + 9]), p1 = tonumber(ARGV[a + 10]),
      p2 = tonumber(ARGV[a + 11]), window = tonumber(ARGV[a + 12]),
      wc = tonumber(ARGV[a + 13]), idle = tonumber(ARGV[a + 14]),
      lat = tonumber(ARGV[a + 15]), failed = tonumber(ARGV[a + 16])}
    a = a + 17
    if kind == KIND_ADAPTIVE_POOL then
      r.cap, r.key, r.head = tonumber(ARGV[a]), ARGV[a + 1], tonumber(ARGV[a + 2])
      a = a + 3
    end
    return r, a
  end
  local function read()
    return 0
  end
  local function decide(i, r)
    if r.cap then return pool_decide(i, r) end
    return adaptive_decide(i, r)
  end
  local function finish(i, r, s, o, allowed)
    if r.cap then
      pool_finish(i, r, allowed and o[1] == 1)
    else
      adaptive_finish(i, r, allowed and o[1] == 1)
    end
  end
  local function refund(i, r)
    if r.cap then return pool_refund(i, r) end
    return adaptive_refund(i, r)
  end
  return {parse = parse, read = read, decide = decide, finish = finish, refund = refund}
end
SHAPES[KIND_ADAPTIVE_POOL] = SHAPES[KIND_ADAPTIVE]
