-- GCRA records (src/algo/gcra.rs, docs/gcra.md; joined after general.lua): the rule, which a
-- region's share buckets (share.lua) and fair shares (fair_share.lua) decide by too, and the
-- records of kinds KIND_GCRA, KIND_RANGE (a partial grant) and KIND_CHARGE (a settle's
-- overrun, never denied).

local KIND_GCRA, KIND_RANGE, KIND_CHARGE = 0, 2, 4


-- The core of the rule: the TAT after spending `incr` (emission interval * cost) on a bucket
-- whose stored TAT is `stored`, and whether it fits (new_tat - bo <= now).
local function gcra_fits(stored, incr, bo)
  local tat = stored
  if tat < now then tat = now end
  local new_tat = tat + incr
  return new_tat, new_tat - bo <= now
end


-- Whether an allowed GCRA spend writes its new TAT (never one that does not spend, never a
-- no-op).
local function gcra_writes(mode, new_tat, stored)
  return spends(mode) and new_tat > now and new_tat ~= stored
end

-- The stored TAT of GCRA key i under record r (0: none), and its writer's bound's bit length
-- (0 when it was not needed). A TAT beyond the larger of r's bound and its writer's (plus
-- SLACK), and a value that is not a TAT of ours (another type, not a number, not a whole
-- number, out of range: another program's data, or a future format), is foreign: read as the
-- bucket drained under r, which replaces it (r.fix; SET replaces a value of any type).
-- `tonumber` yields nil for another type (an error table) and text that is not a number.
local function read_tat(i, r)
  local raw = redis.pcall('GET', KEYS[i])
  if not raw then return 0, 0 end
  local v = tonumber(raw)
  local k = 0
  if v == nil or v < 0 or v >= LIMIT or v % 1 ~= 0 then
    v = -1
  elseif v - now > r.bo + r.debt + SLACK then
    k = -1
    if margin < 0 then
      local up = v + 999
      k = redis.pcall('PEXPIRETIME', KEYS[i])
      if type(k) ~= 'number' then k = 0 end
      k = k - (up - up % 1000) / 1000
      if k < 1 or k > 52 then k = -1 end
    end
    if v - now > 2 ^ k + SLACK then v = -1 end
  end
  if v < 0 then
    r.fix = true
    return now + r.bo, 0
  end
  return v, k
end


-- Writes GCRA key i's TAT under a bound of bit length k.
local function write_tat(key, tat, k)
  if tat <= now then
    redis.call('DEL', key)
  else
    redis.call('SET', key, tat, expire_args(tat, k))
  end
end


-- The bit length of record r's bound (burst offset + debt offset): what its writes record.
local function bound_length(r)
  local _, k = math.frexp(r.bo + r.debt)
  return k
end


-- The GCRA rule (docs/gcra.md "spend"; src/algo/gcra.rs `check`): the decision for `cost` on a
-- bucket whose stored TAT is `stored` (0: none). Returns allowed (0/1), remaining,
-- retry_after, reset_after and the TAT a spend stores (nil on a denial).
local function gcra(stored, ei, bo, cost)
  local incr = ei * cost
  local new_tat, fits = gcra_fits(stored, incr, bo)
  local tat = new_tat - incr
  local difference = now - (new_tat - bo)
  if not fits then
    return 0, tokens(now - (tat - bo), ei), -difference, tat - now, nil
  end
  local retry = 0
  if difference < incr then retry = incr - difference end
  return 1, tokens(difference, ei), retry, new_tat - now, new_tat
end

-- The units a GCRA spend of min..max takes (docs/gcra.md "partial grants"; src/algo/gcra.rs
-- `check_range`): the most whole units that fit now, at most max; min when fewer fit (then
-- `gcra` denies it, with the wait before min units fit).
local function gcra_grant(stored, ei, bo, min, max)
  local tat = stored
  if tat < now then tat = now end
  local k = tokens(bo - (tat - now), ei)
  if k > max then k = max end
  if k < min then k = min end
  return k
end

-- A charge (docs/gcra.md "charge"; src/algo/gcra.rs `charge`): the most whole units, at most
-- cost, that fit before the debt bound (bo + debt ahead of now); never denied. Returns 1,
-- remaining, retry_after (the wait before one unit fits), reset_after, the TAT to store (nil:
-- none) and the units charged.
local function gcra_charge(stored, ei, bo, debt, cost)
  local tat = stored
  if tat < now then tat = now end
  local k = tokens(bo + debt - (tat - now), ei)
  if k > cost then k = cost end
  local after = tat - now + ei * k
  local retry = after + ei - bo
  if retry < 0 then retry = 0 end
  local new_tat = nil
  if k > 0 then new_tat = now + after end
  return 1, tokens(bo - after, ei), retry, after, new_tat, k
end

-- The GCRA refund (docs/gcra.md "refund"): allowed (0/1), remaining, reset_after, and the TAT
-- to store (nil: unchanged).
local function gcra_refund(stored, ei, bo, burst, cost)
  if stored == 0 or stored < now then return 0, burst, 0, nil end
  local new_tat = math.max(stored - ei * cost, now)
  if new_tat == stored then
    return 0, tokens(now - (new_tat - bo), ei), new_tat - now, nil
  end
  return 1, tokens(now - (new_tat - bo), ei), new_tat - now, new_tat
end

-- A spend of GCRA record r on stored TAT s (a share bucket's too): the reply (the TAT read at
-- 5; a range's or a charge's units granted at 6) and the TAT an allowed batch writes (nil:
-- none).
local function gcra_decide(i, r, s)
  if r.charge then
    local ok, rem, retry, reset, new_tat, k = gcra_charge(s, r.ei, r.bo, r.debt, r.cost)
    local o = {ok, rem, retry, reset, s, k}
    if new_tat and gcra_writes(r.mode, new_tat, s) then return o, new_tat end
    return o
  end
  local cost = r.cost
  if r.min < cost then cost = gcra_grant(s, r.ei, r.bo, r.min, cost) end
  local ok, rem, retry, reset, new_tat = gcra(s, r.ei, r.bo, cost)
  local o = {ok, rem, retry, reset, s}
  if r.min < r.cost then o[6] = ok * cost end
  if ok == 1 and gcra_writes(r.mode, new_tat, s) then return o, new_tat end
  return o
end

-- A refund of GCRA record r on stored TAT s: the reply, and the TAT to write (nil: unchanged).
local function gcra_refund_reply(r, s)
  local ok, rem, reset, new_tat = gcra_refund(s, r.ei, r.bo, r.burst, r.cost)
  return {ok, rem, 0, reset, s}, new_tat
end

-- A TAT in the past is answered as none.
local function gcra_final(o)
  if o[5] <= now then o[5] = 0 end
end

-- The record: 0, 2 or 4, emission interval, burst offset, burst, cost, mode, debt offset (a
-- range's least units after). Its key holds the TAT (read_tat).
local function make_gcra()
  local function parse(a, kind)
    local cost = tonumber(ARGV[a + 4])
    local r = {ei = tonumber(ARGV[a + 1]), bo = tonumber(ARGV[a + 2]),
      burst = tonumber(ARGV[a + 3]), cost = cost, mode = tonumber(ARGV[a + 5]), min = cost,
      debt = tonumber(ARGV[a + 6]), charge = kind == KIND_CHARGE}
    a = a + 7
    if kind == KIND_RANGE then
      r.min = tonumber(ARGV[a])
      a = a + 1
    end
    return r, a
  end
  local function read(i, r)
    local s
    s, r.k = read_tat(i, r)
    return s
  end
  local function finish(i, r, s, o, allowed, w)
    if allowed and w then
      write_tat(KEYS[i], w, bound_length(r))
      o[5] = w
    end
  end
  local function refund(i, r, s)
    local o, new_tat = gcra_refund_reply(r, s)
    if new_tat then
      -- What a refund leaves may still be as far ahead as its writer set it: keep its bound.
      write_tat(KEYS[i], new_tat, math.max(bound_length(r), r.k))
      o[5] = new_tat
    end
    return o
  end
  -- A foreign value read as drained is written as such when the call wrote nothing over it.
  local function settle(i, r, s, o)
    if r.fix and o[5] == s then write_tat(KEYS[i], s, bound_length(r)) end
    gcra_final(o)
  end
  return {parse = parse, read = read, decide = gcra_decide, finish = finish, refund = refund,
    settle = settle}
end
SHAPES[KIND_GCRA], SHAPES[KIND_RANGE], SHAPES[KIND_CHARGE] = make_gcra, make_gcra, make_gcra
