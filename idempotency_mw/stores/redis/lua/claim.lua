-- KEYS[1] record; ARGV fingerprint, token, ttl ms, lease ms, binding, first sent ms ('' for
-- none), first-sent skew ms.
-- Takes the key when it is free, and then returns {'taken'}; else returns the record and the
-- clock for decide() (outcome.py) to decide: {now, request_hash, status, token,
-- lease_expires_at, expires_at, binding[, response status, headers, body]} ({now} for none).
-- Free is decide()'s rule, here so that the take is atomic: expired, or the same request's
-- lease lapsed; and not first sent longer ago than ttl (or ahead of the skew).
local key, fingerprint, token = KEYS[1], ARGV[1], ARGV[2]
local ttl, lease, binding = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5] or ''
local now = now_ms()
local r = redis.call('HMGET', key, 'request_hash', 'status', 'token', 'lease_expires_at',
    'expires_at', 'caller_binding')
local hash, status, bound = r[1], r[2], r[6] or ''
local lease_end, ttl_end = tonumber(r[4]) or 0, tonumber(r[5]) or 0
local free = not status
if status then
    local in_progress = status == 'in_progress'
    local live = in_progress and lease_end > now
    free = (ttl_end <= now and not live)
        or (in_progress and not live and r[3] ~= token and hash == fingerprint and bound == binding)
end
local sent = tonumber(ARGV[6])
if free and sent and not (now - ttl <= sent and sent <= now + tonumber(ARGV[7])) then
    free = false
end
if free then
    redis.call('DEL', key)
    redis.call('HSET', key, 'request_hash', fingerprint, 'status', 'in_progress',
        'token', token, 'lease_expires_at', int(now + lease), 'expires_at', int(now + ttl),
        'caller_binding', binding)
    redis.call('PEXPIRE', key, int(math.max(ttl, lease, 1)))
    return {'taken'}
end
if not status then return {int(now)} end
local found = {int(now), hash or '', status, r[3] or '', r[4] or '0', r[5] or '0', bound}
if status == 'completed' then
    local s = redis.call('HMGET', key, 'response_status', 'response_headers', 'result_payload')
    found[8], found[9], found[10] = s[1] or '0', s[2] or '', s[3] or ''
end
return found
