-- The script's general path, its run (after general.lua and every shape's file): the records
-- parsed, every key read before anything is decided, then the op decided, written and
-- answered, each record by its shape's handler (general.lua); this file names no shape.

-- The records (each with its kind's handler, by key), and what each key read.
local rec, handlers, stored = {}, {}, {}
local a = 5
for i = 1, n do
  local kind = tonumber(ARGV[a])
  local h = shape(kind)
  if not h then return redis.error_reply('tower-ratelimits: unknown record kind') end
  rec[i], a = h.parse(a, kind)
  handlers[i] = h
end
for i = 1, n do
  stored[i] = handlers[i].read(i, rec[i])
end

-- The replies, by key; then now.
local out = {}
if op == OP_SPEND then
  -- The batch is allowed when no reply of a mode that counts is a denial; what each key writes
  -- is written once every key is decided.
  local allowed, writes = true, {}
  for i = 1, n do
    local r = rec[i]
    local o, w = handlers[i].decide(i, r, stored[i])
    out[i], writes[i] = o, w
    if o[1] == 0 and counts(r.mode) then allowed = false end
  end
  for i = 1, n do
    handlers[i].finish(i, rec[i], stored[i], out[i], allowed, writes[i])
  end
elseif op == OP_REFUND then
  for i = 1, n do
    out[i] = handlers[i].refund(i, rec[i], stored[i])
  end
elseif SHAPE_OPS[op] then
  -- An op of a shape's own (a region's share request or grant): every key's reply, then now.
  for i = 1, n do
    local f = handlers[i][op]
    if not f then return redis.error_reply('tower-ratelimits: ' .. op .. ' on another shape') end
    out[i] = f(i, rec[i], stored[i])
  end
  out[n + 1] = now
  return out
else
  return redis.error_reply('tower-ratelimits: unknown operation')
end

-- What a spend or refund left to settle: foreign values it did not write over replaced, the
-- replies made final.
for i = 1, n do
  local settle = handlers[i].settle
  if settle then settle(i, rec[i], stored[i], out[i]) end
end
out[n + 1] = now
return out
