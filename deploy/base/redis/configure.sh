#!/bin/sh
# Writes this pod's redis.conf and sentinel.conf into /conf (an emptyDir: sentinel rewrites its file).
# The master is whoever the sentinels name now (after a failover, not redis-0); with no sentinel answering
# (the first start), redis-0. Addresses are the pods' stable DNS names (Service redis-headless).
set -eu
SERVICE=redis-headless
MASTER_SET=kvgate
ME="$(hostname).$SERVICE"
MASTER=""
for peer in redis-0 redis-1 redis-2; do
  MASTER="$(timeout 3 redis-cli -h "$peer.$SERVICE" -p 26379 --raw \
    sentinel get-master-addr-by-name "$MASTER_SET" 2>/dev/null | head -n 1 || true)"
  [ -n "$MASTER" ] && break
done
[ -n "$MASTER" ] || MASTER="redis-0.$SERVICE"
{
  echo "port 6379"
  echo "dir /data"
  echo "appendonly yes"
  echo "protected-mode no"
  echo "replica-announce-ip $ME"
  [ "$MASTER" = "$ME" ] || echo "replicaof $MASTER 6379"
} > /conf/redis.conf
cat > /conf/sentinel.conf <<CONF
port 26379
dir /tmp
sentinel resolve-hostnames yes
sentinel announce-hostnames yes
sentinel announce-ip $ME
sentinel monitor $MASTER_SET $MASTER 6379 2
sentinel down-after-milliseconds $MASTER_SET 5000
sentinel failover-timeout $MASTER_SET 60000
sentinel parallel-syncs $MASTER_SET 1
CONF
echo "configured $ME with master $MASTER"
