-- Complete the in-flight claim on KEYS[1] if lease token ARGV[1] holds it.
-- ARGV[2] state ('r' response, 'u' unreplayable), ARGV[3] status,
-- ARGV[4] created at (ms), ARGV[5] retention in milliseconds,
-- ARGV[6] header block, ARGV[7] body (both only for 'r').
-- Reply: 1 stored, 0 not the holder (fenced).
local key = KEYS[1]
local cur = redis.call('HMGET', key, 's', 't')
if cur[1] ~= 'i' or cur[2] ~= ARGV[1] then
  return 0
end
if ARGV[2] == 'r' then
  redis.call('HSET', key, 's', 'r', 'st', ARGV[3], 'ca', ARGV[4], 'h', ARGV[6], 'b', ARGV[7])
else
  redis.call('HSET', key, 's', 'u', 'st', ARGV[3], 'ca', ARGV[4])
end
redis.call('HDEL', key, 't')
redis.call('PEXPIRE', key, ARGV[5])
return 1
