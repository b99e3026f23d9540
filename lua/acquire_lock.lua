--[[
acquire_lock: take the single-flight lock for loading one version on one replica.

KEYS[1]  kvg:{ID}:lock:<versioned name>@<replica URL>
ARGV[1]  owner token (random per attempt)    ARGV[2] time to live (ms)

Returns 1 if this owner now holds the lock (also when it already did), 0 if someone else holds it;
{CODE.MALFORMED, why} when refused, nothing written (lua/lib/common.lua, prepended).
]]
local why = odd_arg(2, 'time to live (ms)') or odd_type(KEYS[1], 'string')
if why then
  return refuse(why)
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 1
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
