-- Shared by the scripts that read the clock. Server time keeps leases independent of worker
-- clocks; TIME is non-deterministic, so servers older than 5.0 must be told to replicate
-- effects, not scripts. string.format('%d') writes integers: Redis would otherwise format
-- Lua numbers as floats.
if redis.replicate_commands then redis.replicate_commands() end
local function now_ms()
    local t = redis.call('TIME')
    return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function int(n) return string.format('%d', n) end
