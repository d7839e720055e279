"""Membership management service: starts an epoch every interval, replicated through ZooKeeper."""
