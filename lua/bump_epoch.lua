--[[
bump_epoch: move a logical ID to a new epoch without changing its version, atomically.
The epoch is part of the cache namespace (cache_salt), so a bump invalidates that ID's prefix cache.
Needs lua/lib/common.lua prepended (kvgate does; `kvgate script bump_epoch` prints both).

KEYS[1]  kvg:{epochs}:state:ID     KEYS[2] kvg:{epochs}:history:ID
KEYS[3]  the change log      KEYS[4] its rows hash   KEYS[5] its check hash (lua/lib/common.lua)
ARGV[1]  logical ID          ARGV[2] now (ms)    ARGV[3] log entries kept    ARGV[4] history length kept

An operator can run it straight through Redis:
  kvgate script bump_epoch > /tmp/bump_epoch.lua
  redis-cli --eval /tmp/bump_epoch.lua 'kvg:{epochs}:state:tenant-42' 'kvg:{epochs}:history:tenant-42' \
            'kvg:{epochs}:log' 'kvg:{epochs}:rows' 'kvg:{epochs}:check' , tenant-42 "$(date +%s%3N)" 10000 100

Returns {code, epoch}:
  CODE.CHANGED             bumped (logged)
  CODE.NO_CURRENT_VERSION  the logical ID has no current version
  CODE.MALFORMED           refused, nothing written (lua/lib/common.lua: {code, why})
]]
local why = odd_logged({{KEYS[1], 'hash'}, {KEYS[2], 'list'}}, KEYS[3], KEYS[4], KEYS[5],
  {{2, 'now (ms)'}, {3, 'log entries kept'}, {4, 'history length kept'}})
if why then
  return refuse(why)
end
local current = redis.call('HMGET', KEYS[1], 'digest', 'base', 'epoch')
if not current[1] then
  return {CODE.NO_CURRENT_VERSION, 0}
end
why = odd_epoch(KEYS[1], current[3])
if why then
  return refuse(why)
end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'updated_ms', ARGV[2])
append_history(KEYS[2], ARGV[4], epoch, current[1], current[2], 'bump', ARGV[2])
log_change(KEYS[1], KEYS[3], KEYS[4], KEYS[5], ARGV[1], 'bump', ARGV[3])
return {CODE.CHANGED, epoch}
