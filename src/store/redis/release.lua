-- Delete the in-flight claim on KEYS[1] if lease token ARGV[1] holds it.
-- Reply: 1 released, 0 not the holder.
local cur = redis.call('HMGET', KEYS[1], 's', 't')
if cur[1] ~= 'i' or cur[2] ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
