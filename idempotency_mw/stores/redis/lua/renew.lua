-- KEYS[1] record; ARGV token, lease ms. Returns 1 if renewed.
local key, token, lease = KEYS[1], ARGV[1], tonumber(ARGV[2])
local r = redis.call('HMGET', key, 'status', 'token', 'expires_at')
if r[1] ~= 'in_progress' or r[2] ~= token then return 0 end
local now = now_ms()
local lease_end = now + lease
redis.call('HSET', key, 'lease_expires_at', int(lease_end))
-- While in progress the key outlives both the lease and the TTL.
redis.call('PEXPIRE', key, int(math.max((tonumber(r[3]) or 0) - now, lease, 1)))
return 1
