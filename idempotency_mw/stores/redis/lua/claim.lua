-- KEYS[1] record; ARGV fingerprint, token, ttl ms, lease ms, binding.
-- Returns {'acquired'}, {'credential_mismatch'}, {outcome, expires at ms} or
-- {'replay', expires at ms, status, headers, body}.
local key, fingerprint, token = KEYS[1], ARGV[1], ARGV[2]
local ttl, lease, binding = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5] or ''
local now = now_ms()
local r = redis.call('HMGET', key, 'request_hash', 'status', 'token', 'lease_expires_at',
    'expires_at', 'caller_binding')
local hash, status, bound = r[1], r[2], r[6] or ''
-- The same call again (a client retry after a lost reply) still owns its fresh claim.
if status == 'in_progress' and r[3] == token then return {'acquired'} end
local take
if not status then
    take = true
else
    local lease_end, ttl_end = tonumber(r[4]) or 0, tonumber(r[5]) or 0
    if status == 'in_progress' then
        take = lease_end <= now and ((hash == fingerprint and bound == binding) or ttl_end <= now)
    else
        take = ttl_end <= now
    end
end
if take then
    redis.call('DEL', key)
    redis.call('HSET', key, 'request_hash', fingerprint, 'status', 'in_progress',
        'token', token, 'lease_expires_at', int(now + lease), 'expires_at', int(now + ttl),
        'caller_binding', binding)
    redis.call('PEXPIRE', key, int(math.max(ttl, lease, 1)))
    return {'acquired'}
end
if bound ~= binding then return {'credential_mismatch'} end
local expires = r[5] or '0'
if hash ~= fingerprint then return {'mismatch', expires} end
if status == 'completed' then
    local s = redis.call('HMGET', key, 'response_status', 'response_headers', 'result_payload')
    return {'replay', expires, s[1] or '0', s[2] or '', s[3] or ''}
end
if status == 'unreplayable' then return {'unreplayable', expires} end
return {'in_progress', expires}
