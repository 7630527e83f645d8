-- KEYS[1] record; ARGV[1] the version the operator saw (SHA-1 of token, a space, status).
-- Deletes the record only while it is as it was read; returns 1 if deleted.
local r = redis.call('HMGET', KEYS[1], 'token', 'status')
if not r[1] or not r[2] or redis.sha1hex(r[1] .. ' ' .. r[2]) ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
