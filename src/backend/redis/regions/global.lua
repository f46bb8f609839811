-- tower-ratelimits: the global store of a limit across regions (docs/regions.md). Its records
-- are decided by the instances (src/backend/redis/regions/global.rs, with the protocol of
-- src/algo/regions.rs); this script reads them with the store's clock, and writes each only if
-- it still holds what was read (a compare-and-set: an instance that lost a race decides that
-- key again in the next period).
--
-- ARGV[1] 'read': returns {now, then each key's value ('' for none or not a string)}.
-- ARGV[1] 'cas', then per key: the value read, the value to write ('' deletes the key), its
--         time to live in milliseconds (0: none). Returns {now, then per key 1 when written}.
local t = redis.call('TIME')
local out = {t[1] * 1000000 + t[2]}
local function value(key)
  local v = redis.pcall('GET', key)
  if type(v) ~= 'string' then return '' end
  return v
end
if ARGV[1] == 'read' then
  for i = 1, #KEYS do out[i + 1] = value(KEYS[i]) end
  return out
end
if ARGV[1] ~= 'cas' or #ARGV ~= 1 + 3 * #KEYS then
  return redis.error_reply('tower-ratelimits: unknown call of the global store script')
end
for i = 1, #KEYS do
  local b = 1 + (i - 1) * 3
  local new, ttl = ARGV[b + 2], tonumber(ARGV[b + 3])
  if value(KEYS[i]) == ARGV[b + 1] then
    if new == '' then
      redis.call('DEL', KEYS[i])
    elseif ttl and ttl > 0 then
      redis.call('SET', KEYS[i], new, 'PX', ttl)
    else
      redis.call('SET', KEYS[i], new)
    end
    out[i + 1] = 1
  else
    out[i + 1] = 0
  end
end
return out
