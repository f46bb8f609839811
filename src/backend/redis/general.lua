-- The script's general path, its head (src/backend/redis/script.rs `SCRIPT` joins
-- ratelimit.lua, this file, each shape's file and general_run.lua into the one script Redis
-- runs): what every shape's file uses, the restore op, and the table of shapes.
--
-- Each shape's file registers, under each record kind it answers, a maker of its handler:
-- SHAPES[KIND_X] = function() ... return handler end. A call makes the handlers of the kinds
-- its records name, once each (`shape`), so a call pays for the functions of its own shapes
-- only (each `local function` is a closure made on every call that reaches it). A handler is
-- a table of functions, every key's record r (with its handler at r.h) in key order:
--   parse(a, kind)          the record at ARGV[a] (its kind), and where the next one starts
--   read(i, r)              key i's stored value as the record reads it (every key is read
--                           before anything is decided); what decide, finish, refund and settle
--                           get as s
--   decide(i, r, s)         a spend's reply for key i, and what an allowed batch writes (nil:
--                           nothing); a reply of 0 whose mode counts denies the batch
--   finish(i, r, s, o, allowed, w)  after every decision: the write w when the batch is
--                           allowed, and what the shape writes whatever it decides (o: the reply)
--   refund(i, r, s)         a refund's reply for key i, the key written
--   settle(i, r, s, o)      (optional) after a spend or refund: a foreign value the call did
--                           not write over replaced, the reply made final
--   [op](i, r, s)           (optional) a reply to an op of the shape's own (a region's share
--                           request or grant), which ends the call
-- general_run.lua drives them, and names no shape.

local OP_SPEND, OP_REFUND, OP_RESTORE = 'spend', 'refund', 'restore'
local MODE_OBSERVE, MODE_CHARGE, MODE_RENEW = 3, 4, 5

-- Whether a transaction of this mode counts toward the batch (spend-only and observe do not).
local function counts(mode) return mode == MODE_CHECK_AND_SPEND or mode == MODE_CHECK_ONLY end

-- Whether a transaction of this mode is written when allowed (check-only and observe are not).
local function spends(mode)
  return mode == MODE_CHECK_AND_SPEND or mode == MODE_SPEND_ONLY or mode == MODE_CHARGE
end

-- Numbers are passed to commands as they are: Redis 7 writes a whole double below 2^53 as
-- its exact decimal digits (`tests/redis_keys.rs` holds it to that). On the server's clock a
-- GCRA key expires k milliseconds after its TAT: k records the writer's bound (gcra.lua).
local function expire_args(at, k)
  if margin < 0 then
    return 'PXAT', math.floor((at + 999) / 1000) + (k or 0)
  end
  return 'PX', math.floor((at - now + 999) / 1000) + margin
end

-- Keeps `key` (a set or a hash, whatever it holds) until `at`, as expire_args says.
local function expire_at(key, at)
  local how, ms = expire_args(at)
  if how == 'PXAT' then
    redis.call('PEXPIREAT', key, ms)
  else
    redis.call('PEXPIRE', key, ms)
  end
end

-- floor(v / ei) for v > 0 (0 otherwise), corrected for the rounding of the division.
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

-- 'restore': the values a spend wrote put back (a denied batch across slots: src/backend/redis/
-- mod.rs), each only while the key still holds what the spend wrote.
if op == OP_RESTORE then
  for i = 1, n do
    local b = 4 + (i - 1) * 3
    local written, before, ttl = ARGV[b + 1], ARGV[b + 2], tonumber(ARGV[b + 3])
    local cur = redis.pcall('GET', KEYS[i])
    if cur == written then
      if before == '' then
        redis.call('DEL', KEYS[i])
      elseif ttl > 0 then
        redis.call('SET', KEYS[i], before, 'PX', ttl)
      else
        redis.call('SET', KEYS[i], before)
      end
    end
  end
  return {now}
end

-- The shapes' makers, by record kind (each shape's file adds its own), the ops of a shape's
-- own (op name -> true), and the handlers this call made, by maker.
local SHAPES, SHAPE_OPS, made = {}, {}, {}

-- The handler of records of `kind` (nil: no shape has that kind), made on its first use.
local function shape(kind)
  local make = SHAPES[kind]
  if not make then return nil end
  local h = made[make]
  if not h then
    h = make()
    made[make] = h
  end
  return h
end
