--[[
record_loaded: record what one replica reports as loaded (versioned name -> root path), atomically.
Needs lua/lib/common.lua prepended (kvgate does; `kvgate script record_loaded` prints both).

KEYS[1]  kvg:replica:{URL}:loaded   string: canonical JSON object {versioned name: root path}
ARGV[1]  replica URL         ARGV[2] canonical JSON of the loaded set (sorted keys)
ARGV[3]  time to live (ms): a replica that no kvgate polls any more fades out
ARGV[4]  hint channel        ARGV[5] replica hint prefix (the hint is this prefix, then the URL)

Returns:
  CODE.CHANGED    the loaded set changed (a hint was published)
  CODE.UNCHANGED  only the TTL was refreshed
  {CODE.MALFORMED, why}  refused, nothing written (lua/lib/common.lua)
]]
local why = odd_arg(3, 'time to live (ms)') or odd_type(KEYS[1], 'string')
if why then
  return refuse(why)
end
local previous = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
if previous == ARGV[2] then
  return CODE.UNCHANGED
end
redis.call('PUBLISH', ARGV[4], ARGV[5] .. ARGV[1])
return CODE.CHANGED
