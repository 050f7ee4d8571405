-- Replace the in-flight claim on KEYS[1] with the completed record ARGV[2],
-- kept ARGV[3] milliseconds, if lease token ARGV[1] holds the claim.
-- Reply: 1 stored, 0 not the holder (fenced).
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[2] then
  return 1 -- this very completion, applied by an earlier attempt whose reply was lost
end
if not cur or string.byte(cur, 1) ~= 105 or string.sub(cur, 34, 49) ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
