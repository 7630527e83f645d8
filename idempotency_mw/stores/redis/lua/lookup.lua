-- KEYS[1] record; ARGV[1] the caller's binding. Returns {now} when the caller has no record
-- (none, or one bound to other credentials), else {now, status, lease_expires_at, expires_at
-- [, response status, headers, body]} (the response of a completed record). Reads only.
local key = KEYS[1]
local now = int(now_ms())
local r = redis.call('HMGET', key, 'status', 'lease_expires_at', 'expires_at', 'caller_binding')
if not r[1] or (r[4] or '') ~= ARGV[1] then return {now} end
local reply = {now, r[1], r[2] or '0', r[3] or '0'}
if r[1] == 'completed' then
    local s = redis.call('HMGET', key, 'response_status', 'response_headers', 'result_payload')
    reply[5], reply[6], reply[7] = s[1] or '0', s[2] or '', s[3] or ''
end
return reply
