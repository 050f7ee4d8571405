-- Delete the in-flight claim on KEYS[1] if lease token ARGV[1] holds it.
-- Reply: 1 released, 0 not the holder.
local cur = redis.call('GET', KEYS[1])
if not cur or string.byte(cur, 1) ~= 105 or string.sub(cur, 34, 49) ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
