--[[
renew_gate: the holder of a rollout's gate keeps its lease while its audit round runs. A round (cold and
warm completions on each replica, twice when a fault is to be confirmed) may outlast the lease on a busy
fleet; the holder's ticks wait for it, so without this another kvgate would take the gate over mid-round.
It asks for no turn: no round is started, the last round's start stays.
Needs lua/lib/common.lua prepended (kvgate does; `kvgate script renew_gate` prints both).

KEYS[1]  kvg:{ID}:gate:<candidate digest>   hash: holder, until_ms, round_ms (lua/take_gate_turn.lua)
ARGV[1]  gateway id      ARGV[2] now (ms)      ARGV[3] lease time to live (ms)
ARGV[4]  interval (ms): the key lives a lease and an interval past the last write, as take_gate_turn's

Returns CODE.CHANGED (renewed) or CODE.UNCHANGED (this gateway does not hold it: another took it, or it
was let go of; nothing written); {CODE.MALFORMED, why} when refused, nothing written (lua/lib/common.lua).
]]
local numbers = {{2, 'now (ms)'}, {3, 'lease time to live (ms)'}, {4, 'interval (ms)'}}
local why = odd_args(numbers) or odd_type(KEYS[1], 'hash')
if why then
  return refuse(why)
end
if redis.call('HGET', KEYS[1], 'holder') ~= ARGV[1] then
  return CODE.UNCHANGED
end
local now, ttl, interval = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('HSET', KEYS[1], 'until_ms', now + ttl)
redis.call('PEXPIRE', KEYS[1], ttl + interval)
return CODE.CHANGED
