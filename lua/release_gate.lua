--[[
release_gate: a kvgate that stops (drains) lets go of a rollout's gate it holds, so another takes it at
its next tick rather than after the lease's time to live. The last round's start stays: the fleet's
interval between audit rounds holds across the hand-over.
Needs lua/lib/common.lua prepended (kvgate does; `kvgate script release_gate` prints both).

KEYS[1]  kvg:{ID}:gate:<candidate digest>   hash: holder, until_ms, round_ms (lua/take_gate_turn.lua)
ARGV[1]  gateway id

Returns CODE.CHANGED (let go) or CODE.UNCHANGED (this gateway did not hold it); {CODE.MALFORMED, why}
when refused, nothing written (lua/lib/common.lua).
]]
local why = odd_type(KEYS[1], 'hash')
if why then
  return refuse(why)
end
if redis.call('HGET', KEYS[1], 'holder') ~= ARGV[1] then
  return CODE.UNCHANGED
end
redis.call('HDEL', KEYS[1], 'holder', 'until_ms')
return CODE.CHANGED
