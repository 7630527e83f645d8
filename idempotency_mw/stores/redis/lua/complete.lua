-- KEYS[1] record; ARGV token, ttl ms, channel, digest, status, [response status, packed
-- headers, body]. Returns 1 if recorded, and then publishes the digest on the channel.
local key, token, ttl, status = KEYS[1], ARGV[1], tonumber(ARGV[2]), ARGV[5]
local r = redis.call('HMGET', key, 'status', 'token')
if r[2] ~= token then return 0 end
-- Settled as this completion would: only its own earlier delivery, whose reply was lost.
if r[1] == status then return 1 end
if r[1] ~= 'in_progress' then return 0 end
local now = now_ms()
redis.call('HSET', key, 'status', status, 'lease_expires_at', int(now),
    'expires_at', int(now + ttl))
if status == 'completed' then
    redis.call('HSET', key, 'response_status', ARGV[6], 'response_headers', ARGV[7],
        'result_payload', ARGV[8])
end
redis.call('PEXPIRE', key, int(ttl))
redis.call('PUBLISH', ARGV[3], ARGV[4])
return 1
