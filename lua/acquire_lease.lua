--[[
acquire_lease: this gateway starts using a versioned name on a replica (its first request there since
it last let the lease go); refused while an unload of that name is in progress.
Needs lua/lib/common.lua prepended (kvgate does; `kvgate script acquire_lease` prints both).

KEYS[1]  kvg:leases:{REPLICA}   hash: NAME|GATEWAY -> expiry (ms), NAME|!unloading -> expiry (ms)
ARGV[1]  versioned name      ARGV[2] gateway id     ARGV[3] now (ms)    ARGV[4] lease time to live (ms)

Returns CODE.CHANGED (the lease is held until now + ttl; the heartbeat refreshes it) or CODE.UNLOADING;
{CODE.MALFORMED, why} when refused, nothing written (lua/lib/common.lua).
]]
local why = odd_args({{3, 'now (ms)'}, {4, 'lease time to live (ms)'}}) or odd_type(KEYS[1], 'hash')
if why then
  return refuse(why)
end
local name, owner, now, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local unloading = stored_ms(redis.call('HGET', KEYS[1], lease_field(name, UNLOADING_MARK)))
if unloading and unloading > now then
  return CODE.UNLOADING
end
redis.call('HSET', KEYS[1], lease_field(name, owner), now + ttl)
return CODE.CHANGED
