-- Extend the in-flight claim on KEYS[1] if lease token ARGV[1] holds it.
-- ARGV[2] lease in milliseconds; ARGV[3] the new deadline (8 bytes), written
-- in place. Reply: 1 extended, 0 not the holder.
local cur = redis.call('GET', KEYS[1])
if not cur or string.byte(cur, 1) ~= 105 or string.sub(cur, 34, 49) ~= ARGV[1] then
  return 0
end
redis.call('SETRANGE', KEYS[1], 49, ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
