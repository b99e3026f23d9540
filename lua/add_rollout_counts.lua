--[[
add_rollout_counts: one kvgate worker adds what its own traffic of a running rollout counted since its
last call (requests, errors, time to first byte, per role) to the rollout's fleet-wide figures, which
the rollout gate judges. Counts only grow; the key lives on for ARGV[1] ms after the last add.
Needs lua/lib/common.lua prepended (kvgate does; `kvgate script add_rollout_counts` prints both).

KEYS[1]  kvg:{ID}:rollout-counts:<candidate digest>   hash: ROLE:FIGURE -> a whole number (ROLE current
         or candidate; FIGURE requests, errors, first_bytes, first_byte_us)
ARGV[1]  time to live (ms)      ARGV[2] number of fields N, then N pairs: field, amount to add (>= 0)

Returns CODE.CHANGED; {CODE.MALFORMED, why} when refused, nothing written (lua/lib/common.lua).
]]
local why = odd_args({{1, 'time to live (ms)'}, {2, 'number of fields'}}) or odd_type(KEYS[1], 'hash')
local fields = tonumber(ARGV[2]) or 0
if not why and #ARGV ~= 2 + 2 * fields then
  why = 'ARGV holds ' .. (#ARGV - 2) .. ' values after the count, not ' .. fields .. ' pairs'
end
for i = 1, fields do
  why = why or odd_arg(2 + 2 * i, 'amount to add')
  local name = ARGV[1 + 2 * i]
  if not why then
    why = odd_count(KEYS[1], name, redis.call('HGET', KEYS[1], name), EXACT, '2^53')
  end
end
if why then
  return refuse(why)
end
for i = 1, fields do
  redis.call('HINCRBY', KEYS[1], ARGV[1 + 2 * i], ARGV[2 + 2 * i])
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return CODE.CHANGED
