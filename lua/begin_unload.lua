--[[
begin_unload: claim a versioned name on a replica for unloading, only when no other live gateway leases
it (or when FORCE: a drain that ran past its bound); the claiming gateway checks its own requests itself.
While the claim lives, acquire_lease refuses the name.
Needs lua/lib/common.lua prepended (kvgate does; `kvgate script begin_unload` prints both).

KEYS[1]  kvg:leases:{REPLICA}   hash: NAME|GATEWAY -> expiry (ms), NAME|!unloading -> expiry (ms)
ARGV[1]  versioned name      ARGV[2] now (ms)      ARGV[3] claim time to live (ms)     ARGV[4] force (0/1)
ARGV[5]  the claiming gateway's id

Returns {code, live leases}: CODE.CHANGED (claimed; unload, then end_unload), CODE.LEASED (not claimed),
CODE.UNLOADING (another gateway's unload is in progress); {CODE.MALFORMED, why} when refused, nothing
written (lua/lib/common.lua).
]]
local why = odd_args({{2, 'now (ms)'}, {3, 'claim time to live (ms)'}}) or odd_type(KEYS[1], 'hash')
if why then
  return refuse(why)
end
local name, now, ttl, force, owner = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4] == '1', ARGV[5]
local claimed = stored_ms(redis.call('HGET', KEYS[1], lease_field(name, UNLOADING_MARK)))
if claimed and claimed > now then
  return {CODE.UNLOADING, 0}
end
local live = live_leases(KEYS[1], name, owner, now)
if live > 0 and not force then
  return {CODE.LEASED, live}
end
redis.call('HSET', KEYS[1], lease_field(name, UNLOADING_MARK), now + ttl)
return {CODE.CHANGED, live}
