--[[
refresh_leases: a gateway's heartbeat on one replica: the leases it still holds live on, the ones it let
go are dropped, and the last use of each name it served is shared (the fleet's LRU order).
Needs lua/lib/common.lua prepended (kvgate does; `kvgate script refresh_leases` prints both).

KEYS[1]  kvg:leases:{REPLICA}    hash: NAME|GATEWAY -> expiry (ms)
KEYS[2]  kvg:last-use:{REPLICA}  hash: NAME -> last use (ms, wall clock), the newest any gateway saw
ARGV[1]  gateway id      ARGV[2] now (ms)      ARGV[3] lease time to live (ms)
ARGV[4]  since (ms): when the heartbeat began; a lease of this gateway that is not held is dropped only
         if it was written before then (one acquired meanwhile, for a new request, stays)
ARGV[5]  number of names N, then N triples: versioned name, its last use here (ms), keep (1: still in
         use, the lease lives on; 0: only report the last use, the lease is let go)

Returns CODE.CHANGED; {CODE.MALFORMED, why} when refused, nothing written (lua/lib/common.lua).
]]
local numbers = {{2, 'now (ms)'}, {3, 'lease time to live (ms)'}, {4, 'since (ms)'}, {5, 'number of names'}}
local why = odd_args(numbers) or odd_types({{KEYS[1], 'hash'}, {KEYS[2], 'hash'}})
if not why then
  for i = 1, tonumber(ARGV[5]) do
    why = why or odd_arg(4 + 3 * i, 'last use (ms)')
  end
end
if why then
  return refuse(why)
end
local owner, now, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local since, held = tonumber(ARGV[4]), tonumber(ARGV[5])
local keep = {}
for i = 1, held do
  local name, used, live = ARGV[3 + 3 * i], tonumber(ARGV[4 + 3 * i]), ARGV[5 + 3 * i] == '1'
  if live then
    keep[lease_field(name, owner)] = true
    redis.call('HSET', KEYS[1], lease_field(name, owner), now + ttl)
  end
  local shared = stored_ms(redis.call('HGET', KEYS[2], name))
  if used > 0 and (not shared or used > shared) then
    redis.call('HSET', KEYS[2], name, used)
  end
end
local suffix = '|' .. owner
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  local field, expiry = fields[i], stored_ms(fields[i + 1]) or 0  -- a malformed expiry: expired
  if string.sub(field, -string.len(suffix)) == suffix and not keep[field] and expiry < since + ttl then
    redis.call('HDEL', KEYS[1], field)
  end
end
return CODE.CHANGED
