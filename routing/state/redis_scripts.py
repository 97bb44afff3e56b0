"""The Lua scripts that make each shared-state change atomic in Redis (a script runs alone: no other client's
command interleaves). Times come from the Redis server's own clock, so replicas with skewed clocks agree."""

NOW = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
"""

# A bucket's level now: what it held, refilled by per_min a minute since, capped at per_min (full when unknown).
LEVEL = """
local function level_now(key, kind, per_min)
  local level, at = redis.call('HGET', key, kind .. ':l'), redis.call('HGET', key, kind .. ':t')
  if not level then return per_min end
  return math.min(per_min, tonumber(level) + math.max(0, now - tonumber(at)) * per_min / 60)
end
"""

# A replica's slot count for a tenant is stored as "count@seq": seq numbers the moment the replica read its own
# count (it counts every request it admitted or is admitting then). Writes travel on pooled connections and may
# reach Redis in another order than they were made, so a write older than the one stored is ignored, and so is one
# older than the replica's last sync (its floor: the sync set every count the replica had then). A count of 0 stays
# as a tombstone until the next sync, so an older, higher count arriving late cannot come back.
SLOTS = """
local function slot(value)
  local count, seq = string.match(value, '^(%d+)@(%d+)$')
  if count then return tonumber(count), tonumber(seq) end
  return tonumber(value) or 0, 0
end
local function put_slot(key, replica, count, seq, floor)
  if seq < floor then return false end
  local old = redis.call('HGET', key, replica)
  if old then
    local _, old_seq = slot(old)
    if seq < old_seq then return false end
  end
  redis.call('HSET', key, replica, count .. '@' .. string.format('%d', seq))
  redis.call('EXPIRE', key, 3600)
  return true
end
"""

# Concurrency is a hash per tenant, one field per replica: a replica that died stops counting as soon as its lease
# in kvgate:replicas lapses (its field is dropped then), so a crash never leaves phantom load.
#   KEYS: bucket hash, concurrency hash, replicas zset, this replica's set of tenants holding slots, its floor
#   ARGV: replica, max_concurrent (-1: none), n budgets, then n × (kind, per_min, cost), then the tenant, what
#   this replica already holds of it, and the seq of that count (its field is set to that plus one when admitted:
#   never incremented, so no count is applied twice)
# Returns: admitted, retry after, why, what the other live replicas hold of the tenant, each budget's level after.
ADMIT = NOW + LEVEL + SLOTS + """
local me = ARGV[1]
local max_concurrent = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local held_here = tonumber(ARGV[5 + 3 * n])
local seq = tonumber(ARGV[6 + 3 * n])
local floor = tonumber(redis.call('GET', KEYS[5]) or '0')
local elsewhere = 0
local levels = {}
local function answer(admitted, wait, why)
  local out = {admitted, wait, why, tostring(elsewhere)}
  for i = 0, n - 1 do out[#out + 1] = levels[i] and tostring(levels[i]) or '' end
  return out
end
if max_concurrent >= 0 then
  -- A count of this replica newer than this admit's already counts it (it was being admitted then).
  local mine = held_here + 1
  local fields = redis.call('HGETALL', KEYS[2])
  for i = 1, #fields, 2 do
    local count, at = slot(fields[i + 1])
    local lease = redis.call('ZSCORE', KEYS[3], fields[i])
    if fields[i] == me then
      if at > seq then mine = count end
    elseif lease and tonumber(lease) > now then
      elsewhere = elsewhere + count
    else
      redis.call('HDEL', KEYS[2], fields[i])
    end
  end
  if elsewhere + mine > max_concurrent then return answer(0, '1', 'max_concurrent') end
end
local wait, why = 0, ''
for i = 0, n - 1 do
  local kind, per_min = ARGV[4 + 3 * i], tonumber(ARGV[5 + 3 * i])
  local level = level_now(KEYS[1], kind, per_min)
  levels[i] = level
  if level < 1 then
    local w = (1 - level) * 60 / per_min + 0.001
    if w > wait then wait, why = w, kind end
  end
end
if why ~= '' then return answer(0, tostring(wait), why) end
for i = 0, n - 1 do
  local kind, cost = ARGV[4 + 3 * i], tonumber(ARGV[6 + 3 * i])
  levels[i] = levels[i] - cost
  redis.call('HSET', KEYS[1], kind .. ':l', tostring(levels[i]), kind .. ':t', tostring(now))
end
if n > 0 then redis.call('EXPIRE', KEYS[1], 3600) end
if max_concurrent >= 0 then
  put_slot(KEYS[2], me, held_here + 1, seq, floor)
  redis.call('SADD', KEYS[4], ARGV[4 + 3 * n])
  redis.call('EXPIRE', KEYS[4], 3600)
end
return answer(1, '0', '')
"""

#   KEYS: bucket hash   ARGV: kind, per_min, cost
CHARGE = NOW + LEVEL + """
local kind, per_min, cost = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('HSET', KEYS[1], kind .. ':l', tostring(level_now(KEYS[1], kind, per_min) - cost), kind .. ':t',
           tostring(now))
redis.call('EXPIRE', KEYS[1], 3600)
return 1
"""

#   KEYS: concurrency hash, the replica's floor   ARGV: replica, what it still holds of the tenant, that count's seq
RELEASE = SLOTS + """
local floor = tonumber(redis.call('GET', KEYS[2]) or '0')
put_slot(KEYS[1], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), floor)
return 1
"""

# One replica's heartbeat: renew its lease, publish its loads, concurrency, limits and request registry changes,
# collect aborts addressed to it, and read the fleet's loads, limits, kill switches and live replicas.
#   ARGV: prefix, replica, lease seconds, report (JSON, with `seq`: when its concurrency counts were read)
SYNC = NOW + SLOTS + """
local p, me, lease = ARGV[1], ARGV[2], tonumber(ARGV[3])
local report = cjson.decode(ARGV[4])
local lease_ms = math.ceil(lease * 1000)
redis.call('ZADD', p .. 'replicas', now + lease, me)
redis.call('ZREMRANGEBYSCORE', p .. 'replicas', '-inf', now)
local load_key = p .. 'load:' .. me
redis.call('DEL', load_key)
for url, count in pairs(report.loads) do redis.call('HSET', load_key, url, count) end
redis.call('PEXPIRE', load_key, lease_ms)
-- This replica's slot counts are what it reports, nothing else: a release or an admit whose answer was lost
-- is corrected here (tenants it no longer reports lose its field), unless a newer count of its own is already
-- there; a sync older than the last one applied (it timed out, then ran) changes no count.
local held_key = p .. 'conc_tenants:' .. me
local floor_key = p .. 'conc_floor:' .. me
local seq = tonumber(report.seq or 0)
if seq >= tonumber(redis.call('GET', floor_key) or '0') then
  redis.call('SET', floor_key, string.format('%d', seq), 'EX', 3600)
  for _, tenant in ipairs(redis.call('SMEMBERS', held_key)) do
    if not report.concurrency[tenant] then
      local key = p .. 'conc:' .. tenant
      local old = redis.call('HGET', key, me)
      local _, at = slot(old or '0')
      if at <= seq then
        redis.call('HDEL', key, me)
        redis.call('SREM', held_key, tenant)
      end
    end
  end
  for tenant, count in pairs(report.concurrency) do
    put_slot(p .. 'conc:' .. tenant, me, count, seq, 0)
    redis.call('SADD', held_key, tenant)
  end
  redis.call('EXPIRE', held_key, 3600)
