--[[
rollback_version: point a logical ID back at an earlier published version (a new epoch), atomically.

KEYS[1]  kvg:{ID}:state     KEYS[2] kvg:{ID}:versions     KEYS[3] kvg:{ID}:history
ARGV[1]  logical ID
ARGV[2]  target digest, or a unique prefix of one (>= 8 hex), or '' for the version current before this one
ARGV[3]  now (ms)            ARGV[4] hint channel          ARGV[5] history length kept

Returns {code, epoch, digest}:
   1  rolled back: the target is current under a new epoch (a hint was published)
   0  unchanged: the target is already current
  -1  the logical ID has no current version
  -2  no such version (never published here, or no earlier version to go back to)
  -3  the digest prefix matches more than one version
]]
local id, wanted, now = ARGV[1], ARGV[2], ARGV[3]
local current = redis.call('HGET', KEYS[1], 'digest')
if not current then
  return {-1, 0, ''}
end
local target = nil
if wanted == '' then
  for _, raw in ipairs(redis.call('LRANGE', KEYS[3], 0, -1)) do
    local event = cjson.decode(raw)
    if event.digest ~= current then
      target = event.digest
      break
    end
  end
else
  for _, digest in ipairs(redis.call('HKEYS', KEYS[2])) do
    if string.sub(digest, 1, string.len(wanted)) == wanted then
      if target then
        return {-3, 0, ''}
      end
      target = digest
    end
  end
end
local record = target and redis.call('HGET', KEYS[2], target)
if not record then
  return {-2, 0, ''}
end
if target == current then
  return {0, tonumber(redis.call('HGET', KEYS[1], 'epoch')), target}
end
local version = cjson.decode(record)
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'digest', target, 'name', version.name, 'path', version.path,
  'base', version.base, 'updated_ms', now)
redis.call('LPUSH', KEYS[3], cjson.encode({epoch = epoch, digest = target, action = 'rollback', at_ms = tonumber(now)}))
redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[5]) - 1)
redis.call('PUBLISH', ARGV[4], id)
return {1, epoch, target}
