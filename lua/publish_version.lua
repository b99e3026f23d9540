--[[
publish_version: make DIGEST the current version of a logical ID (a new epoch), atomically.

KEYS[1]  kvg:{ID}:state     hash: digest, name, path, base, epoch, updated_ms
KEYS[2]  kvg:{ID}:versions  hash: digest -> JSON {name, path, base, published_ms}
KEYS[3]  kvg:{ID}:history   list of JSON events, newest first
ARGV[1]  logical ID          ARGV[2] digest        ARGV[3] versioned name
ARGV[4]  store path          ARGV[5] base identity ARGV[6] now (ms)
ARGV[7]  hint channel        ARGV[8] history length kept

Returns {code, epoch}:
   1  published: DIGEST is current under a new epoch (a hint was published)
   0  unchanged: DIGEST with the same base was already current (no write, no hint)
]]
local id, digest, name, path, base, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local current = redis.call('HMGET', KEYS[1], 'digest', 'base', 'epoch')
if current[1] == digest and current[2] == base then
  return {0, tonumber(current[3])}
end
redis.call('HSETNX', KEYS[2], digest,
  cjson.encode({name = name, path = path, base = base, published_ms = tonumber(now)}))
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'digest', digest, 'name', name, 'path', path, 'base', base, 'updated_ms', now)
redis.call('LPUSH', KEYS[3], cjson.encode({epoch = epoch, digest = digest, action = 'publish', at_ms = tonumber(now)}))
redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[8]) - 1)
redis.call('PUBLISH', ARGV[7], id)
return {1, epoch}
