-- KEYS[1] record; ARGV token, channel, digest. Returns 1 if deleted, and then publishes the
-- digest on the channel.
local r = redis.call('HMGET', KEYS[1], 'status', 'token')
if r[1] ~= 'in_progress' or r[2] ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[2], ARGV[3])
return 1
