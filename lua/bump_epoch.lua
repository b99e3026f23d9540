--[[
bump_epoch: move a logical ID to a new epoch without changing its version, atomically.
The epoch is part of the cache namespace (cache_salt), so a bump invalidates that ID's prefix cache.

KEYS[1]  kvg:{ID}:state     KEYS[2] kvg:{ID}:history
ARGV[1]  logical ID          ARGV[2] now (ms)    ARGV[3] hint channel    ARGV[4] history length kept

An operator can run it straight through Redis:
  redis-cli --eval lua/bump_epoch.lua 'kvg:{tenant-42}:state' 'kvg:{tenant-42}:history' , \
            tenant-42 "$(date +%s%3N)" kvg:hints 100

Returns {code, epoch}:
   1  bumped (a hint was published)
  -1  the logical ID has no current version
]]
local digest = redis.call('HGET', KEYS[1], 'digest')
if not digest then
  return {-1, 0}
end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'updated_ms', ARGV[2])
redis.call('LPUSH', KEYS[2], cjson.encode({epoch = epoch, digest = digest, action = 'bump', at_ms = tonumber(ARGV[2])}))
redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[4]) - 1)
redis.call('PUBLISH', ARGV[3], ARGV[1])
return {1, epoch}
