--[[
end_unload: an unload of a versioned name on a replica is over (done or failed): drop its claim, every
lease field left on the name (they lease a name the replica no longer has) and its shared last use.
Needs lua/lib/common.lua prepended (kvgate does; `kvgate script end_unload` prints both).

KEYS[1]  kvg:leases:{REPLICA}    KEYS[2] kvg:last-use:{REPLICA}
ARGV[1]  versioned name          ARGV[2] unloaded (1) or failed (0): on failure only the claim goes

Returns CODE.CHANGED; {CODE.MALFORMED, why} when refused, nothing written (lua/lib/common.lua).
]]
local why = odd_types({{KEYS[1], 'hash'}, {KEYS[2], 'hash'}})
if why then
  return refuse(why)
end
local name, unloaded = ARGV[1], ARGV[2] == '1'
if not unloaded then
  redis.call('HDEL', KEYS[1], lease_field(name, UNLOADING_MARK))
  return CODE.CHANGED
end
local prefix = name .. '|'
for _, field in ipairs(redis.call('HKEYS', KEYS[1])) do
  if string.sub(field, 1, string.len(prefix)) == prefix then
    redis.call('HDEL', KEYS[1], field)
  end
end
redis.call('HDEL', KEYS[2], name)
return CODE.CHANGED
