-- Calendar quotas (src/algo/calendar.rs, docs/calendar.md; joined after general.lua): a key
-- holds "<period end> <units used>" and expires at the period's end. A call whose only record
-- is a calendar quota's takes its own path (ratelimit.lua, 'C').

local KIND_CALENDAR = 5

SHAPES[KIND_CALENDAR] = function()
  -- The decision of record r on `used` units of its period: the reply, and the units used after
  -- it when it is written (nil: nothing to write). A charge takes its whole cost.
  local function calendar(r, used)
    local left = r.count - used
    if left < 0 then left = 0 end
    local reset = math.max(r.e - now, 0)
    local granted = math.min(r.max, left)
    if r.mode == MODE_CHARGE then granted = r.max end
    if r.mode ~= MODE_CHARGE and granted < r.min then return {0, left, reset, reset, r.e, 0} end
    local rem = r.count - used - granted
    if rem < 0 then rem = 0 end
    local after
    if spends(r.mode) and granted > 0 then after = used + granted end
    return {1, rem, 0, reset, r.e, granted}, after
  end

  -- Writes the units used in the period in force (at most 2^52: above every count, so an overrun
  -- of any size ends with its period), until its end.
  local function write_calendar(key, r, used)
    redis.call('SET', key, string.format('%d %d', r.e, math.min(used, LIMIT)), expire_args(r.e))
    r.written = true
  end
  -- The record: 5, mode, min, max, count, the period in force on the caller's clock (start,
  -- end), the next end, the horizon. The period that holds this server's clock, of the three
  -- the instance sends (its own period's start and end, and the next end): the store's clock
  -- decides, so an instance whose clock runs ahead or behind spends in the store's period
  -- (before `s`, the period ending at `s`).
  local function parse(a)
    local s, e = tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6])
    if now < s then
      e = s
    elseif now >= e then
      e = tonumber(ARGV[a + 7])
    end
    local r = {mode = tonumber(ARGV[a + 1]), min = tonumber(ARGV[a + 2]),
      max = tonumber(ARGV[a + 3]), count = tonumber(ARGV[a + 4]), e = e,
      h = tonumber(ARGV[a + 8])}
    return r, a + 9
  end
  -- src/algo/calendar.rs `read`: units used count while the clock is before both the end
  -- they were counted to and the end of the period in force. An end past the period in
  -- force is cut to it and written back (r.fix); one more than the horizon ahead, or a
  -- value that is not "<end> <used>", is foreign: read as the period drained, and replaced.
  -- Units used past 2^52 (charges add up to any size) read as 2^52: above every count.
  local function read(i, r)
    local raw = redis.pcall('GET', KEYS[i])
    local e, u
    if type(raw) == 'string' then e, u = string.match(raw, '^(%d+) (%d+)$') end
    e, u = tonumber(e), tonumber(u)
    if e and u and e < LIMIT and e <= now + r.h then
      u = math.min(u, LIMIT)
      if e > r.e then
        r.fix = true
        return u
      elseif now < e then
        return u
      end
      return 0
    elseif raw then
      r.fix = true
      return r.count
    end
    return 0
  end
  local function decide(i, r, s)
    return calendar(r, s)
  end
  local function finish(i, r, s, o, allowed, w)
    if allowed and w then write_calendar(KEYS[i], r, w) end
  end
  -- A refund gives back up to max of the units used in the period in force.
  local function refund(i, r, s)
    local back = math.min(r.max, s)
    local rem = r.count - (s - back)
    if rem < 0 then rem = 0 end
    if back > 0 then write_calendar(KEYS[i], r, s - back) end
    return {back > 0 and 1 or 0, rem, 0, math.max(r.e - now, 0), r.e}
  end
  -- A foreign value, or an end past the period in force, written as read when the call
  -- wrote nothing over it.
  local function settle(i, r, s, o)
    if r.fix and not r.written then write_calendar(KEYS[i], r, s) end
  end
  return {parse = parse, read = read, decide = decide, finish = finish, refund = refund,
    settle = settle}
end
