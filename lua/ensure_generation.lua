--[[
ensure_generation: read the epoch table's generation id, creating it when the table is empty.
A Redis that comes back without its data gets a new generation, and every kvgate snapshot built on
the old one is flushed (epochs restart, so the generation is part of every cache namespace).

KEYS[1]  kvg:generation
ARGV[1]  candidate generation (random hex)

Returns the generation in force; {CODE.MALFORMED, why} when refused, nothing written (lua/lib/common.lua,
prepended).
]]
local why = odd_type(KEYS[1], 'string')
if why then
  return refuse(why)
end
redis.call('SET', KEYS[1], ARGV[1], 'NX')
return redis.call('GET', KEYS[1])
