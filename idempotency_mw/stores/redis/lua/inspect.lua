-- KEYS[1] record; ARGV[1] '1' to read the body too. Returns {now} when there is no record,
-- else {now, status, token, request_hash, lease_expires_at, expires_at, response_status,
-- body length[, body]}. Reads only: the operator's look, in one step with the clock.
local key = KEYS[1]
local now = int(now_ms())
local r = redis.call('HMGET', key, 'status', 'token', 'request_hash', 'lease_expires_at',
    'expires_at', 'response_status')
if not r[1] or not r[2] then return {now} end
local reply = {now, r[1], r[2], r[3] or '', r[4] or '0', r[5] or '0', r[6] or '',
    redis.call('HSTRLEN', key, 'result_payload')}
if ARGV[1] == '1' then reply[9] = redis.call('HGET', key, 'result_payload') or '' end
return reply
