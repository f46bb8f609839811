-- tower-ratelimits: GCRA for a batch of buckets in one slot, decided and written atomically.
-- It mirrors src/gcra.rs line by line; every value is an integer number of microseconds, and
-- every value stays below 2^53, so Lua's doubles hold them exactly.
--
-- KEYS[i]   the buckets (one slot).
-- ARGV[1]   'spend' or 'refund'.
-- ARGV[2]   now in microseconds, or -1 to read the server's clock (TIME).
-- ARGV[3]   -1: expire keys at their TAT on the server's clock (PXAT); m >= 0: after their
--           TAT minus now plus m milliseconds (PX), for caller time, which the server's clock
--           cannot follow.
-- then, per key, 5 values: emission interval, burst offset, burst, cost, mode
--           (mode 0 check-and-spend, 1 check-only, 2 spend-only).
--
-- Returns per key 5 integers: allowed (0/1), remaining, retry_after, reset_after and the TAT
-- stored afterwards (0: none), then now. A bucket holding something that is not a TAT returns
-- {-1, index, reason} and changes nothing.

local LIMIT = 4503599627370496 -- 2^52: stored TATs and now stay below it

local op = ARGV[1]
local now = tonumber(ARGV[2])
local margin = tonumber(ARGV[3])
if now < 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local n = #KEYS
local stored = {}
for i = 1, n do
  local raw = redis.pcall('GET', KEYS[i])
  if type(raw) == 'table' then
    return {-1, i, 'the key holds a value that is not a string'}
  elseif raw == false then
    stored[i] = 0
  else
    if #raw > 16 or not string.match(raw, '^%d+$') then
      return {-1, i, 'the stored value is not a TAT in microseconds'}
    end
    local v = tonumber(raw)
    if v >= LIMIT then
      return {-1, i, 'the stored TAT is out of range'}
    end
    stored[i] = v
  end
end

-- floor(v / ei) for v >= 0, corrected for the rounding of the division.
local function tokens(v, ei)
  if v <= 0 then return 0 end
  local q = math.floor(v / ei)
  if q * ei > v then
    q = q - 1
  elseif (q + 1) * ei <= v then
    q = q + 1
  end
  return q
end

local function write(key, tat)
  if tat <= now then
    redis.call('DEL', key)
  elseif margin < 0 then
    redis.call('SET', key, string.format('%.0f', tat), 'PXAT',
      string.format('%.0f', math.floor((tat + 999) / 1000)))
  else
    redis.call('SET', key, string.format('%.0f', tat), 'PX',
      string.format('%.0f', math.floor((tat - now + 999) / 1000) + margin))
  end
end

local out = {}
local function arg(i, j)
  return tonumber(ARGV[3 + (i - 1) * 5 + j])
end

if op == 'spend' then
  local batch_allowed = true
  local writes = {}
  for i = 1, n do
    local ei, bo, cost, mode = arg(i, 1), arg(i, 2), arg(i, 4), arg(i, 5)
    local tat = math.max(stored[i], now)
    local incr = ei * cost
    local new_tat = tat + incr
    local difference = now - (new_tat - bo)
    local b = (i - 1) * 5
    if difference < 0 then
      out[b + 1] = 0
      out[b + 2] = tokens(now - (tat - bo), ei)
      out[b + 3] = -difference
      out[b + 4] = tat - now
      if mode ~= 2 then batch_allowed = false end
    else
      out[b + 1] = 1
      out[b + 2] = tokens(difference, ei)
      if difference < incr then out[b + 3] = incr - difference else out[b + 3] = 0 end
      out[b + 4] = new_tat - now
      if mode ~= 1 and new_tat > now and new_tat ~= stored[i] then
        writes[i] = new_tat
      end
    end
    out[b + 5] = stored[i]
  end
  if batch_allowed then
    for i = 1, n do
      if writes[i] then
        write(KEYS[i], writes[i])
        out[(i - 1) * 5 + 5] = writes[i]
      end
    end
  end
elseif op == 'refund' then
  for i = 1, n do
    local ei, bo, burst, cost = arg(i, 1), arg(i, 2), arg(i, 3), arg(i, 4)
    local b = (i - 1) * 5
    local s = stored[i]
    if s == 0 or s < now then
      out[b + 1] = 0
      out[b + 2] = burst
      out[b + 3] = 0
      out[b + 4] = 0
      out[b + 5] = s
    else
      local new_tat = math.max(s - ei * cost, now)
      out[b + 1] = (new_tat ~= s) and 1 or 0
      out[b + 2] = tokens(now - (new_tat - bo), ei)
      out[b + 3] = 0
      out[b + 4] = new_tat - now
      out[b + 5] = s
      if new_tat ~= s then
        write(KEYS[i], new_tat)
        out[b + 5] = new_tat
      end
    end
  end
else
  return redis.error_reply('tower-ratelimits: unknown operation')
end

for i = 1, n do
  if out[(i - 1) * 5 + 5] <= now then out[(i - 1) * 5 + 5] = 0 end
end
out[n * 5 + 1] = now
return out
