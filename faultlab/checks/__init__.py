"""Checks: invariants over snapshots and over a trace's history. They see only data."""
