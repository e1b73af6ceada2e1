"""Processes: worker specs and records, the fork server, exec, deadlines, reaping, CPU pinning."""
