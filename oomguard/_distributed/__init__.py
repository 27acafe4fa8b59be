"""Keeping every rank of a distributed job in agreement, so that an OOM on one rank never hangs the others."""
