"""Failure handler: suspects, freezes and recovers failed storage replicas (dissertation 4.2.5).

Not yet implemented: today a replica failure stops inserts on its shard until the
replica is restarted (clients redirect inserts to other shards), and subscribers wait
for that shard.
"""
