"""Crucible gateway: the HTTP job API in front of Redis and the RQ queues."""
