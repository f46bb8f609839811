-- Concurrency keys (src/algo/concurrency.rs, docs/concurrency.md; joined after general.lua):
-- the rule and the leases, which adaptive concurrency keys (adaptive.lua) hold too, and the
-- record of kind KIND_CONCURRENCY. The key is a sorted set of lease ids scored by their
-- deadlines.

local KIND_CONCURRENCY = 3

-- Keeps key i until its last lease ends.
local function keep_until_last(i)
  expire_at(KEYS[i], tonumber(redis.call('ZRANGE', KEYS[i], -1, -1, 'WITHSCORES')[2]))
end

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

-- Records lease r.id on key i, taken now, and keeps the key until its last lease ends; `live`
-- is what the key held (-1: not a set of leases, replaced).
local function take_lease(i, r, live)
  if live < 0 then redis.call('DEL', KEYS[i]) end
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

SHAPES[KIND_CONCURRENCY] = function()
  -- The record: 3, mode, cost (0 probes, 1 takes a slot), max in flight, lease time, retry
  -- hint, lease id (text; '0': none; a renewal: every lease it renews, separated by spaces).
  local function parse(a)
    local r = {mode = tonumber(ARGV[a + 1]), cost = tonumber(ARGV[a + 2]),
      max = tonumber(ARGV[a + 3]), lease = tonumber(ARGV[a + 4]), retry = tonumber(ARGV[a + 5]),
      id = ARGV[a + 6]}
    return r, a + 7
  end
  -- The live leases (deadline after now): ended ones are dropped first, which changes no
  -- decision; foreign ones (a deadline further ahead than a lease runs) are cut to a lease
  -- taken now (src/algo/concurrency.rs `read`): they hold a slot for one lease time. A value
  -- that is not a sorted set is no lease at all (-1), and the first lease replaces it.
  local function read(i, r)
    local trimmed = redis.pcall('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
    if type(trimmed) == 'table' then return -1 end
    local far = redis.call('ZRANGEBYSCORE', KEYS[i], now + r.lease + SLACK + 1, '+inf')
    for _, id in ipairs(far) do redis.call('ZADD', KEYS[i], now + r.lease, id) end
    if #far > 0 then keep_until_last(i) end
    return redis.call('ZCARD', KEYS[i])
  end
  -- A renewal holds the ids among the live leases (ended ones were removed, foreign ones
  -- cut), each renewed when the batch is allowed; its reply counts them.
  local function decide(i, r, s)
    if r.mode == MODE_RENEW then
      local held = {}
      if s >= 0 then held = held_leases(i, r) end
      r.held = held
      local rem = r.max - math.max(s, 0)
      if rem < 0 then rem = 0 end
      local any = 0
      if #held > 0 then any = 1 end
      return {any, rem, 0, 0, 0, #held}
    end
    local ok, rem, retry = concurrency(r, s)
    return {ok, rem, retry, retry, 0}
  end
  local function finish(i, r, s, o, allowed)
    if not allowed or o[1] ~= 1 then return end
    if r.mode == MODE_RENEW then
      renew_lease(i, r)
    elseif spends(r.mode) and r.cost == 1 and r.id ~= '0' then
      take_lease(i, r, s)
    end
  end
  -- A release: the lease's id leaves the set (ended leases already left it).
  local function refund(i, r, s)
    local released, live = 0, 0
    if s >= 0 then
      released = redis.call('ZREM', KEYS[i], r.id)
      live = redis.call('ZCARD', KEYS[i])
    end
    local rem = r.max - live
    if rem < 0 then rem = 0 end
    return {released, rem, 0, 0, 0}
  end
  return {parse = parse, read = read, decide = decide, finish = finish, refund = refund}
end
