-- KEYS[1] record; ARGV token. Returns 1 if deleted.
local r = redis.call('HMGET', KEYS[1], 'status', 'token')
if r[1] ~= 'in_progress' or r[2] ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
