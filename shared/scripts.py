"""The Redis protocol's atomic steps as Lua scripts (see docs/redis-protocol.md)."""

# Client submit with a bounded queue and a bound per client. KEYS: stream, client set, stream registry. ARGV:
# group, max waiting, version, request id, request JSON, max per client (0: none), seconds a request may hold its
# client slot. The stream is the shared one or a replica's own (routing); a new one gets the group and is
# registered, so every replica's claims and steals find it. Waiting = entries of that stream not yet delivered to a
# replica (XLEN minus the group's pending count; done entries are deleted).
# The client set holds the client's unfinished request ids scored by expiry (server time), so a request whose
# finish never came (a lost Redis entry) frees its slot by itself; the finish script removes the id.
SUBMIT = """
local limit = tonumber(ARGV[6])
local now = tonumber(redis.call('TIME')[1])
if limit > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  local busy = redis.call('ZCARD', KEYS[2])
  if busy >= limit then return {2, tostring(busy)} end
end
if redis.call('EXISTS', KEYS[1]) == 0 then
  pcall(redis.call, 'XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')
end
redis.call('SADD', KEYS[3], KEYS[1])
local ok, pending = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1])
local inflight = 0
if ok then inflight = tonumber(pending[1]) end
local waiting = redis.call('XLEN', KEYS[1]) - inflight
if waiting >= tonumber(ARGV[2]) then return {0, tostring(waiting)} end
local id = redis.call('XADD', KEYS[1], '*', 'v', ARGV[3], 'id', ARGV[4], 'data', ARGV[5])
if limit > 0 then
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[7]), ARGV[4])
  redis.call('EXPIRE', KEYS[2], tonumber(ARGV[7]))
end
return {1, id}
"""

# Replica finish. KEYS: result, events channel, stream, owner, client set. ARGV: group, entry id, terminal event
# JSON, ttl s, request id. SET result NX (first finisher wins: exactly one completion), PUBLISH it only then,
# ACK + delete the entry, free the client's slot.
FINISH = """
local won = redis.call('SET', KEYS[1], ARGV[3], 'NX', 'EX', ARGV[4])
if won then redis.call('PUBLISH', KEYS[2], ARGV[3]) end
pcall(redis.call, 'XACK', KEYS[3], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[3], ARGV[2])
redis.call('DEL', KEYS[4])
redis.call('ZREM', KEYS[5], ARGV[5])
return won and 1 or 0
"""

# Replica heartbeat. KEYS: stream. ARGV: group, replica, owner key prefix, owner ttl ms, then (entry id, request id)*.
# XCLAIM our own pending entries to ourselves (resets their idle time, so nobody reclaims them) and refresh the
# owner keys; return the request ids another replica claimed meanwhile. An entry Redis no longer knows (after a
# restart) keeps its owner key, so clients keep waiting for its result.
HEARTBEAT = """
local lost = {}
for i = 5, #ARGV, 2 do
  local ok, p = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if ok and p[1] and p[1][2] ~= ARGV[2] then
    table.insert(lost, ARGV[i + 1])
  else
    if ok and p[1] then redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID') end
    redis.call('SET', ARGV[3] .. ARGV[i + 1], ARGV[2], 'PX', ARGV[4])
  end
end
return lost
"""

# Forget a group consumer that is gone: nothing pending, idle at least ARGV[3] ms, no replica heartbeat key.
# KEYS: stream, the consumer's replica key. ARGV: group, consumer, min idle ms. Returns 1 if it was removed.
# Checked and deleted in one step, so a consumer that reads meanwhile cannot lose its pending entries.
REMOVE_DEAD_CONSUMER = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local f = {}
  for i = 1, #c, 2 do f[c[i]] = c[i + 1] end
  if f['name'] == ARGV[2] then
    if tonumber(f['pending']) == 0 and tonumber(f['idle']) >= tonumber(ARGV[3]) then
      redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
      return 1
    end
    return 0
  end
end
return 0
"""

# Forget a gone replica's own request stream once it is empty. KEYS: the stream, its replica's heartbeat key, the
# stream registry. Returns 1 if it was removed. A router that still routes there re-creates it with the submit
# script, and the other replicas then steal what it holds (its replica has no heartbeat).
REMOVE_ORPHAN_STREAM = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
if redis.call('XLEN', KEYS[1]) > 0 then return 0 end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[3], KEYS[1])
return 1
"""

# Prefill/decode hand-over: move a prefilled request from the prefill replica's stream to the decode side's.
# KEYS: from stream, to stream, owner key, attempt key, stream registry. ARGV: group, entry id, version, request id,
# request JSON, KV transfer handle, prefill replica. One step, so the request is in exactly one stream whatever
# fails; the attempt counter goes back one, so the decode side's pickup is the same attempt (clients see one run).
HANDOVER = """
if redis.call('EXISTS', KEYS[2]) == 0 then
  pcall(redis.call, 'XGROUP', 'CREATE', KEYS[2], ARGV[1], '0', 'MKSTREAM')
end
redis.call('SADD', KEYS[5], KEYS[2])
local id = redis.call('XADD', KEYS[2], '*', 'v', ARGV[3], 'id', ARGV[4], 'data', ARGV[5], 'kvx', ARGV[6],
                      'from', ARGV[7])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('DEL', KEYS[3])
if tonumber(redis.call('GET', KEYS[4]) or '0') > 0 then redis.call('DECR', KEYS[4]) end
return id
"""
