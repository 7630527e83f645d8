-- KEYS[1] record; ARGV[1] the caller's binding. Returns the record and the clock as the claim
-- script does, {now} when the caller has none (none, or one bound to other credentials).
-- Reads only.
local key = KEYS[1]
local now = int(now_ms())
local r = redis.call('HMGET', key, 'request_hash', 'status', 'token', 'lease_expires_at',
    'expires_at', 'caller_binding')
if not r[2] or (r[6] or '') ~= ARGV[1] then return {now} end
local found = {now, r[1] or '', r[2], r[3] or '', r[4] or '0', r[5] or '0', r[6] or ''}
if r[2] == 'completed' then
    local s = redis.call('HMGET', key, 'response_status', 'response_headers', 'result_payload')
    found[8], found[9], found[10] = s[1] or '0', s[2] or '', s[3] or ''
end
return found
