--[[
release_lock: drop the single-flight load lock, only if this owner still holds it.

KEYS[1]  kvg:{ID}:lock:<versioned name>@<replica URL>
ARGV[1]  owner token

Returns 1 if released, 0 if the lock had expired or belongs to another owner; {CODE.MALFORMED, why}
when refused, nothing written (lua/lib/common.lua, prepended).
]]
local why = odd_type(KEYS[1], 'string')
if why then
  return refuse(why)
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