end
local requests_key = p .. 'requests:' .. me
if report.snapshot then
  -- After a failed sync the changes since were dropped: the registry is replaced by what is in flight now.
  redis.call('DEL', requests_key)
  for id, count in pairs(report.snapshot) do redis.call('HSET', requests_key, id, count) end
else
  for _, id in ipairs(report.started) do redis.call('HINCRBY', requests_key, id, 1) end
  for _, id in ipairs(report.finished) do
    if redis.call('HINCRBY', requests_key, id, -1) <= 0 then redis.call('HDEL', requests_key, id) end
  end
end
redis.call('PEXPIRE', requests_key, lease_ms)
local live = redis.call('ZRANGEBYSCORE', p .. 'replicas', now, '+inf')
local loads = {}
for _, replica in ipairs(live) do
  if replica ~= me then
    local fields = redis.call('HGETALL', p .. 'load:' .. replica)
    for i = 1, #fields, 2 do loads[fields[i]] = (loads[fields[i]] or 0) + tonumber(fields[i + 1]) end
  end
end
local alive = {}
for _, replica in ipairs(live) do alive[replica] = true end
local limits = {}
for model, limit in pairs(report.limits) do
  local key = p .. 'limits:' .. model
  redis.call('HSET', key, me, limit)
  redis.call('EXPIRE', key, 3600)
  local fields = redis.call('HGETALL', key)
  for i = 1, #fields, 2 do
    if alive[fields[i]] or fields[i] == me then
      local value = tonumber(fields[i + 1])
      if limits[model] == nil or value < limits[model] then limits[model] = value end
    else
      redis.call('HDEL', key, fields[i])
    end
  end
end
local disabled = {}
local switches = redis.call('HGETALL', p .. 'disabled')
for i = 1, #switches, 2 do disabled[switches[i]] = switches[i + 1] == '1' end
local aborts_key = p .. 'aborts:' .. me
local aborts = redis.call('LRANGE', aborts_key, 0, -1)
redis.call('DEL', aborts_key)
return cjson.encode({loads = loads, limits = limits, disabled = disabled, aborts = aborts, replicas = live})
"""

# Ask every replica for `request_id`, at once: the question is published to all of them (each that holds the id
# aborts it and every one replies, see redis_state), and queued for each live replica whose registry has it, which
# collects it at its next sync should it miss the message (a client may reuse an id: all holders are cancelled).
#   ARGV: prefix, request id, the asking replica (it aborts its own at once, without a queue), the question (JSON)
#   Returns: how many replicas heard the question, then the other live replicas whose registry has the id
ABORT = NOW + """
local p, id, asking = ARGV[1], ARGV[2], ARGV[3]
local owners = {0}
for _, replica in ipairs(redis.call('ZRANGEBYSCORE', p .. 'replicas', now, '+inf')) do
  if replica ~= asking and redis.call('HEXISTS', p .. 'requests:' .. replica, id) == 1 then
    redis.call('RPUSH', p .. 'aborts:' .. replica, id)
    redis.call('EXPIRE', p .. 'aborts:' .. replica, 60)
    owners[#owners + 1] = replica
  end
end
owners[1] = redis.call('PUBLISH', p .. 'abort', ARGV[4])
return owners
"""

# A replica stopping cleanly takes its lease and its shares back at once (a killed one's lapse with the lease).
#   ARGV: prefix, replica
LEAVE = """
local p, me = ARGV[1], ARGV[2]
redis.call('ZREM', p .. 'replicas', me)
for _, tenant in ipairs(redis.call('SMEMBERS', p .. 'conc_tenants:' .. me)) do
  redis.call('HDEL', p .. 'conc:' .. tenant, me)
end
redis.call('DEL', p .. 'conc_tenants:' .. me, p .. 'conc_floor:' .. me, p .. 'load:' .. me, p .. 'requests:' .. me,
           p .. 'aborts:' .. me)
return 1
"""
